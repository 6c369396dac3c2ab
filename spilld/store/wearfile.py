"""The wear file: the bytes a store wrote per hour, kept across restarts so that ``--write-budget`` holds a day.

``<root>/.spilld-wear`` is a msgpack map of hour (seconds since the epoch // 3600) to bytes written in it, at most
the last 7 days. A store reads it at its scan and adds what it wrote when it stops, the new file synced as the
store's durability says before it replaces the old (a crash loses that run's count:
the budget then errs short by it; stores of one folder add theirs one at a time; a file there that cannot be
read then is left as it is, that run's count not added). Anything but a regular
file at that name is someone else's: never read through, never replaced. A file that is too big, malformed or names
an hour in the future is ignored, said; hours older than the week are dropped.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

import msgpack

from .. import fileio
from ..lockfile import updating

log = logging.getLogger("spilld.store")

WEAR_FILE = ".spilld-wear"
WEAR_MAX_BYTES = 16 * 1024  # 169 hours of two ints each fit in a few KiB: a larger file is not ours
WEAR_HOURS = 7 * 24  # the hours kept before the current one (as ``entries.Wear`` counts them)
MAX_WEAR_BYTES_AN_HOUR = 2**63 - 1  # a count no disk reaches: one past it is not a wear file spilld wrote


def read_wear(root: str, now_hour: int) -> dict[int, int]:
    """The hours of the last week the file records, each with its bytes; none if it is absent or not valid."""
    path = os.path.join(root, WEAR_FILE)
    try:
        data = _read_bytes(path)
    except OSError as exc:
        log.warning("cannot read %s: %s; the write budget counts from now", path, exc)
        return {}
    return _valid(data, path, now_hour)


def _read_bytes(path: str) -> bytes | None:
    """The file's bytes, at most one past ``WEAR_MAX_BYTES`` (None if it is absent); ``OSError`` if it is there
    but cannot be read."""
    try:
        fd = fileio.open_regular(path, os.O_NOFOLLOW)  # a FIFO is refused, a symbolic link never followed
        with open(fd, "rb") as f:
            return f.read(WEAR_MAX_BYTES + 1)
    except FileNotFoundError:
        return None


def _valid(data: bytes | None, path: str, now_hour: int) -> dict[int, int]:
    """``data``'s hours of the last week (no file: none); none, said, if they are not valid."""
    if data is None:
        return {}
    hours = _checked(data, now_hour)
    if hours is None:
        log.warning("%s is not a wear file spilld wrote; the write budget counts from now", path)
        return {}
    return hours


def _checked(data: bytes, now_hour: int) -> dict[int, int] | None:
    """The hours of the last week the map holds (older ones: gone by now), every hour and count a non-negative int
    and none in the future; else None."""
    if len(data) > WEAR_MAX_BYTES:
        return None
    try:  # (a map keyed by a list is a TypeError: found in review, it stopped the daemon's start)
        raw = msgpack.unpackb(data, strict_map_key=False, max_map_len=WEAR_HOURS + 2)
    except (ValueError, TypeError, msgpack.UnpackException):
        return None
    if not isinstance(raw, dict):
        return None
    ok = all(
        type(h) is int and type(n) is int and h <= now_hour and 0 <= n <= MAX_WEAR_BYTES_AN_HOUR for h, n in raw.items()
    )
    # found in review: an hour a week old rejected the whole file, so a week of writes was forgotten an hour later
    return {h: n for h, n in raw.items() if h >= now_hour - WEAR_HOURS} if ok else None


def add_wear(
    root: str, written: Mapping[int, int], now_hour: int, ops: fileio.FileOps, durability: fileio.Durability
) -> None:
    """Add ``written`` to what the file holds now (another store of the folder may have added its own since this
    one read it), dropping hours out of the window, and replace it atomically. ``StorageError`` if something other
    than a regular file is at its name, or if a file there cannot be read (EIO, EMFILE): that is left as it is
    (found in review: it was replaced by this run's count alone, and the week's earlier counts were lost). One
    writer at a time across processes (``lockfile.updating``)."""
    path = os.path.join(root, WEAR_FILE)
    fileio.check_replaceable(path)
    with updating(root):
        with fileio.io_errors("read", path):
            data = _read_bytes(path)
        hours = _valid(data, path, now_hour)
        for h, n in written.items():
            if h >= now_hour - WEAR_HOURS:
                hours[h] = hours.get(h, 0) + n
        # the new file synced before its rename (a power loss then leaves the old count or the new, never an empty
        # file: found in review); the folder is not, so a crash may lose this run's count, no earlier one
        fileio.publish_bytes(ops, path, msgpack.packb(hours), durability)
