"""File publishing: temp file, full positional writes, fsync policy, rename, folder fsync.

``FileOps`` is the one place that calls the OS, so tests can inject faults
(short writes, ENOSPC, EIO, crashes between syscalls) by overriding its methods.
"""

from __future__ import annotations

import errno
import os
import secrets
import stat
import sys
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, suppress
from enum import StrEnum
from typing import Any

from . import errors

TEMP_SUFFIX = ".spilld-tmp"
IOV_MAX = 1024  # Linux and macOS both accept at least this many buffers per call


class Durability(StrEnum):
    """How hard a publish pushes bytes to stable storage."""

    FULL = "full"  # F_FULLFSYNC on macOS (drive cache flushed); fsync elsewhere
    FSYNC = "fsync"  # fsync of the file and of its folder (default)
    NONE = "none"  # no syncs: fast, survives a process crash but not a power loss


def temp_path_for(path: str) -> str:
    """A hidden temp name beside ``path``, unique per save."""
    folder, name = os.path.split(path)
    return os.path.join(folder, f".{name}.{secrets.token_hex(6)}{TEMP_SUFFIX}")


def is_temp_name(name: str) -> bool:
    return name.startswith(".") and name.endswith(TEMP_SUFFIX)


@contextmanager
def io_errors(what: str, path: str) -> Iterator[None]:
    """Turn an OSError into a typed StorageError (DiskFull for ENOSPC/EDQUOT) naming the file."""
    try:
        yield
    except OSError as exc:
        cls = errors.DiskFull if exc.errno in (errno.ENOSPC, errno.EDQUOT) else errors.StorageError
        raise cls(f"{what} failed: {exc.strerror or exc}", path=path, errno=exc.errno) from exc


def is_regular(path: str, unreadable: bool = False) -> bool:
    """``path`` is a regular file itself, never followed through a symbolic link (one named like spilld's files is
    someone else's); ``unreadable`` is the answer when it cannot be looked at."""
    try:
        return stat.S_ISREG(os.lstat(path).st_mode)
    except OSError:
        return unreadable


def known_absent(path: str) -> bool:
    """``path`` is known not to be there: its lookup said ENOENT or ENOTDIR. Any other error (EIO, EACCES, ESTALE)
    says nothing about it (found in review: ``os.path.exists`` reads every error as absence, and a block whose stat
    failed with EIO was taken for gone, so every entry naming it was deleted)."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return True
    except OSError:
        return False
    return False


def open_regular(path: str, flags: int = 0) -> int:
    """``path`` opened for reading (with ``flags`` more) if it is a regular file; else OSError (EINVAL). Opened
    without blocking, so a FIFO named like a cache file (no writer at its other end) is refused at once instead of
    hanging its reader."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | flags)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file (a folder, FIFO, socket or device)")
    except BaseException:
        os.close(fd)
        raise
    return fd


class FileOps:
    """The raw syscalls of the save and load paths, one method each.

    Methods raise plain OSError; callers wrap them with ``io_errors``. Tests
    override single methods to inject short writes, ENOSPC, EIO or crashes.
    """

    def open_new(self, path: str, flags: int = 0) -> int:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | flags, 0o644)

    def ftruncate(self, fd: int, size: int) -> None:
        os.ftruncate(fd, size)

    def open_read(self, path: str) -> int:
        return open_regular(path)

    def open_dir(self, path: str) -> int:
        return os.open(path or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))

    def fallocate(self, fd: int, size: int) -> None:
        os.posix_fallocate(fd, 0, size)

    def pwritev(self, fd: int, bufs: Sequence[memoryview], offset: int) -> int:
        return os.pwritev(fd, bufs, offset)

    def preadv(self, fd: int, bufs: Sequence[memoryview], offset: int) -> int:
        return os.preadv(fd, bufs, offset)

    def start_writeback(self, fd: int) -> None:
        """Start writing a file's dirty pages to the device without waiting for them (Linux ``sync_file_range``;
        elsewhere nothing): a later fsync finds them written or on their way."""
        start_writeback(fd)

    def fsync(self, fd: int, durability: Durability) -> None:
        if durability is Durability.FULL and sys.platform == "darwin":
            import fcntl

            fcntl.fcntl(fd, fcntl.F_FULLFSYNC)  # type: ignore[attr-defined]
        else:
            os.fsync(fd)

    def close(self, fd: int) -> None:
        os.close(fd)

    def rename(self, src: str, dst: str) -> None:
        os.rename(src, dst)

    def unlink(self, path: str) -> None:
        os.unlink(path)

    def mkdir(self, path: str, mode: int = 0o700) -> None:
        os.mkdir(path, mode)


