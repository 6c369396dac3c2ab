"""The scan at a start: a store's index rebuilt from the files under its root (manifests by their headers, blocks
by their names), with what it found wrong. Temp files are reaped here when the caller may (it holds the folder's
lock); bad files are only reported: the store moves them aside."""

from __future__ import annotations

import logging
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field

from .. import blocks, errors, fileio
from .. import format as fmt
from ..blocks import BLOCK_EXT
from ..entries import Block, identity_fingerprint, namespace_hash
from ..loader import read_own_header
from .folders import folder_names, namespace_folders
from .index import Index
from .listing import EXT

log = logging.getLogger("spilld.store")


@dataclass
class Scanned:
    """What a scan found: the index, the files to move aside (in the order found), the indexed blocks no manifest
    names (a crash took their manifest, or evicted entries left them), and the temp files it removed."""

    index: Index = field(default_factory=Index)
    bad: list[tuple[str, errors.FileFormatError]] = field(default_factory=list)
    orphans: list[Block] = field(default_factory=list)
    reaped_temp: int = 0
    unsure: set[str] = field(default_factory=set)  # folders with a file it could not read now (left alone)
    copies: dict[bytes, list[tuple[str, int]]] = field(default_factory=dict)  # more files of a key indexed already
    stopped: bool = False  # ended before its end (told to): nothing of it may be taken


@dataclass
class ScanTally:
    """How far a scan has gone, counted from its thread as it goes: what a service manager is shown while a big
    store is scanned (found in review: only the index taken at the end was, so no more time was ever asked)."""

    files: int = 0


def scan_root(
    root: str, ops: fileio.FileOps, reap: bool, stopped: Callable[[], bool] = bool, tally: ScanTally | None = None
) -> Scanned:
    """Index every file under ``root``; with ``reap``, remove temp files and spare copies of blocks (only a caller that
    holds the folder's lock may: no other spilld is writing there). Once ``stopped()`` says so (checked between
    files, before anything but temp files is removed) it ends there, ``stopped`` set: a daemon told to stop while it
    scans stops then. Blocking: runs before the store serves."""
    found = Scanned()
    manifests: list[tuple[str, fmt.Header, float]] = []
    for name in os.listdir(root) if reap else []:  # the root's own temp files: a pins file or a probe cut short
        if fileio.is_temp_name(name) and fileio.is_regular(path := os.path.join(root, name)):
            fileio.remove_quietly(ops, path)
            found.reaped_temp += 1
    for folder, fp, ns in namespace_folders(root):
        for name in folder_names(folder):
            if stopped():
                found.stopped = True
                return found
            if tally is not None:
                tally.files += 1
            if (got := _scan_file(found, os.path.join(folder, name), fp, ns, ops, reap)) is not None:
                manifests.append(got)
    _settle_copies(found, ops, reap)
    for path, header, mtime in manifests:  # once every block is known
        missing = [k for k in (header.blocks.keys if header.blocks else []) if k not in found.index.blocks]
        if missing and os.path.dirname(path) in found.unsure:  # one may be the block it could not read
            log.warning("skipped %s: %d of its blocks could not be read now", path, len(missing))
        elif missing:
            found.bad.append((path, errors.BlockMissing(f"{len(missing)} of its blocks are not on disk", path=path)))
        else:
            found.index.add(path, header, mtime, owned=reap, bulk=True)  # alone: ours; else another writer's too
    found.index.sort_heads()
    # A block no manifest names is an orphan, unless a manifest beside it could not be read: it may name it. Such a
    # folder's blocks are not ours to unlink this run (a readable entry's eviction must not take them either).
    for b in [b for b in found.index.blocks.values() if os.path.dirname(b.path) in found.unsure]:
        b.owned = False
        if not b.refs:  # neither indexed nor removed: the next scan decides
            found.index.drop_block(b)
    found.orphans = [b for b in found.index.blocks.values() if not b.refs]
    return found


def _scan_file(
    found: Scanned, path: str, fp: str, ns: str, ops: fileio.FileOps, reap: bool
) -> tuple[str, fmt.Header, float] | None:
    """A block is indexed at once; a manifest is returned (indexed once every block is known); the rest is
    reaped, reported bad, or left alone."""
    name = os.path.basename(path)
    if fileio.is_temp_name(name):
        if reap and fileio.is_regular(path):  # under the folder's lock: no other spilld is writing it
            fileio.remove_quietly(ops, path)
            found.reaped_temp += 1
        return None
    if name.endswith(BLOCK_EXT):
        _scan_block(found, path, name, reap)
        return None
    return _scan_manifest(found, path, fp, ns) if name.endswith(EXT) else None


