"""A read-only listing of a store's entries (``spilld ls``, ``spilld inspect``): safe beside a running daemon."""

from __future__ import annotations

import os
import stat
from typing import Any

from .. import blocks, errors, fileio
from ..loader import read_own_header
from ..lockfile import LOCK_NAME
from .folders import folder_names, namespace_folders
from .pins import PINS_FILE, read_pins

EXT = ".spilld"  # an entry's file (a manifest, or a whole entry); blocks have their own suffix
QUARANTINE = ".quarantine"  # the folder at a store's root where bad files are moved aside (quarantine.py)
STORE_MARKS = (LOCK_NAME, PINS_FILE, QUARANTINE)  # names at a store's root that only spilld makes there


def looks_like_store(root: str) -> bool:
    """``root`` is a store: a daemon made its lock there (or its pins file, or its quarantine), or a folder named as
    spilld names them holds an entry or a block. A command that would write or remove there refuses any other
    folder (found in review: ``evict --dir`` on a user's folder made a lock file there and removed empty folders)."""
    if any(os.path.lexists(os.path.join(root, name)) for name in STORE_MARKS):
        return True
    return any(
        name.endswith((EXT, blocks.BLOCK_EXT))
        for folder, _, _ in namespace_folders(root)
        for name in folder_names(folder)
    )


def list_entries(root: str) -> list[dict[str, Any]]:
    """Every readable entry under ``root``, newest use first; files that cannot be read are left out. ``bytes``
    is the entry's own file; ``block_bytes`` those of the blocks it names, found beside it (shared ones counted in
    each entry that names them); ``folder_block_bytes`` the blocks of its folder, each once."""
    rows: list[dict[str, Any]] = []
    if not os.path.isdir(root):
        return rows
    pinned = set(read_pins(root))  # (found in review: a pin showed nowhere but in status --json's count)
    for folder, fp, _ in namespace_folders(root):
        found = _block_files(folder)
        shared = sum(found.values())
        for name in sorted(folder_names(folder)):
            if not name.endswith(EXT) or fileio.is_temp_name(name):
                continue
            path = os.path.join(folder, name)
            try:
                st = os.lstat(path)
                h = read_own_header(path)  # a symbolic link is not listed, as the scan does not index it
            except (errors.SpillError, OSError):
                continue
            named = h.blocks.keys if h.blocks is not None else []
            rows.append({
                "path": path, "fingerprint": fp, "model_id": h.identity.model_id, "namespace": h.identity.namespace,
                "tokens": len(h.tokens), "bytes": st.st_size, "last_used": st.st_mtime, "trimmable": h.trimmable,
                "checkpoint": h.checkpoint.key if h.checkpoint else None, "blocks": len(named),
                "block_bytes": sum(found.get(k, 0) for k in named), "folder_block_bytes": shared,
                "pinned": path in pinned,
            })  # fmt: skip
    return sorted(rows, key=lambda r: r["last_used"], reverse=True)


def _block_files(folder: str) -> dict[bytes, int]:
    """The size of each block file in ``folder``, by key (one file a key: the first listed)."""
    out: dict[bytes, int] = {}
    for name in folder_names(folder):
        key = blocks.key_of_name(name)
        if key is None or key in out or fileio.is_temp_name(name):
            continue
        try:
            st = os.lstat(os.path.join(folder, name))
        except OSError:
            continue
        if stat.S_ISREG(st.st_mode):  # as the scan indexes blocks
            out[key] = st.st_size
    return out
