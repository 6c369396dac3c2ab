"""A client that speaks the wire protocol frame by frame (no spilld client code), for tests of the daemon's rules."""

from __future__ import annotations

import socket
from typing import Any

from spilld import protocol as P


def frames(*parts: list[bytes | memoryview]) -> bytes:
    return b"".join(bytes(b) for part in parts for b in part)


class Wire:
    """One raw connection: send frames, read messages; ``notes`` keeps every notification seen."""

    def __init__(self, path: str, timeout: float = 30.0) -> None:
        self.sock = socket.socket(socket.AF_UNIX)
        self.sock.settimeout(timeout)
        self.sock.connect(path)
        self.dec = P.FrameDecoder()
        self.inbox: list[P.Message] = []
        self.notes: list[P.Message] = []
        self._ids = 100

    def send(self, *parts: list[bytes | memoryview]) -> None:
        self.sock.sendall(frames(*parts))

    def _read(self) -> bool:
        try:
            data = self.sock.recv(1 << 20)
        except (ConnectionResetError, TimeoutError):
            return False
        if not data:
            return False
        for m in self.dec.feed(data):
            (self.notes if m.kind == P.NOTIFICATION else self.inbox).append(m)
        return True

    def response(self, msgid: int) -> P.Message:
        """The response to request ``msgid`` (AssertionError if the connection ends first)."""
        while True:
            for m in self.inbox:
                if m.msgid == msgid:
                    self.inbox.remove(m)
                    return m
            assert self._read(), f"connection closed before the response to {msgid}; notes: {self.notes}"

    def answer(self, msgid: int) -> tuple[Any, dict[str, Any] | None]:
        """(result, error) of request ``msgid``; when the daemon closes instead, (None, its error notification)."""
        while True:
            for m in self.inbox:
                if m.msgid == msgid:
                    self.inbox.remove(m)
                    return m.result, m.error
            errs = [n for n in self.notes if n.method == "error"]
            if errs:
                return None, dict(errs[-1].params)
            assert self._read(), f"connection closed with no answer to {msgid}"

    def call(self, method: str, params: dict[str, Any], payload: bytes = b"") -> P.Message:
        self._ids += 1
        self.send(P.request(self._ids, method, params, payload))
        return self.response(self._ids)

    def hello(self, **extra: Any) -> dict[str, Any]:
        r = self.call("hello", {"version": P.PROTOCOL_VERSION, "client": "wire"} | extra)
        assert r.error is None, r.error
        return dict(r.result)

    def note(self, method: str) -> P.Message:
        """The first notification ``method`` not yet taken (waits for it)."""
        while True:
            for m in self.notes:
                if m.method == method:
                    self.notes.remove(m)
                    return m
            assert self._read(), f"connection closed before a {method} notification"

    def until_closed(self) -> list[P.Message]:
        """Read until the daemon closes; every message received."""
        while self._read():
            pass
        return self.inbox + self.notes

    def close(self) -> None:
        self.sock.close()
