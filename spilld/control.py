"""The command line's connection to the daemon: a blocking socket, one request at a time.

``status``, ``drain`` and ``evict`` send one request and print its answer: they need none of the engine client's
machinery (a loop thread, a shared-memory pool, a local spill queue). The wire is the same protocol.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from typing import Any

from . import errors
from . import protocol as P
from .peer import refuse_foreign

CONNECT_TIMEOUT_S = 10.0
RECV_BYTES = 1 << 16


class Control:
    """A connection to the daemon for one command. Every failure to reach it is ``ConnectionLost``."""

    def __init__(self, path: str, name: str, timeout: float = CONNECT_TIMEOUT_S) -> None:
        self.path = path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout)
        self.decoder = P.FrameDecoder()
        self.inbox: list[P.Message] = []
        self._ids = 0
        try:
            self.sock.connect(path)
        except OSError as exc:
            self.sock.close()
            raise P.ConnectionLost(f"cannot reach spilld at {path}: {exc.strerror or exc}") from None
        try:
            refuse_foreign(self.sock, path)
            self.server: dict[str, Any] = self._hello(name, timeout)
        except BaseException:  # a foreign daemon, or a hello refused or unanswered: the socket goes with it
            self.sock.close()
            raise

    def _hello(self, name: str, timeout: float) -> dict[str, Any]:
        """The daemon's answer to the hello. One that breaks the protocol is ``NotADaemon`` (found in review: an
        HTTP server's reply, read as a frame's length, was "message of 1347703880 bytes [frame_too_large]", exit 7)."""
        try:
            server = self.call(
                "hello", {"version": P.PROTOCOL_VERSION, "client": name, "pid": os.getpid()}, timeout=timeout
            )
        except errors.ProtocolError as exc:
            raise P.not_a_daemon(self.path, exc) from None
        except errors.Timeout:
            raise errors.Timeout(
                f"no answer from spilld at {self.path} within {timeout:g} s (hung, or stopped?)"
            ) from None
        return P.hello_answer(server, self.path)

    def __enter__(self) -> Control:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.sock.close()

    def call(
        self,
        method: str,
        params: dict[str, Any],
        *,
        timeout: float | None = CONNECT_TIMEOUT_S,
        on_note: Callable[[P.Message], None] | None = None,
        silence: float | None = None,
    ) -> Any:
        """Send one request and wait for its answer (``timeout`` None: as long as it takes); notifications that
        arrive meanwhile go to ``on_note``. ``silence``: the longest the daemon may say nothing (no answer, no
        notification) before the call gives up (``Timeout``): a long request that reports progress."""
        self._ids += 1
        msgid = self._ids
        try:
            self.sock.sendall(b"".join(bytes(b) for b in P.request(msgid, method, params)))
        except OSError as exc:
            raise P.ConnectionLost(f"the daemon went away: {exc.strerror or exc}") from None
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:  # the nearer of the call's deadline and the end of the silence allowed from now
            quiet = None if silence is None else time.monotonic() + silence
            msg = self._next(min((t for t in (deadline, quiet) if t is not None), default=None), method)
            if msg.kind == P.RESPONSE and msg.msgid == msgid:
                P.raise_for(msg.error)
                return msg.result
            if msg.kind == P.NOTIFICATION and msg.method == "error":
                P.raise_for({"code": str(msg.params.get("code", "error")), "message": str(msg.params.get("message"))})
            if on_note is not None and msg.kind == P.NOTIFICATION:
                on_note(msg)

    def _next(self, deadline: float | None, method: str) -> P.Message:
        while not self.inbox:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise P.Timeout(f"{method}: no answer from the daemon")
            self.sock.settimeout(left)
            try:
                data = self.sock.recv(RECV_BYTES)
            except TimeoutError:
                continue
            except OSError as exc:
                raise P.ConnectionLost(f"the daemon went away: {exc.strerror or exc}") from None
            if not data:
                raise P.ConnectionLost("the daemon closed the connection")
            self.inbox.extend(self.decoder.feed(data))
        return self.inbox.pop(0)
