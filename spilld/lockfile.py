"""One owner per folder and per socket: an exclusive ``flock`` on a small file, held for the owner's life.

The lock file holds the owner's pid, so a second process can say who is in the way. The file stays after its
owner is gone (the next owner takes it), but a start that made it and is then refused removes it (``discard``),
while it still holds it: whoever opened it meanwhile finds, once it holds the lock, that the name no longer leads to
the file it locked, and takes the lock again on the file the name holds now, so two owners never hold two files
under one name.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import time
import weakref
from collections.abc import Iterator

from . import errors
from .fileio import io_errors

LOCK_NAME = ".spilld.lock"  # in the store's folder (the scan skips names that start with a dot)
SOCKET_LOCK_SUFFIX = ".lock"  # beside the socket: <socket>.lock
PID_BYTES = 32  # the most of a lock file read back for the holder's pid
UPDATE_LOCK_NAME = ".spilld-update.lock"  # in the root, always empty: held around a rewrite of a shared root file
UPDATE_WAIT_S = 5.0  # the longest such a rewrite waits for another process's (each takes milliseconds)
UPDATE_POLL_S = 0.005
TAKE_TRIES = 8  # a taking tried again because the file it locked was removed as it took it (each try: microseconds)


def holder_pid(path: str) -> int | None:
    """The pid a lock file names (None if it names none yet, or cannot be read)."""
    try:
        with open(path, "rb") as f:
            return int(f.read(PID_BYTES).strip() or b"x")
    except (OSError, ValueError):
        return None


class FileLock:
    """An exclusive, non-blocking lock on ``path``; ``what`` names what it guards in messages."""

    def __init__(self, path: str, what: str) -> None:
        self.path = path
        self.what = what
        self.fd: int | None = None
        self.shared = False  # held shared (with other embedded writers), not exclusively
        self.made = False  # the file was created by this hold: ``discard`` may remove it
        self._finalizer: weakref.finalize[[int], FileLock] | None = None  # lets go of a lock whose holder was dropped

    @property
    def held(self) -> bool:
        """Held exclusively: this process is the one owner."""
        return self.fd is not None and not self.shared

    def acquire(self) -> None:
        """Take the lock or raise ``AlreadyRunning`` naming the holder's pid (``StorageError`` if no file can be made)."""
        if not self.try_acquire():
            pid = holder_pid(self.path)
            who = f"pid {pid}" if pid is not None else "a process that has not written its pid yet"
            raise errors.AlreadyRunning(f"{self.what} is in use by another spilld ({who}; lock {self.path})")

    def try_acquire(self, shared: bool = False) -> bool:
        """Take the lock if nobody holds it (``shared``: if nobody holds it exclusively); False if somebody does."""
        if self.fd is not None:
            return self.shared == shared or not self.shared
        for _ in range(TAKE_TRIES):
            fd, made = _open_lock(self.path)
            try:
                _check_ours(fd, self.path)
                fcntl.flock(fd, (fcntl.LOCK_SH if shared else fcntl.LOCK_EX) | fcntl.LOCK_NB)
                if _named(fd, self.path):
                    break
            except BlockingIOError:
                os.close(fd)
                return False
            except (OSError, errors.UnusableFolder):
                os.close(fd)
                raise
            os.close(fd)  # a refused start removed the file as we locked it: take the one the name holds now
        else:
            return False  # removed under us every time: starts that come and go, read as somebody holding it
        self.fd, self.shared, self.made = fd, shared, made  # ours from here, released by ``release`` (or when dropped)
        self._finalizer = weakref.finalize(self, _close_quietly, fd)
        _HELD.add(self)
        if shared:
            return True
        # the pid only names the owner to others: on a full disk they read "has not written its pid yet"
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return True

    def share(self) -> bool:
        """Turn an exclusive hold into a shared one (other embedded writers may then share the folder); False if
        it was lost in the turn (flock converts by dropping, then taking: another process may come between)."""
        if self.fd is None or self.shared:
            return self.fd is not None
        try:
            fcntl.flock(self.fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError:
            self.release()
            return False
        self.shared = True
        return True

    def discard(self) -> None:
        """``release``, and remove the lock file if this hold created it: a refused start leaves nothing behind.
        Removed while still held (see the module's docstring), and only if the name still leads to our file."""
        if self.held and self.made and self.fd is not None and _named(self.fd, self.path):
            with contextlib.suppress(OSError):
                os.unlink(self.path)
        self.release()

    def release(self) -> None:
        self.shared = self.made = False
        _HELD.discard(self)
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if self.fd is not None:
            fd, self.fd = self.fd, None
            with contextlib.suppress(OSError):
                os.close(fd)  # closing the last descriptor drops the flock


@contextlib.contextmanager
def updating(root: str, wait_s: float = UPDATE_WAIT_S) -> Iterator[None]:
    """One writer at a time, across processes, for a read-merge-replace of a file of ``root`` that several stores
    share (the pins and the wear file): two stores of one folder otherwise both read the old file, and the second's
    rename drops the first's change. ``StorageTimeout`` past ``wait_s``, ``StorageError`` if the lock's name holds
    anything but an empty regular file (someone else's: left as it is). Blocking: a worker thread."""
    path = os.path.join(root, UPDATE_LOCK_NAME)
    flags = os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0)
    with io_errors("lock file", path):
        fd = os.open(path, flags, 0o600)
    _UPDATING.add(fd)  # a child forked meanwhile closes its copy (``_let_go_in_child``)
    try:
        with io_errors("lock file", path):
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_size:
                raise OSError(errno.EINVAL, "not a spilld lock file (an empty regular file)")
        _lock_within(fd, path, wait_s)
        yield
    finally:
        if fd in _UPDATING:  # (else this is a forked child, which closed its copy at once)
            _UPDATING.discard(fd)
            os.close(fd)  # the flock goes with it


