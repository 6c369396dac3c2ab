"""What every command shares: exit codes, one-line refusals (``UsageError``, ``Parser``), the argument types
(one parser for every size and duration), paths, a progress line, and the blocking connection to the daemon."""

from __future__ import annotations

import argparse
import math
import os
import stat
import sys
import time
from collections.abc import Callable
from typing import Any, NoReturn

from .. import errors
from ..config import OneLineParser, arg_type, check_socket_path, format_size, parse_duration, parse_size

EXIT_OK = 0
EXIT_BAD_FILE = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 3
EXIT_UNREACHABLE = 4
EXIT_ALREADY_RUNNING = 5
EXIT_SERVICE = 6
EXIT_DAEMON_ERROR = 7
EXIT_NOT_INSTALLED = 8  # `service status`: not installed or not loaded (4 stays 'cannot reach the daemon')
EXIT_INTERNAL = 70  # sysexits' EX_SOFTWARE: a bug of ours
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: whoever read our output went away
EXIT_SIGNAL_BASE = 128  # + the signal: `demo` stopped by SIGHUP (129) or SIGTERM (143), once it has cleaned up

PROGRESS_EVERY_S = 0.1  # a terminal's progress line is redrawn at most this often


class UsageError(Exception):
    """A bad option or path found after parsing: one line, exit 2."""


def plural(n: int, word: str, words: str | None = None) -> str:
    """'1 entry', '2 entries', '0 clients'."""
    return f"{n} {word if n == 1 else (words or word + 's')}"


class Progress:
    """A progress line on a terminal (stderr), redrawn at most every PROGRESS_EVERY_S; silent otherwise."""

    def __init__(self, label: str, *, quiet: bool = False) -> None:
        self.label = label
        self.on = not quiet and sys.stderr.isatty()
        self._last = 0.0
        self._shown = False

    def show(self, items_left: int, bytes_left: int, *, force: bool = False) -> None:
        now = time.monotonic()
        if not self.on or (not force and now - self._last < PROGRESS_EVERY_S):
            return
        self._last, self._shown = now, True
        left = f"{plural(items_left, 'item')}, {format_size(bytes_left)} left"
        print(f"\r{self.label}: {left}   ", end="", file=sys.stderr, flush=True)

    def done(self) -> None:
        if self._shown:
            print(file=sys.stderr)
            self._shown = False


# --- argument types: one parser for every size and duration --------------------------------------


size_arg = arg_type(parse_size, "size")
size_or_zero_arg = arg_type(lambda t: parse_size(t, minimum=0), "size")
duration_arg = arg_type(parse_duration, "duration")
positive_duration_arg = arg_type(lambda t: parse_duration(t, positive=True), "duration")
# Redis takes a TTL in whole seconds: a duration rounded up, so "0.5" is 1 s rather than refused or 0
whole_seconds_arg = arg_type(lambda t: max(1, math.ceil(parse_duration(t, positive=True))), "duration")
socket_arg = arg_type(check_socket_path, "socket path")


def _nonempty_path(text: str) -> str:
    if not text.strip():  # an unset variable in a unit (--dir "$UNSET"): never the default in its place (review)
        raise ValueError("an empty path (an unset variable?)")
    return text


path_arg = arg_type(_nonempty_path, "path")


def _nonempty_text(text: str) -> str:
    if not text.strip():  # `--remote "$UNSET"` must not mean "no shared tier" in silence (found in review)
        raise ValueError("an empty value (an unset variable?)")
    return text


text_arg = arg_type(_nonempty_text, "value")


def _fingerprint(text: str) -> str:
    from ..store.folders import is_identity_folder

    if not is_identity_folder(text):  # a typo evicted nothing, exit 0 (found in review)
        raise ValueError(f"{text!r} is not an identity folder's name (16 hex digits, as `spilld ls --json` shows)")
    return text


fingerprint_arg = arg_type(_fingerprint, "fingerprint")


def _checked_text(text: str) -> str:
    parse_size(text)
    return text


size_text_arg = arg_type(_checked_text, "size")  # checked, kept as written (service files pass it on)


