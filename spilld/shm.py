"""Shared-memory ingest: a client's long-lived pool of named POSIX shared-memory segments.

The client copies a tensor's bytes into a free segment (memcpy speed, on a worker
thread) and sends only the segment's name; the daemon reads it through a file
descriptor into its own buffer (never a mapping: see ``read_segment``) and hands
the segment back (``shm_free``) as soon as it is read. The client hands its pool over
(``shm_pool``) as it makes it: the daemon takes from that connection put_shms naming those
segments only (no client can have it read another's), and unlinks them once the connection
ends (``unlink_segments``): a client killed with its whole process group, its resource
tracker too, leaves nothing in /dev/shm. The pool is made once, off
the event loop, with its room reserved, and reused: fresh pages are slow to fault in
on these machines, and the fixed pool bounds what one client can have in flight.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import re
import secrets
import stat
import sys
import threading
from multiprocessing import resource_tracker, shared_memory

from . import errors, mlxthreads

SEGMENT_BYTES = 32 * 1024 * 1024
POOL_SEGMENTS = 8
READ_THREADS = 4  # the daemon's segment copies at once (each at memcpy speed), on threads of their own
NAME = re.compile(r"spilld-[0-9a-f]{8}-[0-9]{1,4}")  # whole names only (fullmatch); short: macOS allows 31 bytes


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
        self._closed = False

    def make(self) -> None:
        """Create the segments, their room reserved (blocking, ~0.1-0.5 s for the default pool: a worker thread's
        job). ``OSError`` (ENOSPC: /dev/shm is too small) leaves no segment behind; the caller sends inline."""
        try:
            for i in range(self._count):
                # the creator stays tracked: Python unlinks the segment if this process dies first
                seg = shared_memory.SharedMemory(name=f"{self._prefix}-{i}", create=True, size=self.size)
                self._segments[seg.name.lstrip("/")] = seg
                _reserve(seg.name.lstrip("/"), self.size)
        except BaseException:
            self.close()
            raise

    def _ensure(self) -> asyncio.Queue[str]:
        if self._free is None:
            if not self._segments and not self._closed:
                self.make()  # made here (on the caller's thread) only when ``make`` was not called first
            self._free = asyncio.Queue()
            for name in self._segments:
                self._free.put_nowait(name)
        return self._free

    def try_take(self) -> tuple[str, memoryview] | None:
        """A free segment, or None when the daemon holds them all (the caller then sends inline:
        waiting could deadlock, since segments come back only once their spill is written). A closed pool has none:
        found in review, its connection lost while a tensor larger than a segment was sent, the next take found a
        free name whose segment was gone, and the spill failed with ``KeyError`` instead of ``ConnectionLost``."""
        if self._closed:
            return None
        try:
            name = self._ensure().get_nowait()
        except asyncio.QueueEmpty:
            return None
        buf = self._segments[name].buf
        assert buf is not None
        return name, buf

    @property
    def names(self) -> list[str]:
        return list(self._segments)

    @property
    def free(self) -> int:
        return self._ensure().qsize()

    def give(self, name: str) -> None:
        if name in self._segments and self._free is not None:
            self._free.put_nowait(name)

    def close(self) -> None:
        self._closed = True
        for seg in self._segments.values():
            _close_segment(seg)
        self._segments.clear()


def _close_segment(seg: shared_memory.SharedMemory) -> None:
    """Unmap and unlink ``seg``. A view still exported (a copy in flight) keeps its mapping until it is let go, but
    its fd goes now: the standard library's ``close`` raises before it closes it (found in review: each connection
    lost during a copy left an fd holding an unlinked 32 MiB segment's pages until the process ended)."""
    try:
        seg.close()
    except BufferError:
        fd = getattr(seg, "_fd", -1)  # (mmap keeps a descriptor of its own: the mapping stays valid)
        if fd >= 0:
            os.close(fd)
        # the mapping is the views' to end: its last one let go unmaps it (and its ``__del__`` says nothing then:
        # an engine's stderr got "Exception ignored ... BufferError" for every such segment)
        seg._fd, seg._mmap, seg._buf = -1, None, None  # type: ignore[attr-defined]
    try:
        seg.unlink()
    except FileNotFoundError:  # the daemon unlinked it (its connection ended): Python's resource tracker must not
        _untrack(seg)  # try again at exit (it would warn of leaked segments, with a traceback, on the engine's stderr)
    except OSError:  # refused: the next segments are still closed
        pass


