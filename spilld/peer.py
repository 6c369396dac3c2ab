"""Who is at the other end of a Unix socket: both ends check, the daemon its clients and a client its daemon."""

from __future__ import annotations

import os
import socket
import struct
import sys

from . import errors


def peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of a Unix socket (None where the OS cannot tell)."""
    if hasattr(socket, "SO_PEERCRED"):
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return int(struct.unpack("3i", raw)[1])
    if sys.platform == "darwin":  # LOCAL_PEERCRED: struct xucred {u_int version; uid_t uid; ...}
        raw = sock.getsockopt(0, 0x001, 76)
        return int(struct.unpack_from("Ii", raw)[1])
    return None


def peer_pid(sock: socket.socket) -> int | None:
    """The pid of the process at the other end of a Unix socket (None where the OS cannot tell: another pid
    namespace, or an OS without the option)."""
    try:
        if hasattr(socket, "SO_PEERCRED"):
            raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
            return int(struct.unpack("3i", raw)[0]) or None
        if sys.platform == "darwin":  # LOCAL_PEERPID (level SOL_LOCAL, 0): a pid_t
            return int(struct.unpack("i", sock.getsockopt(0, 0x002, 4))[0]) or None
    except OSError:
        return None
    return None


def refuse_foreign(sock: socket.socket, path: str) -> None:
    """A client's check before it sends a byte: a daemon of another user is refused (``ForeignDaemon``)."""
    uid = peer_uid(sock)
    if uid is not None and uid != os.getuid():  # never talk to a socket another user put there
        raise errors.ForeignDaemon(f"{path} is served by uid {uid}, not by us (uid {os.getuid()}): nothing was sent")
