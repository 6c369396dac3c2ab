"""The quarantine: bad files moved aside into ``<root>/.quarantine`` (never served again), kept for inspection
within a count and a byte cap, oldest removed first.

Only a real folder at that name is used (a symbolic link there leads to someone else's folder, a file there is
someone's file): otherwise a bad file stays where it is, out of the index. Only names spilld gives the files it
moves there are ever trimmed, listed or removed."""

from __future__ import annotations

import logging
import os
import re
import stat
import time

from .. import fileio
from ..blocks import BLOCK_EXT
from .listing import EXT, QUARANTINE

log = logging.getLogger("spilld.store")

QUARANTINE_KEEP = 32  # newest quarantined files kept for inspection
QUARANTINE_MAX_BYTES = 2 * 1024**3  # and at most this many bytes of them: the oldest go first (counted)
# what ``move_aside`` names a file it moves: the millisecond it moved it, then the name of a manifest or a block
_MOVED_NAME = re.compile(rf"[0-9]+-[^/]+(?:{re.escape(EXT)}|{re.escape(BLOCK_EXT)})")
_refused: set[str] = set()  # roots whose unusable quarantine was already logged (one line a process)


def is_quarantined_name(name: str) -> bool:
    """A name ``move_aside`` gives a file it moves into the quarantine."""
    return _MOVED_NAME.fullmatch(name) is not None


def quarantine_dir(root: str) -> str | None:
    """``root``'s quarantine folder if it is a real folder (not a symbolic link, nor a file); else None."""
    qdir = os.path.join(root, QUARANTINE)
    try:
        return qdir if stat.S_ISDIR(os.lstat(qdir).st_mode) else None
    except OSError:
        return None


def move_aside(root: str, path: str, cap_bytes: int, ops: fileio.FileOps = fileio.DEFAULT_OPS) -> int:
    """Move ``path`` into ``root``'s quarantine (removed, if it cannot be moved) and trim the quarantine to its
    caps: how many old files that removed. If something other than a real folder sits at the quarantine's name,
    ``path`` is left where it is (logged once). Blocking: a worker thread on an event loop."""
    qdir = _made_quarantine(root)
    if qdir is None:
        return 0
    dest = os.path.join(qdir, f"{int(time.time() * 1000)}-{os.path.basename(path)}")
    try:
        os.rename(path, dest)
    except OSError:
        fileio.remove_quietly(ops, path)
    return trim_quarantine(qdir, QUARANTINE_KEEP, cap_bytes, ops)


def _made_quarantine(root: str) -> str | None:
    """The quarantine folder, made if missing; None (said once) if its name holds a link, a file or worse."""
    try:
        os.mkdir(os.path.join(root, QUARANTINE), 0o700)
    except OSError:  # there already (judged below), or cannot be made (then not there: judged below too)
        pass
    qdir = quarantine_dir(root)
    if qdir is None and root not in _refused:
        _refused.add(root)
        log.warning("%s is not a folder spilld may use (a symbolic link or a file): bad files stay where they are, "
                    "unindexed", os.path.join(root, QUARANTINE))  # fmt: skip
    return qdir


def trim_quarantine(qdir: str, keep: int, cap_bytes: int, ops: fileio.FileOps = fileio.DEFAULT_OPS) -> int:
    """Remove the oldest quarantined files until at most ``keep`` remain, holding at most ``cap_bytes``: how many
    went. Names start with the millisecond they were moved, so name order is age order; only regular files named
    as ``move_aside`` names them count, and only they are removed (anything else there is not spilld's)."""
    try:
        names = sorted(n for n in os.listdir(qdir) if is_quarantined_name(n))
    except OSError:
        return 0
    moved: list[tuple[str, int]] = []
    for name in names:
        try:
            st = os.lstat(os.path.join(qdir, name))
        except OSError:
            continue  # removed meanwhile
        if stat.S_ISREG(st.st_mode):
            moved.append((name, st.st_size))
    total, removed = sum(size for _, size in moved), 0
    for i, (name, size) in enumerate(moved):
        if len(moved) - i <= keep and total <= cap_bytes:
            break
        fileio.remove_quietly(ops, os.path.join(qdir, name))
        total -= size
        removed += 1
    return removed
