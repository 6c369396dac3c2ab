"""The daemon's socket: who is at the other end, whether a daemon answers on a path, and binding it."""

from __future__ import annotations

import asyncio
import os
import socket
import struct
import sys
from typing import Any

from .. import errors

AlreadyRunning = errors.AlreadyRunning  # one class for the socket and the lock file: one code, one except clause


class PeerRefused(errors.SpillError):
    code = "peer_refused"


errors.ERRORS_BY_CODE[PeerRefused.code] = PeerRefused


def peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of a Unix socket (None where the OS cannot tell)."""
    if hasattr(socket, "SO_PEERCRED"):
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return int(struct.unpack("3i", raw)[1])
    if sys.platform == "darwin":  # LOCAL_PEERCRED: struct xucred {u_int version; uid_t uid; ...}
        raw = sock.getsockopt(0, 0x001, 76)
        return int(struct.unpack_from("Ii", raw)[1])
    return None


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


async def bind(path: str, handler: Any) -> asyncio.AbstractServer:
    """Bind the socket: 0700 folder, 0600 socket; refuse a live daemon, replace a stale socket."""
    folder = os.path.dirname(path)
    os.makedirs(folder, mode=0o700, exist_ok=True)
    os.chmod(folder, 0o700)
    if os.path.exists(path):
        if is_served(path):
            raise AlreadyRunning(f"a daemon already listens on {path}")
        os.unlink(path)  # nobody listens: a stale socket from a crash
    old = os.umask(0o177)
    try:
        server = await asyncio.get_running_loop().create_unix_server(handler, path=path)
    finally:
        os.umask(old)
    os.chmod(path, 0o600)
    return server