def _reserve(name: str, size: int) -> None:
    """Give a new segment its pages now (Linux: ``posix_fallocate`` on /dev/shm). A full /dev/shm then fails here
    with ENOSPC instead of raising SIGBUS, which would kill the engine, when a copy first touches a page."""
    if not sys.platform.startswith("linux"):
        return
    fd = os.open(f"/dev/shm/{name}", os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        os.posix_fallocate(fd, 0, size)
    finally:
        os.close(fd)


_readers: concurrent.futures.ThreadPoolExecutor | None = None
_readers_lock = threading.Lock()


def reader_pool() -> concurrent.futures.ThreadPoolExecutor:
    """Threads for the daemon's segment copies alone (``read_segment``), which never touch a disk. Found in review:
    they ran on the loop's default executor, where the store's file calls run too; on a hung disk those calls,
    given up at their deadline but still stuck, held its every thread, and a spill's copy never began: its commit
    never answered, and its room (kept while a copy is under way) never came back."""
    global _readers
    with _readers_lock:
        if _readers is None:
            _readers = mlxthreads.worker_pool(READ_THREADS, "spilld-shm")
        return _readers


def check_name(name: str) -> None:
    """Refuse a segment name that is not one of a client pool's (before anything is opened or allocated)."""
    if not NAME.fullmatch(name):
        raise ShmRefused(f"bad segment name {name[:64]!r}: expected spilld-<8 hex>-<number>")


def read_segment(name: str, into: memoryview) -> None:
    """Copy the first ``len(into)`` bytes of the client's segment ``name`` into ``into`` (a worker thread's job).

    The segment is opened, checked (a regular file of our uid, private to it, large enough) and read through its
    file descriptor, which is closed before returning, whatever happens: the daemon never maps a client's segment.
    A mapping can lose its pages when the client truncates the segment, and touching them raises SIGBUS, which
    would kill the daemon; a read of a truncated segment only comes back short, which fails this spill alone.
    """
    check_name(name)
    length = into.nbytes
    fd = _open_segment(name)
    try:
        st = os.fstat(fd)  # of what we opened: the name may be replaced meanwhile, the fd not
        if not stat.S_ISREG(st.st_mode):
            raise ShmRefused(f"segment {name} is not a shared-memory file")
        if st.st_uid != os.getuid():
            raise ShmRefused(f"segment {name} belongs to uid {st.st_uid}, not to ours")
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise ShmRefused(f"segment {name} has mode {stat.S_IMODE(st.st_mode):o}: others may read or write it")
        if st.st_size < length:
            raise ShmRefused(f"{length} bytes do not fit in segment {name} of {st.st_size} bytes")
        if sys.platform.startswith("linux"):
            _pread_all(fd, name, into)
        else:
            _copy_mapped(fd, into)
    finally:
        os.close(fd)


def unlink_segments(names: set[str]) -> None:
    """Unlink the segments of a client's pool (a worker thread's job), once the connection it handed them over on
    (``shm_pool``) has ended. One gone already (its client unlinked it first) is skipped, and on Linux anything but
    a regular file of our uid under such a name is left as it is."""
    for name in names:
        if not NAME.fullmatch(name):
            continue
        with contextlib.suppress(OSError):  # gone already, or refused: the next ones are still unlinked
            if sys.platform.startswith("linux"):
                path = f"/dev/shm/{name}"
                st = os.lstat(path)
                if stat.S_ISREG(st.st_mode) and st.st_uid == os.getuid():
                    os.unlink(path)
            else:
                import _posixshmem

                _posixshmem.shm_unlink("/" + name)


def _open_segment(name: str) -> int:
    try:
        if sys.platform.startswith("linux"):
            # O_NOFOLLOW: a link planted under the name is refused; O_NONBLOCK: a FIFO cannot hold the open up
            flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
            return os.open(f"/dev/shm/{name}", flags)
        import _posixshmem

        return int(_posixshmem.shm_open("/" + name, os.O_RDONLY, mode=0o600))
    except OSError as exc:
        raise ShmRefused(f"cannot open segment {name}: {exc.strerror or 'error ' + str(exc.errno)}") from exc


def _pread_all(fd: int, name: str, into: memoryview) -> None:
    pos = 0
    while pos < into.nbytes:
        try:
            n = os.preadv(fd, [into[pos:]], pos)
        except OSError as exc:
            raise ShmRefused(f"cannot read segment {name}: {exc.strerror}") from exc
        if n == 0:
            raise ShmRefused(f"segment {name} shrank to {pos} bytes while it was read ({into.nbytes} were sent)")
        pos += n


def _copy_mapped(fd: int, into: memoryview) -> None:
    # Not Linux (macOS): a POSIX segment there cannot be read(2), and its size, once set, cannot be changed
    # (ftruncate refuses), so a mapping checked against fstat cannot lose its pages while we copy.
    import mmap

    with mmap.mmap(fd, into.nbytes, prot=mmap.PROT_READ) as m, memoryview(m) as view:
        into[:] = view[: into.nbytes]