class Parser(OneLineParser):
    """argparse with one-line refusals (exit 2) instead of a usage block. ``raise_errors``: a refusal is a
    ``UsageError`` of its message instead (``service install`` checks the options it passes to ``serve`` with
    ``serve``'s parser, and says where they came from)."""

    raise_errors = False
    unrecognized_hint = ""  # said after "unrecognized arguments" (``main`` sets it for ``service``)

    def error(self, message: str) -> NoReturn:
        if self.raise_errors:
            raise UsageError(message)
        hint = self.unrecognized_hint if message.startswith("unrecognized arguments") else ""
        super().error(f"{message}{hint}")


# --- paths ---------------------------------------------------------------------------------------------


def folder_arg(path: str | None, default: Callable[[], str], *, must_exist: bool) -> str:
    """An absolute folder for ``--dir``; UsageError if it names a file or sits below one (or, with
    ``must_exist``, is missing). Nothing is created here."""
    full = os.path.abspath(os.path.expanduser(path or default()))
    probe = full
    while not os.path.lexists(probe):
        if must_exist:
            raise UsageError(f"no such folder: {full}")
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        where = "is not a folder" if probe == full else f"is below {probe}, which is not a folder"
        raise UsageError(f"--dir {full} {where}")
    return full


def regular_file(path: str) -> str:
    """``path`` if it is a file we can read as one (a folder or a FIFO would fail or hang): else UsageError."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise UsageError(f"{path}: {exc.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{path} is a folder (`spilld verify --dir {path}` checks a whole store)")
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{path} is not a regular file")
    return path


def socket_path(args: argparse.Namespace) -> str:
    """``--socket``, else the default (``$SPILLD_SOCKET`` included), checked like the option."""
    from ..config import default_socket

    try:
        return check_socket_path(args.socket or default_socket())
    except ValueError as exc:
        raise UsageError(f"{exc} (from SPILLD_SOCKET or the default)") from None


# --- talking to the daemon ------------------------------------------------------------------------------


def control(args: argparse.Namespace, timeout: float | None = None) -> Any:
    """A connection to the daemon; ``timeout`` bounds the connect and the hello (else ``CONNECT_TIMEOUT_S``)."""
    from ..control import CONNECT_TIMEOUT_S, Control

    return Control(
        socket_path(args), name=f"spilld {args.command}", timeout=CONNECT_TIMEOUT_S if timeout is None else timeout
    )


def daemon_dir(args: argparse.Namespace) -> str | None:
    """The folder of the daemon answering on the socket, or None when none answers."""
    try:
        with control(args) as c:
            return str(c.server.get("dir") or "") or None
    except errors.ConnectionLost:
        return None


def refuse_not_a_store(root: str, then: str) -> None:
    """``UsageError`` for a folder no daemon made (no lock, no entries): nothing there is spilld's (found in review:
    ``evict --dir`` of one made a lock file there and removed the user's empty folders; ``verify --dir`` passed)."""
    from ..lockfile import LOCK_NAME
    from ..store import looks_like_store

    if not looks_like_store(root):
        raise UsageError(f"{root} is not a spilld store (no {LOCK_NAME}, no entries): {then}")


def same_folder(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def refuse_another_folder(args: argparse.Namespace, folder: str, served: str | None) -> None:
    """``UsageError`` when the daemon on the socket serves another folder than ``folder`` (a ``--dir`` given to a
    command that would go through that daemon is never ignored)."""
    if served is not None and not same_folder(folder, served):
        raise UsageError(
            f"the daemon on {socket_path(args)} serves {served}, not {folder}: stop it, or name its socket with --socket"
        )


def ask(
    args: argparse.Namespace, method: str, params: dict[str, Any] | None = None, lost_is_error: bool = True, **kw: Any
) -> Any:
    """Send one request and return its answer. A ``timeout`` given bounds the whole exchange, the connect and the
    hello included (found in review: ``drain --timeout 1`` waited 10 s for a hung daemon's hello). Without
    ``lost_is_error``, a connection lost once the daemon answered the hello gives None (a daemon that could not be
    reached still raises ``ConnectionLost``)."""
    from ..control import CONNECT_TIMEOUT_S

    timeout = kw.get("timeout")
    end = None if timeout is None else time.monotonic() + timeout
    with control(args, None if timeout is None else min(timeout, CONNECT_TIMEOUT_S)) as c:
        if end is not None:
            kw["timeout"] = max(0.0, end - time.monotonic())
        try:
            return c.call(method, params or {}, **kw)
        except errors.ConnectionLost:
            if lost_is_error:
                raise
            return None