def preallocate(ops: FileOps, fd: int, size: int, path: str) -> None:
    """Allocate blocks up front: writes then run at device speed (feasibility §5)."""
    if size <= 0 or not hasattr(os, "posix_fallocate"):
        return
    try:
        ops.fallocate(fd, size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
            return  # the filesystem cannot; plain writes still work
        with io_errors("preallocate", path):
            raise


def write_all(ops: FileOps, fd: int, bufs: Sequence[memoryview], offset: int, path: str) -> None:
    """Write every buffer at ``offset`` onward, resuming after short writes."""
    pending = [b for b in bufs if b.nbytes]
    with io_errors("write", path):
        at = _vectored(ops.pwritev, fd, pending, offset, sum(b.nbytes for b in pending))
        if at is not None:
            raise OSError(errno.EIO, "write made no progress")


def read_all(
    ops: FileOps, fd: int, bufs: Sequence[memoryview], offset: int, path: str, nbytes: int | None = None
) -> None:
    """Fill every buffer from ``offset`` onward; a file that ends early is truncated. ``nbytes``: their total,
    when the caller knows it (a block read is 64 buffers: walking them again costs as much as the call)."""
    if nbytes is None:
        bufs = [b for b in bufs if b.nbytes]
        nbytes = sum(b.nbytes for b in bufs)
    with io_errors("read", path):
        at = _vectored(ops.preadv, fd, bufs, offset, nbytes)
        if at is not None:
            raise errors.TruncatedFile(f"file ended at {at} during a tensor read", path=path)


def _vectored(
    call: Callable[[int, Sequence[memoryview], int], int], fd: int, bufs: Sequence[memoryview], offset: int, left: int
) -> int | None:
    """Move ``left`` bytes between ``bufs`` and the file from ``offset`` on, resuming after short calls; the offset
    where a call moved nothing (the file's end, for a read), else None."""
    while left:
        n = call(fd, bufs[:IOV_MAX], offset)
        if n <= 0:
            return offset
        offset, left = offset + n, left - n
        if left:  # a short call (or more buffers than one call takes)
            bufs = _advance(bufs, n)
    return None


def sync(ops: FileOps, fd: int, durability: Durability, path: str) -> None:
    if durability is not Durability.NONE:
        with io_errors("fsync", path):
            ops.fsync(fd, durability)


def sync_dir(ops: FileOps, folder: str, durability: Durability) -> None:
    """Make a rename durable: fsync the folder that holds the new name."""
    if durability is Durability.NONE:
        return
    with io_errors("open folder", folder):
        fd = ops.open_dir(folder)
    try:
        sync(ops, fd, durability, folder)
    finally:
        with io_errors("close folder", folder):
            ops.close(fd)


def make_dirs(ops: FileOps, folder: str, durability: Durability) -> list[str]:
    """Create ``folder`` and any missing parents (0700: only what we create), durably; return those created.

    A new folder's name lives in its parent, so each one created is fsynced, and its parent, before any
    file below it may be called stored: otherwise a power loss could take the folder, and the entry
    with it, after we said the entry was durable.
    """
    missing: list[str] = []
    d = os.path.abspath(folder)
    while not os.path.isdir(d):
        missing.append(d)
        parent = os.path.dirname(d)
        if parent == d:
            break
        d = parent
    created: list[str] = []
    for d in reversed(missing):
        try:
            with io_errors("create folder", d):
                ops.mkdir(d, 0o700)
        except errors.StorageError as exc:
            if exc.errno != errno.EEXIST or not os.path.isdir(d):  # another writer made it first: fine
                raise
        else:
            created.append(d)
    sync_folders(ops, created, durability)
    return created


def sync_folders(ops: FileOps, folders: Sequence[str], durability: Durability) -> None:
    """fsync each folder and its parent, deepest first, each once."""
    done: set[str] = set()
    for d in reversed(folders):
        for f in (d, os.path.dirname(d)):
            if f not in done:
                done.add(f)
                sync_dir(ops, f, durability)


def probe_writable(ops: FileOps, folder: str) -> None:
    """Write, fsync and remove a small file in ``folder``: raises StorageError unless writes can land there."""
    path = os.path.join(folder, f".probe.{secrets.token_hex(6)}{TEMP_SUFFIX}")
    with io_errors("create a probe file", path):
        fd = ops.open_new(path)
    try:
        try:
            write_all(ops, fd, [memoryview(b"spilld write probe\n")], 0, path)
            sync(ops, fd, Durability.FSYNC, path)
        except BaseException:
            with suppress(OSError):  # the write's error is the one said
                ops.close(fd)
            raise
        with io_errors("close a probe file", path):  # (found in review: a raw EIO, and a probe left each start)
            ops.close(fd)
    finally:
        remove_quietly(ops, path)


def check_replaceable(path: str) -> None:
    """A file spilld replaces by name (its pins, its wear count) is missing or a regular file; else (found in review:
    a user's symbolic link there was replaced by a regular file) a StorageError, and nothing should be written."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        raise errors.StorageError(f"cannot be checked: {exc.strerror or exc}", path=path, errno=exc.errno) from exc
    if not stat.S_ISREG(mode):
        raise errors.StorageError("not a regular file (a symbolic link, folder or FIFO): left as it is", path=path)


def publish_bytes(ops: FileOps, path: str, data: bytes, durability: Durability) -> None:
    """``data`` to a temp file beside ``path``, made durable, renamed to ``path``; the temp removed on failure.
    The folder is the caller's to sync (``sync_dir``), once for all it publishes."""
    publish_all(ops, [(path, data)], durability)


PUBLISH_AHEAD = 64  # files ``publish_all`` writes ahead of their fsync at most (each holds an fd until then)


def publish_all(ops: FileOps, files: Sequence[tuple[str, bytes]], durability: Durability) -> None:
    """Each ``(path, data)`` published as ``publish_bytes`` does, but written up to ``PUBLISH_AHEAD`` files ahead of
    its fsync, its writeback started as soon as it is written: the device gets them all at once, and the bytes stay
    in the page cache for a load that follows (32 files of 8 MiB on the 2-core VM: 0.1 s, against 0.4-0.9 s each
    written and synced in turn; O_DIRECT leaves them cold). Renamed once all are durable. All or nothing: on a
    failure every temp file and every name already published is removed."""
    temps: list[str] = []
    ahead: deque[tuple[str, int]] = deque()  # (temp, fd) written and not yet synced
    published: list[str] = []
    try:
        for path, data in files:
            temps.append(tmp := temp_path_for(path))
            with io_errors("create", tmp):
                ahead.append((tmp, ops.open_new(tmp)))
            write_all(ops, ahead[-1][1], [memoryview(data)], 0, tmp)
            if durability is not Durability.NONE:
                with io_errors("start writeback", tmp):
                    ops.start_writeback(ahead[-1][1])
            if len(ahead) > PUBLISH_AHEAD:
                _sync_and_close(ops, *ahead.popleft(), durability)
        while ahead:
            _sync_and_close(ops, *ahead.popleft(), durability)
        for tmp, (path, _) in zip(temps, files, strict=True):
            with io_errors("rename", path):
                ops.rename(tmp, path)
            published.append(path)
    except BaseException:
        for _, fd in ahead:
            with suppress(OSError):
                ops.close(fd)
        for p in (*temps, *published):
            remove_quietly(ops, p)
        raise


def _sync_and_close(ops: FileOps, path: str, fd: int, durability: Durability) -> None:
    try:
        sync(ops, fd, durability, path)
    finally:
        with io_errors("close", path):  # NFS and FUSE report a deferred write error here (found in review: raw)
            ops.close(fd)


_SYNC_FILE_RANGE_WRITE = 2
_sync_file_range: Any = None  # libc's once found; False where there is none


def start_writeback(fd: int) -> None:
    """``sync_file_range(fd, 0, 0, SYNC_FILE_RANGE_WRITE)`` where libc has it (Linux); a no-op elsewhere."""
    global _sync_file_range
    if _sync_file_range is None:
        import ctypes

        _sync_file_range = libc_call("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])
    if _sync_file_range and _sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE) != 0:
        import ctypes

        err = ctypes.get_errno()
        if err not in (errno.EINVAL, errno.ENOSYS, errno.ESPIPE):  # a filesystem that cannot: the fsync does it
            raise OSError(err, os.strerror(err))


def libc_call(name: str, argtypes: list[Any]) -> Any:
    """libc's function ``name`` (taking ``argtypes``, returning an int, setting errno), or False where there is
    none: not Linux, or a libc without it."""
    if sys.platform != "linux":
        return False
    try:
        import ctypes

        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return False
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn


def remove_quietly(ops: FileOps, path: str) -> None:
    with suppress(OSError):
        ops.unlink(path)


def _advance(bufs: Sequence[memoryview], n: int) -> Sequence[memoryview]:
    """Drop ``n`` bytes from the front of a buffer list (one pass: a read of 64 runs is not 64 list copies)."""
    for i, b in enumerate(bufs):
        if n < b.nbytes:
            return [b[n:], *bufs[i + 1 :]] if n else bufs[i:]
        n -= b.nbytes
    return []


DEFAULT_OPS = FileOps()


class OwnFileOps(FileOps):
    """``FileOps`` for reads of a store's own files: spilld only ever fills its folders with regular files, so a
    symbolic link found there (even one swapped in after the scan) is someone else's, refused (ELOOP), never read."""

    def open_read(self, path: str) -> int:
        return open_regular(path, os.O_NOFOLLOW)


OWN_OPS = OwnFileOps()
