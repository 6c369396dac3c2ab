"""The pins file: which entries are pinned (evicted last, never superseded), kept across restarts.

``<root>/.spilld-pins`` lists the pinned entries' paths relative to the root, one a line; it is replaced
atomically and durably. Anything but a regular file at that name (a symbolic link, a FIFO) is someone else's: never
read through, never replaced. A name that would lead outside the root is ignored. Each rewrite merges: the file's
current names with one writer's own changes, one writer at a time across processes, so two writers of a folder
(Spillers sharing it) and a scan that could not read an entry never drop another's pin.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping

from .. import fileio
from ..lockfile import updating

PINS_FILE = ".spilld-pins"
PINS_MAX_BYTES = 1 << 24  # the most of the file read: far more names than a disk cap's worth of entries


def read_pins(root: str) -> list[str]:
    """The pinned paths the file under ``root`` names (none if it is missing or unreadable)."""
    return _read_names(root) or []


def _read_names(root: str) -> list[str] | None:
    """``read_pins``, but None if the file is there and cannot be read (EIO, EMFILE, not text, not a file)."""
    try:
        # a FIFO there is refused, never waited on; a symbolic link never followed (ELOOP)
        fd = fileio.open_regular(os.path.join(root, PINS_FILE), os.O_NOFOLLOW)
        with open(fd, encoding="utf-8") as f:
            text = f.read(PINS_MAX_BYTES)
            names = text.splitlines()
            if f.read(1):  # cut at the bound: its last name may be cut too, and is not taken
                names = names[:-1]
    except FileNotFoundError:
        return []
    except (OSError, UnicodeDecodeError):
        return None
    return [os.path.join(root, n) for n in names if n and not os.path.isabs(n) and ".." not in n.split("/")]


def write_pins(root: str, pins: list[str], ops: fileio.FileOps, durability: fileio.Durability) -> None:
    """Replace the file: a temp file beside it, renamed over it, the root synced (blocking: a worker thread).
    ``StorageError`` if something other than a regular file is at its name: that is left as it is."""
    path = os.path.join(root, PINS_FILE)
    fileio.check_replaceable(path)
    text = "".join(os.path.relpath(p, root) + "\n" for p in pins).encode()
    fileio.publish_bytes(ops, path, text, durability)
    fileio.sync_dir(ops, root, durability)


def update_pins(
    root: str,
    changes: Mapping[str, bool],
    known: Iterable[str],
    ops: fileio.FileOps,
    durability: fileio.Durability,
) -> None:
    """Replace the file with its current names, ``changes`` (path: pinned or not) applied: another writer's pins
    are kept. A name no one changed whose file is gone (an entry removed by a writer that has not written since)
    is dropped. A file there but unreadable is rebuilt from ``known`` (this writer's pins, judged or not).
    One writer at a time across processes (``lockfile.updating``). Blocking: a worker thread."""
    with updating(root):
        names = _read_names(root)
        pins = {p for p in (known if names is None else names) if p not in changes and not fileio.known_absent(p)}
        pins |= {p for p, on in changes.items() if on}
        write_pins(root, sorted(pins), ops, durability)