def _lock_within(fd: int, path: str, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise errors.StorageTimeout(f"{path} held by another process for {wait_s:g} s", path=path) from None
            time.sleep(UPDATE_POLL_S)


def _open_lock(path: str) -> tuple[int, bool]:
    """Open the lock file, creating it if missing: its descriptor, and whether this call created it."""
    flags = os.O_RDWR | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
    with io_errors("lock file", path):
        for _ in range(TAKE_TRIES):  # a name removed between the two opens is created on the next turn
            try:
                return os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o600), True
            except FileExistsError:
                pass
            with contextlib.suppress(FileNotFoundError):
                return os.open(path, flags), False
        return os.open(path, flags | os.O_CREAT, 0o600), False  # not known to be ours: never removed


def _named(fd: int, path: str) -> bool:
    """Whether ``path`` still leads to the file open on ``fd`` (not removed, nor replaced, since it was opened)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)


def _check_ours(fd: int, path: str) -> None:
    """Refuse a file at the lock's name that no spilld wrote (not a regular file, or neither empty nor a pid):
    taking it would overwrite it with our pid (found in review: a user's own file at ``<socket>.lock`` was)."""
    st = os.fstat(fd)
    head = os.pread(fd, PID_BYTES + 1, 0) if stat.S_ISREG(st.st_mode) else b"x"
    if head and (len(head) > PID_BYTES or not head.rstrip(b"\n").isdigit()):
        raise errors.UnusableFolder(f"{path} exists and is not a spilld lock file: refusing to use it")


def _close_quietly(fd: int) -> None:
    with contextlib.suppress(OSError):
        os.close(fd)  # closing the last descriptor drops the flock


_HELD: weakref.WeakSet[FileLock] = weakref.WeakSet()  # the locks this process holds
_UPDATING: set[int] = set()  # the descriptors of the update locks open now (``updating``, on any thread)


def _let_go_in_child() -> None:
    """A forked child (a worker pool's process) holds none of its parent's locks: its copies of their descriptors
    are closed (the parent's hold stays: a flock goes with the last descriptor), so that a child outliving its
    parent never keeps the folder or the socket from their next owner (found in review: a daemon's start there
    was refused while such a child lived; and a child forked during a pins or wear rewrite held the update lock,
    so every later rewrite of the folder's stores failed with io_timeout while it lived)."""
    for lock in list(_HELD):
        lock.release()
    for fd in list(_UPDATING):
        _close_quietly(fd)
    _UPDATING.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_let_go_in_child)