def _scan_manifest(found: Scanned, path: str, fp: str, ns: str) -> tuple[str, fmt.Header, float] | None:
    """A manifest's checked header and mtime; None for one reported bad, one that is not spilld's (skipped), or one
    unreadable now (left alone, its folder marked unsure: it may name the folder's blocks)."""
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode):  # a user's folder, link or FIFO: no manifest of ours, naming no block
            log.warning("skipped %s: not a regular file (not spilld's)", path)
            return None
        header = read_own_header(path)  # a symbolic link is never followed
        mtime = st.st_mtime
        if identity_fingerprint(header.identity) != fp or namespace_hash(header.identity.namespace) != ns:
            raise errors.HeaderMalformed("file sits in the folder of another identity or namespace", path=path)
        if header.block is not None:
            raise errors.BlockInvalid("a block under a manifest's name", path=path)
    except errors.FileFormatError as exc:
        found.bad.append((path, exc))
        return None
    except (errors.SpillError, OSError) as exc:  # unreadable now (EMFILE, EIO, EACCES, gone): left alone
        log.warning("skipped %s: %s", path, exc)
        found.unsure.add(os.path.dirname(path))
        return None
    return path, header, mtime


def _scan_block(found: Scanned, path: str, name: str, reap: bool) -> None:
    """A block is indexed by its name (its key) and size; its header and hashes are checked when read."""
    index = found.index
    key = blocks.key_of_name(name)
    if key is None:
        return
    try:
        st = os.lstat(path)
    except OSError as exc:
        log.warning("skipped %s: %s", path, exc)
        found.unsure.add(os.path.dirname(path))
        return
    if not stat.S_ISREG(st.st_mode):  # never ours (found in review: a FIFO indexed as a block poisoned its prefix)
        log.warning("skipped %s: not a regular file", path)
        return
    if key in index.blocks:  # two puts wrote the same block, or a file is misnamed: judged once all are listed
        found.copies.setdefault(key, []).append((path, st.st_size))
        return
    index.add_block(key, path, st.st_size, owned=reap)  # found alone: ours; else another writer's too


def _settle_copies(found: Scanned, ops: fileio.FileOps, reap: bool) -> None:
    """Each key with more than one file: their headers are read (rare: a scan reads no other block's) and one that
    is the block its name says is indexed; only then do the other good copies go, and the bad ones are reported.
    Found in review: the first listed was kept unread and the rest removed, so a misnamed file listed first cost
    the stored entry its block. With none confirmed (unreadable now), the first unreadable one stays indexed and
    nothing is removed; with every copy bad, none is indexed."""
    for key, more in found.copies.items():
        first = found.index.blocks[key]
        found.index.drop_block(first)
        copies = [(first.path, first.nbytes), *more]
        verdicts = [_is_block(found, path, key) for path, _ in copies]
        keep = verdicts.index(True) if True in verdicts else verdicts.index(None) if None in verdicts else None
        if keep is None:
            continue
        found.index.add_block(key, *copies[keep], owned=reap)
        spares = [path for i, (path, _) in enumerate(copies) if verdicts[i] is True and i != keep]
        for path in spares if reap else []:  # none unless ``keep`` is confirmed: the others are good copies
            fileio.remove_quietly(ops, path)


def _is_block(found: Scanned, path: str, key: bytes) -> bool | None:
    """``path`` is block ``key`` of its own folder (True), is not (False: reported bad), or cannot be read now."""
    try:
        h = read_own_header(path)
        if h.block is None or h.block.key != key:
            raise errors.BlockKeyMismatch("a file under the name of a block it is not", path=path)
        fp_dir, ns = os.path.split(os.path.dirname(path))
        if identity_fingerprint(h.identity) != os.path.basename(fp_dir) or namespace_hash(h.identity.namespace) != ns:
            raise errors.HeaderMalformed("block sits in the folder of another identity or namespace", path=path)
    except errors.FileFormatError as exc:
        found.bad.append((path, exc))
        return False
    except (errors.SpillError, OSError) as exc:
        log.warning("could not judge %s, one of several files of a block: %s", path, exc)
        return None
    return True
