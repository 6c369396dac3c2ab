"""The quarantine: bad files moved aside into ``<root>/.quarantine`` (never served again), kept for inspection
within a count and a byte cap, oldest removed first."""

from __future__ import annotations

import contextlib
import os
import time

from .. import fileio

QUARANTINE = ".quarantine"
QUARANTINE_KEEP = 32  # newest quarantined files kept for inspection
QUARANTINE_MAX_BYTES = 2 * 1024**3  # and at most this many bytes of them: the oldest go first (counted)


def move_aside(root: str, path: str, cap_bytes: int, ops: fileio.FileOps = fileio.DEFAULT_OPS) -> int:
    """Move ``path`` into ``root``'s quarantine (removed, if it cannot be moved) and trim the quarantine to its
    caps: how many old files that removed. Blocking: a worker thread on an event loop."""
    qdir = os.path.join(root, QUARANTINE)
    with contextlib.suppress(OSError):
        os.makedirs(qdir, mode=0o700, exist_ok=True)
    dest = os.path.join(qdir, f"{int(time.time() * 1000)}-{os.path.basename(path)}")
    try:
        os.rename(path, dest)
    except OSError:
        fileio.remove_quietly(ops, path)
    return trim_quarantine(qdir, QUARANTINE_KEEP, cap_bytes, ops)


def trim_quarantine(qdir: str, keep: int, cap_bytes: int, ops: fileio.FileOps = fileio.DEFAULT_OPS) -> int:
    """Remove the oldest quarantined files until at most ``keep`` remain, holding at most ``cap_bytes``: how many
    went. Names start with the millisecond they were moved, so name order is age order."""
    try:
        names = sorted(os.listdir(qdir))
    except OSError:
        return 0
    sizes = []
    for name in names:
        try:
            sizes.append(os.lstat(os.path.join(qdir, name)).st_size)
        except OSError:
            sizes.append(0)
    total, removed = sum(sizes), 0
    for i, (name, size) in enumerate(zip(names, sizes, strict=True)):
        if len(names) - i <= keep and total <= cap_bytes:
            break
        fileio.remove_quietly(ops, os.path.join(qdir, name))
        total -= size
        removed += 1
    return removed
