"""A read-only listing of a store's entries (``spilld ls``, ``spilld inspect``): safe beside a running daemon."""

from __future__ import annotations

import os
from typing import Any

from .. import errors, fileio
from ..loader import read_header

EXT = ".spilld"  # an entry's file (a manifest, or a whole entry); blocks have their own suffix


def list_entries(root: str) -> list[dict[str, Any]]:
    """Every readable entry under ``root``, newest use first; files that cannot be read are left out."""
    rows: list[dict[str, Any]] = []
    if not os.path.isdir(root):
        return rows
    for fp in sorted(os.listdir(root)):
        fp_dir = os.path.join(root, fp)
        if fp.startswith(".") or not os.path.isdir(fp_dir):
            continue
        for dirpath, _, names in os.walk(fp_dir):
            for name in names:
                if not name.endswith(EXT) or fileio.is_temp_name(name):
                    continue
                path = os.path.join(dirpath, name)
                try:
                    h = read_header(path)
                    st = os.stat(path)
                except (errors.SpillError, OSError):
                    continue
                rows.append({
                    "path": path, "fingerprint": fp, "model_id": h.identity.model_id, "namespace": h.identity.namespace,
                    "tokens": len(h.tokens), "bytes": st.st_size, "last_used": st.st_mtime, "trimmable": h.trimmable,
                    "checkpoint": h.checkpoint.key if h.checkpoint else None,
                })  # fmt: skip
    return sorted(rows, key=lambda r: r["last_used"], reverse=True)
