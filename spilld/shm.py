"""Shared-memory ingest: a client's long-lived pool of named POSIX shared-memory segments.

The client copies a tensor's bytes into a free segment (memcpy speed, on a worker
thread) and sends only the segment's name; the daemon maps it and writes the file
straight from it, then hands the segment back (``shm_free``). The pool is made
once and reused: fresh pages are slow to fault in on these machines, and the
fixed pool bounds what one client can have in flight.
"""

from __future__ import annotations

import asyncio
import os
import re
import secrets
import stat
import sys
from multiprocessing import resource_tracker, shared_memory

from . import errors

SEGMENT_BYTES = 32 * 1024 * 1024
POOL_SEGMENTS = 8
NAME = re.compile(r"^spilld-[0-9a-f]{8}-\d{1,4}$")  # short: macOS limits names to 31 bytes


ShmRefused = errors.ShmRefused  # defined in errors.py, where every code is mapped


def _untrack(seg: shared_memory.SharedMemory) -> None:
    # Python's resource tracker would unlink segments it saw at exit, even ones we only attached to.
    try:
        resource_tracker.unregister(seg._name, "shared_memory")  # type: ignore[attr-defined]
    except Exception:  # nothing tracked: nothing to undo
        pass


class ShmPool:
    """The client's segments. ``take`` waits for a free one; ``give`` returns it (when the daemon frees it)."""

    def __init__(self, segments: int = POOL_SEGMENTS, size: int = SEGMENT_BYTES) -> None:
        self.size = size
        self._prefix = f"spilld-{secrets.token_hex(4)}"
        self._segments: dict[str, shared_memory.SharedMemory] = {}
        self._count = segments
        self._free: asyncio.Queue[str] | None = None

    def _ensure(self) -> asyncio.Queue[str]:
        if self._free is None:
            self._free = asyncio.Queue()
            for i in range(self._count):
                # the creator stays tracked: Python unlinks the segment if this process dies first
                seg = shared_memory.SharedMemory(name=f"{self._prefix}-{i}", create=True, size=self.size)
                buf = seg.buf
                assert buf is not None
                buf[:] = bytes(self.size)  # fault the pages in once
                self._segments[seg.name.lstrip("/")] = seg
                self._free.put_nowait(seg.name.lstrip("/"))
        return self._free

    def try_take(self) -> tuple[str, memoryview] | None:
        """A free segment, or None when the daemon holds them all (the caller then sends inline:
        waiting could deadlock, since segments come back only once their spill is written)."""
        try:
            name = self._ensure().get_nowait()
        except asyncio.QueueEmpty:
            return None
        buf = self._segments[name].buf
        assert buf is not None
        return name, buf

    @property
    def free(self) -> int:
        return self._ensure().qsize()

    def give(self, name: str) -> None:
        if name in self._segments and self._free is not None:
            self._free.put_nowait(name)

    def close(self) -> None:
        for seg in self._segments.values():
            try:
                seg.close()
            except BufferError:  # a view still exported: the mapping goes with the process
                pass
            try:
                seg.unlink()
            except FileNotFoundError:
                pass
        self._segments.clear()


class ShmAttachments:
    """The daemon's side: segments of one client, mapped once and checked (name, owner, mode, size)."""

    def __init__(self) -> None:
        self._maps: dict[str, shared_memory.SharedMemory] = {}

    def view(self, name: str, length: int) -> memoryview:
        if not NAME.match(name):
            raise ShmRefused(f"bad segment name {name!r}")
        seg = self._maps.get(name)
        if seg is None:
            if sys.platform.startswith("linux"):
                st = os.stat(f"/dev/shm/{name}")
                if st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
                    raise ShmRefused(f"segment {name} is not private to our uid")
            try:
                seg = shared_memory.SharedMemory(name=name, create=False)
            except (FileNotFoundError, OSError) as exc:
                raise ShmRefused(f"cannot map segment {name}: {exc}") from exc
            _untrack(seg)
            self._maps[name] = seg
        buf = seg.buf
        if buf is None or length > len(buf):
            raise ShmRefused(f"{length} bytes do not fit in segment {name}")
        return buf[:length]

    def close(self) -> None:
        for seg in self._maps.values():
            try:
                seg.close()
            except BufferError:  # a write in flight still reads it; the mapping goes when the process does
                pass
        self._maps.clear()
