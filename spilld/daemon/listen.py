"""The daemon's socket: who is at the other end, whether a daemon answers on a path, and binding it."""

from __future__ import annotations

import asyncio
import inspect
import os
import socket
import stat
from typing import Any

from .. import errors
from ..control import Control
from ..lockfile import SOCKET_LOCK_SUFFIX, FileLock
from ..peer import peer_uid

AlreadyRunning = errors.AlreadyRunning  # kept here too: callers import it from spilld.daemon
PeerRefused = errors.PeerRefused  # defined in errors.py, where every code is mapped
__all__ = [
    "AlreadyRunning", "PeerRefused", "bind", "is_served", "peer_uid", "serve_inherited", "socket_folder", "socket_lock"
]  # fmt: skip

OPEN_TO_OTHERS = stat.S_IWGRP | stat.S_IWOTH  # a folder others can write: they could take the socket's name
HELLO_TIMEOUT_S = 1.0  # a start refused for a socket in use asks what listens there, this long at most


def is_served(path: str, timeout: float = 1.0) -> bool:
    """Whether something accepts connections on the Unix socket ``path`` (a live daemon, not a stale file)."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.settimeout(timeout)
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


def _who_listens(path: str, timeout: float = HELLO_TIMEOUT_S) -> str:
    """What listens on ``path``, as far as a hello finds out: a spilld is named by its pid (one a service manager
    started on a socket it made holds no lock file to name it), anything else is "something" (found in review: a
    refusal said "a daemon already listens" of any program listening there, never asked)."""
    try:
        with Control(path, "spilld (a second start)", timeout) as daemon:
            pid = daemon.server.get("pid")
    except errors.NotADaemon:
        return f"something listens on {path} that is not spilld (its answer to a spilld hello broke the protocol)"
    except errors.Timeout:
        return f"something listens on {path} and did not answer a spilld hello within {timeout:g} s"
    except errors.ForeignDaemon as exc:
        return f"something listens on {path}: {exc}"
    except errors.ConnectionLost:
        return f"something listens on {path} and closed the connection without answering a spilld hello"
    except errors.SpillError as exc:  # an error in spilld's protocol: a spilld that refused the hello
        return f"a spilld daemon already listens on {path} (it refused a hello: {exc})"
    return f"a spilld daemon already listens on {path}" + (f" (pid {pid})" if type(pid) is int else "")


def socket_folder(path: str) -> list[str]:
    """Make ready the folder that will hold the socket; return the folders made (0700: only those).

    A folder that exists is left as it is: its mode is its owner's business. It must be ours (or root's)
    and closed to other users' writes, sticky or not: in a folder such as /tmp (1777) another user could create
    the socket's name (or its lock's) there first, whoever owns the folder. Raises ``UnusableFolder``.
    """
    folder = os.path.dirname(os.path.abspath(path))
    made: list[str] = []
    d = folder
    while not os.path.isdir(d) and d != os.path.dirname(d):
        made.append(d)
        d = os.path.dirname(d)
    for m in reversed(made):
        try:
            os.mkdir(m, 0o700)
        except FileExistsError:
            if not os.path.isdir(m):
                raise errors.UnusableFolder(f"cannot hold the socket: {m} is not a folder") from None
        except OSError as exc:
            raise errors.UnusableFolder(f"cannot create the socket's folder {m}: {exc.strerror}") from None
    check_socket_folder(folder)
    return made


def check_socket_folder(folder: str) -> None:
    """Refuse a socket folder that is not ours or that other users can write (see ``socket_folder``)."""
    st = os.stat(folder)
    me = os.getuid()
    if st.st_uid not in (me, 0):
        raise errors.UnusableFolder(f"the socket's folder {folder} belongs to uid {st.st_uid}, not to us (uid {me})")
    if st.st_mode & OPEN_TO_OTHERS:  # sticky too: it keeps our names from removal, not from being taken first
        raise errors.UnusableFolder(
            f"the socket's folder {folder} is writable by other users (mode {stat.S_IMODE(st.st_mode):04o}): "
            "another user could put a socket of theirs at its name; use a folder only you can write "
            "(the default, $XDG_RUNTIME_DIR/spilld/spilld.sock, is one)"
        )


def socket_lock(path: str) -> FileLock:
    """The lock beside the socket: taken before the stale-socket probe, so two daemons starting at once
    cannot both find the name free (or both unlink each other's socket)."""
    return FileLock(path + SOCKET_LOCK_SUFFIX, f"the socket {path}")


async def serve_inherited(listener: socket.socket, handler: Any) -> asyncio.AbstractServer:
    """Serve on a socket a service manager made and handed over (socket activation). Its path is the manager's, never
    removed here: nor by the event loop, which since Python 3.13 (and in uvloop) unlinks a Unix server's path when
    it closes unless told not to (``cleanup_socket``); the manager's next start would find no socket."""
    loop = asyncio.get_running_loop()
    keep: dict[str, Any] = {"cleanup_socket": False} if _accepts(loop.create_unix_server, "cleanup_socket") else {}
    return await loop.create_unix_server(handler, sock=listener, **keep)


def _accepts(fn: Any, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read: an older loop, without the parameter
        return False


def claim(path: str, lock: FileLock | None = None) -> None:
    """Make the socket's path ours to bind: its folder ready (made 0700 only if missing; see ``socket_folder``),
    ``lock`` taken if given and not yet held, a path in use or not a socket refused, a stale socket removed. A
    daemon claims its socket before it touches its store's folder, and a refusal here gives back the lock it took
    (its file removed if this made it: ``FileLock.discard``), so such a refusal leaves nothing behind."""
    socket_folder(path)
    taken = lock if lock is not None and not lock.held else None  # the lock this call takes, given back on a refusal
    if taken is not None:
        taken.acquire()  # AlreadyRunning: another spilld starts or serves on this path
    try:
        if os.path.lexists(path):
            if not stat.S_ISSOCK(os.lstat(path).st_mode):
                raise errors.UnusableFolder(f"{path} exists and is not a socket: refusing to replace it")
            if is_served(path):
                raise errors.AlreadyRunning(_who_listens(path))
            os.unlink(path)  # nobody listens: a stale socket from a crash (ours to remove: we hold the lock)
    except BaseException:
        if taken is not None:
            taken.discard()
        raise


async def bind(path: str, handler: Any, lock: FileLock | None = None) -> asyncio.AbstractServer:
    """``claim`` the path (again: nothing to do if done), then bind the socket (0600)."""
    claim(path, lock)
    old = os.umask(0o177)
    try:
        server = await asyncio.get_running_loop().create_unix_server(handler, path=path)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    return server
