"""File publishing: temp file, full positional writes, fsync policy, rename, folder fsync.

``FileOps`` is the one place that calls the OS, so tests can inject faults
(short writes, ENOSPC, EIO, crashes between syscalls) by overriding its methods.
"""

from __future__ import annotations

import errno
import os
import secrets
import sys
from collections.abc import Sequence
from enum import Enum

from . import errors

TEMP_SUFFIX = ".spilld-tmp"
IOV_MAX = 1024  # Linux and macOS both accept at least this many buffers per call


class Durability(str, Enum):
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


def _wrap(exc: OSError, what: str, path: str) -> errors.StorageError:
    cls = errors.DiskFull if exc.errno in (errno.ENOSPC, errno.EDQUOT) else errors.StorageError
    return cls(f"{what} failed: {exc.strerror or exc}", path=path, errno=exc.errno)


class FileOps:
    """The syscalls of the save and load paths. Every OSError becomes a typed StorageError."""

    def open_new(self, path: str) -> int:
        try:
            return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
        except OSError as exc:
            raise _wrap(exc, "open", path) from exc

    def preallocate(self, fd: int, size: int, path: str) -> None:
        # Allocating blocks up front lets writes run at the device speed (feasibility §5).
        if size <= 0 or not hasattr(os, "posix_fallocate"):
            return
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as exc:
            if exc.errno in (errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                return  # the filesystem cannot; plain writes still work
            raise _wrap(exc, "preallocate", path) from exc

    def pwritev(self, fd: int, bufs: Sequence[memoryview], offset: int) -> int:
        return os.pwritev(fd, bufs, offset)

    def write_all(self, fd: int, bufs: Sequence[memoryview], offset: int, path: str) -> None:
        """Write every buffer at ``offset`` onward, resuming after short writes."""
        pending = [b for b in bufs if b.nbytes]
        try:
            while pending:
                batch = pending[:IOV_MAX]
                n = self.pwritev(fd, batch, offset)
                if n <= 0:
                    raise OSError(errno.EIO, "write returned no progress")
                offset += n
                pending = _advance(pending, n)
        except OSError as exc:
            raise _wrap(exc, "write", path) from exc

    def sync(self, fd: int, durability: Durability, path: str) -> None:
        if durability is Durability.NONE:
            return
        try:
            if durability is Durability.FULL and sys.platform == "darwin":
                import fcntl

                fcntl.fcntl(fd, fcntl.F_FULLFSYNC)  # type: ignore[attr-defined]
            else:
                os.fsync(fd)
        except OSError as exc:
            raise _wrap(exc, "fsync", path) from exc

    def close(self, fd: int) -> None:
        os.close(fd)

    def rename(self, src: str, dst: str) -> None:
        try:
            os.rename(src, dst)
        except OSError as exc:
            raise _wrap(exc, "rename", dst) from exc

    def sync_dir(self, folder: str, durability: Durability) -> None:
        """Make a rename durable: fsync the folder that holds the new name."""
        if durability is Durability.NONE:
            return
        try:
            fd = os.open(folder or ".", os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
        except OSError as exc:
            raise _wrap(exc, "open folder", folder) from exc
        try:
            self.sync(fd, durability, folder)
        finally:
            os.close(fd)

    def unlink(self, path: str) -> None:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass

    def open_read(self, path: str) -> int:
        try:
            return os.open(path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except OSError as exc:
            raise _wrap(exc, "open", path) from exc

    def preadv(self, fd: int, bufs: Sequence[memoryview], offset: int) -> int:
        return os.preadv(fd, bufs, offset)

    def read_all(self, fd: int, bufs: Sequence[memoryview], offset: int, path: str) -> None:
        pending = [b for b in bufs if b.nbytes]
        try:
            while pending:
                n = self.preadv(fd, pending[:IOV_MAX], offset)
                if n <= 0:
                    raise errors.TruncatedFile(f"file ended at {offset} during a tensor read", path=path)
                offset += n
                pending = _advance(pending, n)
        except OSError as exc:
            raise _wrap(exc, "read", path) from exc


def _advance(bufs: list[memoryview], n: int) -> list[memoryview]:
    """Drop ``n`` bytes from the front of a buffer list."""
    while n and bufs:
        if n >= bufs[0].nbytes:
            n -= bufs[0].nbytes
            bufs = bufs[1:]
        else:
            bufs = [bufs[0][n:], *bufs[1:]]
            n = 0
    return bufs


DEFAULT_OPS = FileOps()
