"""Files whose entries or blocks left a store's index, waiting to be unlinked off the event loop; a file that a
listener still reads (``keep``) waits for as many ``release``."""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Sequence

from .. import fileio
from ..blocks import BLOCK_EXT

UNLINK_PROGRESS_S = 0.5  # a long run of unlinks (an evict's) reports its progress at most this often


class Unlinks:
    """The files to unlink: ``add`` them, ``take`` them to unlink (those kept are held back until released)."""

    def __init__(self) -> None:
        self._paths: list[str] = []
        self._kept: Counter[str] = Counter()  # files a listener reads before they may be unlinked
        self._deferred: set[str] = set()  # files taken while kept: they come back at their last release

    def add(self, path: str) -> None:
        self._paths.append(path)

    def keep(self, path: str) -> None:
        """Hold off the unlink of ``path`` until as many ``release``."""
        self._kept[path] += 1

    def release(self, path: str) -> None:
        """One ``keep`` of ``path`` done: once none is left, a file held back joins those to unlink."""
        self._kept[path] -= 1
        if self._kept[path] <= 0:
            del self._kept[path]
            if path in self._deferred:
                self._deferred.discard(path)
                self._paths.append(path)

    def forget_where(self, pred: Callable[[str], bool]) -> None:
        """Files that are not ours to unlink after all (another spilld owns the folder)."""
        self._paths = [p for p in self._paths if not pred(p)]

    def take(self) -> list[str]:
        """The files to unlink now, manifests before blocks (a crash between them leaves orphan blocks, which a
        scan reclaims, never a manifest naming a block that is gone); those a listener keeps wait for their
        release."""
        paths, self._paths = self._paths, []
        if self._kept:
            self._deferred.update(p for p in paths if p in self._kept)
            paths = [p for p in paths if p not in self._kept]
        return sorted(paths, key=lambda p: p.endswith(BLOCK_EXT))


def unlink_all(
    ops: fileio.FileOps,
    paths: Sequence[str],
    sizes: dict[str, int] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[str]:
    """Remove ``paths``; with ``progress``, tell it the files and bytes left now and then (a long evict's line).
    The paths that could not be removed (EIO, EROFS: anything but "not there") are returned, for a later try: found
    in review, they were dropped, so the disk passed its cap and a restart's scan brought their entries back."""
    sizes = sizes or {}
    left, left_bytes, last = len(paths), sum(sizes.get(p, 0) for p in paths), -math.inf
    failed = []
    for p in paths:
        if progress is not None and time.monotonic() - last >= UNLINK_PROGRESS_S:
            progress(left, left_bytes)
            last = time.monotonic()
        try:
            ops.unlink(p)
        except (FileNotFoundError, NotADirectoryError):  # not there: nothing to remove
            pass
        except OSError:
            failed.append(p)
        left, left_bytes = left - 1, left_bytes - sizes.get(p, 0)
    return failed
