"""The pins file: which entries are pinned (evicted last, never superseded), kept across restarts.

``<root>/.spilld-pins`` lists the pinned entries' paths relative to the root, one a line; it is replaced
atomically and durably. A name that would lead outside the root is ignored.
"""

from __future__ import annotations

import os

from .. import fileio

PINS_FILE = ".spilld-pins"
PINS_MAX_BYTES = 1 << 24  # the most of the file read: far more names than a disk cap's worth of entries


def read_pins(root: str) -> list[str]:
    """The pinned paths the file under ``root`` names (none if it is missing or unreadable)."""
    try:
        fd = fileio.open_regular(os.path.join(root, PINS_FILE))  # a FIFO there is refused, never waited on
        with open(fd, encoding="utf-8") as f:
            text = f.read(PINS_MAX_BYTES)
            names = text.splitlines()
            if f.read(1):  # cut at the bound: its last name may be cut too, and is not taken
                names = names[:-1]
    except (OSError, UnicodeDecodeError):
        return []
    return [os.path.join(root, n) for n in names if n and not os.path.isabs(n) and ".." not in n.split("/")]


def write_pins(root: str, pins: list[str], ops: fileio.FileOps, durability: fileio.Durability) -> None:
    """Replace the file: a temp file beside it, renamed over it, the root synced (blocking: a worker thread)."""
    text = "".join(os.path.relpath(p, root) + "\n" for p in pins).encode()
    fileio.publish_bytes(ops, os.path.join(root, PINS_FILE), text, durability)
    fileio.sync_dir(ops, root, durability)
