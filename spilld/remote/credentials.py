"""Secrets of the remote tier (the password, the encryption key file): read from files only their owner can read,
or the password from the environment; never from the command line, where ``ps`` shows it."""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping

from ..fileio import open_regular
from .errors import RemoteConfigError

PASSWORD_ENV = "SPILLD_REMOTE_PASSWORD"
MAX_SECRET_FILE_BYTES = 64 * 1024  # a password or key file is small; a larger one is the wrong file
_OPEN_TO_OTHERS = stat.S_IRWXG | stat.S_IRWXO


def read_private_file(path: str, what: str) -> bytes:
    """The bytes of a regular file that neither its group nor others may read, write or run (0600, 0400)."""
    with os.fdopen(_open_private(path, what), "rb") as f:
        data = f.read(MAX_SECRET_FILE_BYTES + 1)
    if len(data) > MAX_SECRET_FILE_BYTES:
        raise RemoteConfigError(f"{what} {path!r} is larger than {MAX_SECRET_FILE_BYTES} bytes")
    return data


def check_private_file(path: str, what: str) -> None:
    """Refuse (``RemoteConfigError``) a file that another library reads by its path (a TLS client key) unless
    ``read_private_file`` would take it: a regular file of our own, not a link, 0600 or stricter."""
    os.close(_open_private(path, what))


def _open_private(path: str, what: str) -> int:
    try:  # a regular file, not a link; a FIFO there is refused instead of waited on
        fd = open_regular(path, os.O_NOFOLLOW)
    except OSError as e:
        raise RemoteConfigError(f"{what} {path!r} cannot be opened: {e.strerror}") from e
    try:
        st = os.fstat(fd)
        if st.st_mode & _OPEN_TO_OTHERS:
            mode = stat.S_IMODE(st.st_mode)
            raise RemoteConfigError(f"{what} {path!r} is open to its group or others (mode {mode:04o}); chmod 600 it")
        if st.st_uid != os.geteuid():
            raise RemoteConfigError(f"{what} {path!r} belongs to another user (uid {st.st_uid})")
    except BaseException:
        os.close(fd)
        raise
    return fd


def password(path: str | None, environ: Mapping[str, str]) -> str | None:
    """The password: from ``path`` when given (its first line), else from $SPILLD_REMOTE_PASSWORD, else None."""
    if path is not None:
        try:
            text = read_private_file(path, "the remote password file").decode("utf-8", "strict")
        except UnicodeDecodeError as e:
            raise RemoteConfigError(f"the remote password file {path!r} is not UTF-8 text ({e.reason})") from e
        lines = text.splitlines()
        return lines[0] if lines else ""
    return environ.get(PASSWORD_ENV) or None
