"""A store's folders: the ones a save is writing into (claimed), and the sweep that removes those left empty."""

from __future__ import annotations

import contextlib
import os
import re
import threading
from collections import Counter
from collections.abc import Callable, Iterator

# The names spilld gives its folders (entries.identity_fingerprint, namespace_hash): 16 hex digits, or "base".
# The sweep removes no other folder, however empty: a user's folders under --dir are theirs.
_HEX16 = re.compile(r"[0-9a-f]{16}")


def is_identity_folder(name: str) -> bool:
    """A name spilld gives a model's folder (``identity_fingerprint``)."""
    return _HEX16.fullmatch(name) is not None


def is_namespace_folder(name: str) -> bool:
    """A name spilld gives a namespace's folder (``namespace_hash``)."""
    return name == "base" or _HEX16.fullmatch(name) is not None


def identity_folders(root: str) -> Iterator[tuple[str, str]]:
    """(folder, its name) of every identity folder under ``root``, named as spilld names them."""
    for fp in sorted(os.listdir(root)):
        if is_identity_folder(fp) and os.path.isdir(fp_dir := os.path.join(root, fp)):
            yield fp_dir, fp


def namespace_folders(root: str) -> Iterator[tuple[str, str, str]]:
    """(folder, identity folder name, namespace folder name) of every namespace folder under ``root``: only folders
    named as spilld names them (a user's folder under ``root``, even a copy of one of ours, is theirs)."""
    for fp_dir, fp in identity_folders(root):
        for ns in sorted(folder_names(fp_dir)):
            if is_namespace_folder(ns) and os.path.isdir(folder := os.path.join(fp_dir, ns)):
                yield folder, fp, ns


def folder_names(folder: str) -> list[str]:
    """The names in ``folder``; none when it went meanwhile (the empty-folder sweep of a running store), or cannot
    be listed: a walk of a live store skips it rather than fail."""
    try:
        return os.listdir(folder)
    except (FileNotFoundError, NotADirectoryError, PermissionError):
        return []


def unlistable_folders(root: str) -> list[str]:
    """The folders a walk of ``root`` looks into (the root, its model and namespace folders) that cannot be listed:
    a walk skips them, so a command that reports on a whole store must say so."""
    folders = [root, *(d for d, _ in identity_folders(root)), *(f for f, _, _ in namespace_folders(root))]
    out = []
    for folder in folders:
        try:
            os.listdir(folder)
        except PermissionError:
            out.append(folder)
        except OSError:  # gone meanwhile, or not a folder: nothing of ours to report
            continue
    return out


class FolderClaims:
    """Folders a save writes into, counted: the sweep of empty folders leaves a claimed one, and its model folder,
    alone until released. Thread-safe: saves claim on the loop, the sweep runs on a worker thread.

    ``on_removed`` is told of each folder the sweep removes, before any save can claim it again.
    """

    def __init__(self, on_removed: Callable[[str], None] | None = None) -> None:
        self._busy: Counter[str] = Counter()
        # orders "this folder is busy" against "this empty folder goes"; held for those marks only, never across
        # a filesystem call (the loop takes it to claim: a hung rmdir must not hold the loop, found in review)
        self._lock = threading.Lock()
        self._removing: set[str] = set()  # folders the sweep is removing now (its rmdir under way)
        self._on_removed = on_removed

    def claim(self, folder: str) -> None:
        with self._lock:
            self._busy[folder] += 1

    def removing(self, folder: str) -> bool:
        """The sweep is removing ``folder`` or its model folder now: a save that claimed it waits for that to end
        before it makes the folder (it may be gone after)."""
        with self._lock:
            return folder in self._removing or os.path.dirname(folder) in self._removing

    def release(self, folder: str) -> None:
        with self._lock:
            self._busy[folder] -= 1
            if self._busy[folder] <= 0:
                del self._busy[folder]

    def rmdir_unless_claimed(self, folder: str) -> None:
        """Remove ``folder`` if it is empty and neither it nor a folder under it is claimed; a save that claims it
        meanwhile waits for the removal's end (``removing``), and ``on_removed`` is told before that end."""
        with self._lock:
            if any(b == folder or b.startswith(folder + os.sep) for b in self._busy):
                return
            self._removing.add(folder)
        removed = False
        try:
            os.rmdir(folder)  # only succeeds when empty
            removed = True
        except OSError:
            pass
        finally:
            with self._lock:
                if removed and self._on_removed is not None:
                    self._on_removed(folder)
                self._removing.discard(folder)


def remove_empty_folders(root: str, claims: FolderClaims | None = None) -> None:
    """Identity and namespace folders under ``root`` left empty go (rmdir refuses a folder that is not empty);
    with ``claims``, none a save has claimed. Blocking: a worker thread on an event loop."""
    for fp_dir, _ in identity_folders(root):
        for ns in folder_names(fp_dir):
            if is_namespace_folder(ns):
                _rmdir(os.path.join(fp_dir, ns), claims)
        _rmdir(fp_dir, claims)


def _rmdir(folder: str, claims: FolderClaims | None) -> None:
    if claims is not None:
        claims.rmdir_unless_claimed(folder)
        return
    with contextlib.suppress(OSError):
        os.rmdir(folder)
