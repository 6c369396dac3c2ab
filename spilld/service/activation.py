"""Socket activation: take the listening socket a service manager made for us instead of binding one.

systemd hands sockets over as fds 3, 4, ... and describes them in ``LISTEN_PID``, ``LISTEN_FDS`` and
``LISTEN_FDNAMES``; launchd hands them over on request through ``launch_activate_socket`` in libSystem.
Either way the socket must be a listening ``AF_UNIX`` stream socket, or the daemon refuses to start.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import logging
import os
import socket
import sys
from collections.abc import MutableMapping
from typing import Any

from .. import errors
from .units import LAUNCHD_SOCKET_KEY, SOCKET_NAME

log = logging.getLogger("spilld.service")

SD_LISTEN_FDS_START = 3
LISTEN_VARS = ("LISTEN_PID", "LISTEN_FDS", "LISTEN_FDNAMES")
# Among several systemd fds, ours is named after our socket unit (FileDescriptorName='s default) or, in a
# hand-written unit, FileDescriptorName=spilld (the name launchd's plist uses too).
OUR_NAMES = (SOCKET_NAME, LAUNCHD_SOCKET_KEY)


ActivationError = errors.ActivationError  # defined in errors.py, where every code is mapped
MAX_LISTEN_FDS = 64  # fds a service manager may hand us (spilld takes one socket); more is a broken environment


def systemd_fds(env: MutableMapping[str, str] | None = None, pid: int | None = None) -> list[tuple[int, str]]:
    """The fds systemd passed to this process, with their names; the variables are removed from ``env``
    so that a child never takes them for its own."""
    env = os.environ if env is None else env
    values = {k: env.pop(k, None) for k in LISTEN_VARS}
    if values["LISTEN_PID"] is None or values["LISTEN_FDS"] is None:
        return []
    try:
        owner, count = int(values["LISTEN_PID"]), int(values["LISTEN_FDS"])
    except ValueError as exc:
        raise ActivationError(f"bad LISTEN_PID/LISTEN_FDS: {exc}") from exc
    if owner != (os.getpid() if pid is None else pid) or count <= 0:
        return []  # meant for another process (we were exec'd by the one they were set for)
    if count > MAX_LISTEN_FDS:
        raise ActivationError(f"LISTEN_FDS={count} passes more than {MAX_LISTEN_FDS} fds: not one of ours to take")
    names = (values["LISTEN_FDNAMES"] or "").split(":")
    fds = list(range(SD_LISTEN_FDS_START, SD_LISTEN_FDS_START + count))
    for fd in fds:
        try:
            fcntl.fcntl(fd, fcntl.F_SETFD, fcntl.fcntl(fd, fcntl.F_GETFD) | fcntl.FD_CLOEXEC)  # as sd_listen_fds does
        except OSError as exc:  # EBADF: the variables name an fd this process does not have
            raise ActivationError(f"LISTEN_FDS={count} names fd {fd}, which is not open: {exc}") from exc
    return [(fd, names[i] if i < len(names) else "unknown") for i, fd in enumerate(fds)]


def _libsystem() -> Any:
    return ctypes.CDLL(ctypes.util.find_library("System") or "/usr/lib/libSystem.B.dylib", use_errno=True)


def launchd_fds(name: str = LAUNCHD_SOCKET_KEY, lib: Any = None) -> list[int]:
    """The fds of the plist's ``Sockets`` entry ``name``, or [] when launchd did not start us with one."""
    if lib is None:
        if sys.platform != "darwin":
            return []
        lib = _libsystem()
    fn = lib.launch_activate_socket
    fn.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.POINTER(ctypes.c_int)), ctypes.POINTER(ctypes.c_size_t)]
    fn.restype = ctypes.c_int
    fds, count = ctypes.pointer(ctypes.POINTER(ctypes.c_int)()), ctypes.pointer(ctypes.c_size_t(0))
    err = fn(name.encode(), fds, count)
    if err in (errno.ENOENT, errno.ESRCH):
        return []  # no such socket in the plist, or not started by launchd at all
    if err != 0:
        raise ActivationError(f"launch_activate_socket({name!r}): {os.strerror(err)}")
    try:
        return [int(fds[0][i]) for i in range(count[0])]
    finally:
        lib.free.argtypes = [ctypes.c_void_p]
        lib.free(ctypes.cast(fds[0], ctypes.c_void_p))  # the array is ours to free; the fds stay open


def listener_from_fd(fd: int) -> socket.socket:
    """Wrap an inherited fd, checking that it is a listening AF_UNIX stream socket."""
    try:
        sock = socket.socket(fileno=fd)  # family and type are read from the fd itself
    except OSError as exc:
        raise ActivationError(f"inherited fd {fd} is not a socket: {exc}") from exc
    listening = sock.getsockopt(socket.SOL_SOCKET, getattr(socket, "SO_ACCEPTCONN", 0x0002))
    if sock.family != socket.AF_UNIX or sock.type != socket.SOCK_STREAM or not listening:
        what = f"family {sock.family!r}, type {sock.type!r}, listening {bool(listening)}"
        sock.detach()  # the manager owns it; leave the fd as it was
        raise ActivationError(f"inherited fd {fd} is not a listening Unix stream socket ({what})")
    return sock


def _pick(named: list[tuple[int, str]]) -> int:
    if len(named) == 1:
        return named[0][0]
    ours = [fd for fd, name in named if name in OUR_NAMES]
    if len(ours) != 1:
        raise ActivationError(
            f"{len(named)} sockets passed, and not exactly one is named {' or '.join(OUR_NAMES)}: {named}"
        )
    return ours[0]


def inherited_listener() -> socket.socket | None:
    """The listening socket systemd or launchd made for us, or None when we should bind our own."""
    named = systemd_fds()
    if named:
        sock = listener_from_fd(_pick(named))
        log.info("using the socket passed by systemd (fd %d)", sock.fileno())
        return sock
    fds = launchd_fds()
    if fds:
        sock = listener_from_fd(fds[0])
        for extra in fds[1:]:
            os.close(extra)  # a Unix path gives one socket; anything more is not ours to keep
        log.info("using the socket passed by launchd (fd %d)", sock.fileno())
        return sock
    return None


def socket_path(sock: socket.socket) -> str | None:
    """The filesystem path an inherited socket is bound to (None for an abstract or unnamed one)."""
    name = sock.getsockname()
    if isinstance(name, bytes):
        name = name.decode(errors="replace")
    return name if isinstance(name, str) and name and not name.startswith("\0") else None
