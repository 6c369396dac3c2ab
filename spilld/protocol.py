"""The wire protocol: frames and messages, sans I/O.

A frame is ``u32 msg_len | u32 payload_len | msg | payload`` (little-endian):
``msg`` is a msgpack array in msgpack-RPC shape, ``payload`` raw bytes (tensor
data travels there, never through msgpack). ``FrameDecoder`` is fed bytes and
yields frames; it never does I/O, so it is tested (and fuzzed) without sockets.

    request       [0, msgid, method, params]
    response      [1, msgid, error, result]      error: nil or {"code", "message"}
    notification  [2, method, params]
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack
import numpy as np

from . import errors
from .unpack import COUNT_FROM_BYTES, unpack

PROTOCOL_VERSION = 1
FRAME_HEAD = struct.Struct("<II")

# Limits. Each has its own error and a test that hits it.
MAX_MSG_BYTES = 4 * 1024 * 1024  # a spill's header (tokens included) must fit here
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024  # one frame's raw bytes; bigger tensors come in several frames
UNZEROED_MIN_BYTES = 64 * 1024  # frame parts this large are allocated without zero-filling
DISCARD_CHUNK = 64 * 1024  # a payload the receiver refuses is read through a scratch buffer of this size
MAX_PENDING_FRAMES = 1024  # decoded but not yet consumed: a client that floods is cut off
MAX_NESTING = 32  # msgpack container depth
DEPTH_SCAN_ITEMS = 16 * 1024  # the nesting check looks at a container's items this many per C call
# A msgpack part this large is not decoded by the decoder that lends its buffer (``defer``): the daemon decodes it on a
# worker thread (found in review: 4 MiB of small arrays decoded on the event loop held every client 0.5 s)
OFF_LOOP_MSG_BYTES = COUNT_FROM_BYTES
MAX_METHOD_LEN = 64
MAX_INFLIGHT_REQUESTS = 64  # requests of one connection being served at once
MAX_ERROR_MESSAGE = 1024  # error text sent back (it may echo what a client sent)
DRAIN_DEFAULT_S = 3600.0  # a drain's timeout when its request names none

REQUEST, RESPONSE, NOTIFICATION = 0, 1, 2


# The error classes live in errors.py (one table maps every code); these names are the protocol's own view of them.
ProtocolError = errors.ProtocolError
FrameTooLarge = errors.FrameTooLarge
Busy = errors.Busy
UnknownMethod = errors.UnknownMethod
BadParams = errors.BadParams
UnsupportedProtocol = errors.UnsupportedProtocol
ConnectionLost = errors.ConnectionLost
Timeout = errors.Timeout
DuplicateHello = errors.DuplicateHello


@dataclass
class Message:
    kind: int
    method: str = ""
    msgid: int = 0
    params: Any = None
    error: dict[str, str] | None = None
    result: Any = None
    payload: memoryview | bytes | bytearray = b""
    discarded: int = 0  # payload bytes the receiver refused to hold (read and thrown away)
    size: int = 0  # bytes of its msgpack part


_CONTAINERS = frozenset({list, tuple, dict})


def _depth_ok(obj: Any, depth: int = 0) -> bool:
    """``obj`` nests at most ``MAX_NESTING`` deep. Only containers are walked into, picked from a container's items
    by C calls alone (found in review: a walk of every item in Python held the loop 0.75 s for a 4 MiB
    message of 4 M small ints), ``DEPTH_SCAN_ITEMS`` at a time (one C call over 4 M items held the interpreter's
    lock 0.1 s, every other thread stopped)."""
    if depth > MAX_NESTING:
        return False
    if type(obj) not in _CONTAINERS:
        return True
    if depth == MAX_NESTING:  # its items would be one level too deep
        return not obj
    items = list(obj.values()) if type(obj) is dict else obj
    for at in range(0, len(items), DEPTH_SCAN_ITEMS):
        part = items[at : at + DEPTH_SCAN_ITEMS]
        inner = itertools.compress(part, map(_CONTAINERS.__contains__, map(type, part)))  # (C calls only)
        if not all(_depth_ok(x, depth + 1) for x in inner):
            return False
    return True


def decode(data: bytes | bytearray | memoryview) -> Any:
    """A frame's msgpack part, decoded (at most ``MAX_EXPANSION`` x its size in objects) and its nesting checked;
    ``ProtocolError`` otherwise. Pure: the daemon runs it on a worker thread for a part of ``OFF_LOOP_MSG_BYTES``
    or more."""
    try:
        raw = unpack(data)
    except Exception as exc:  # msgpack raises several unrelated types
        raise ProtocolError(f"frame is not valid msgpack: {exc}") from exc
    if not _depth_ok(raw):
        raise ProtocolError(f"message nested deeper than {MAX_NESTING}")
    return raw


def _message(raw: Any, payload: memoryview | bytes | bytearray) -> Message:
    """The message ``raw`` (as ``decode`` returns it: its nesting checked) holds, or ``ProtocolError``."""
    if not isinstance(raw, list) or not raw or raw[0] not in (REQUEST, RESPONSE, NOTIFICATION):
        raise ProtocolError("a frame must hold a msgpack-RPC array")
    kind = raw[0]
    try:
        if kind == REQUEST:
            _, msgid, method, params = raw
            ok = isinstance(msgid, int) and not isinstance(msgid, bool) and isinstance(method, str)
            if not ok or len(method) > MAX_METHOD_LEN or not isinstance(params, dict):
                raise ProtocolError("request must be [0, int msgid, str method, map params]")
            return Message(kind, method, msgid, params, payload=payload)
        if kind == RESPONSE:
            _, msgid, error, result = raw
            if not isinstance(msgid, int) or not (error is None or isinstance(error, dict)):
                raise ProtocolError("response must be [1, int msgid, nil|map error, result]")
            return Message(kind, msgid=msgid, error=error, result=result, payload=payload)
        _, method, params = raw
        if not isinstance(method, str) or len(method) > MAX_METHOD_LEN or not isinstance(params, dict):
            raise ProtocolError("notification must be [2, str method, map params]")
        return Message(kind, method, params=params, payload=payload)
    except ValueError as exc:  # wrong arity
        raise ProtocolError(f"malformed message: {exc}") from exc


class FrameDecoder:
    """Feed it bytes; take whole messages out. Raises ProtocolError on anything malformed.

    A state machine: frame head, then the msgpack part, then the payload. It can
    be fed (``feed``) or can lend its own buffer to be filled (``get_buffer`` /
    ``buffer_updated``, as asyncio's BufferedProtocol does), in which case the
    socket's bytes land straight in the payload's buffer: no copy at all here.
    """

    def __init__(
        self,
        max_msg: int = MAX_MSG_BYTES,
        max_payload: int = MAX_PAYLOAD_BYTES,
        *,
        admit_msg: Callable[[int], None] | None = None,
        admit_payload: Callable[[Any, int], bool] | None = None,
        defer: int | None = None,
    ) -> None:
        """``admit_msg(size)`` runs before a message part of ``size`` bytes is allocated (it may raise to refuse);
        ``admit_payload(raw, size)`` before a payload is: False reads the payload through a small scratch buffer
        and throws it away (the message then says how many bytes, ``discarded``). Receivers that account for
        memory use them so that no buffer is allocated for bytes they did not admit.

        ``defer``: a msgpack part of at least this many bytes is left undecoded by ``buffer_updated``, as
        ``deferred``; the caller decodes it (``decode``, off its event loop), reads nothing meanwhile, and hands the
        result to ``resume``."""
        self.max_msg, self.max_payload = max_msg, max_payload
        self.admit_msg, self.admit_payload = admit_msg, admit_payload
        self.defer = defer
        self.deferred: bytearray | memoryview | None = None  # the msgpack part waiting for ``resume``
        self._raw: Any = None  # None: reading a frame head; _UNSET: reading the msgpack part; else decoded
        self._buf: bytearray | memoryview = bytearray(FRAME_HEAD.size)  # the part being filled
        self._n = 0
        self._plen = 0
        self._mlen = 0  # the msgpack part's bytes, of the frame being read
        self._discard = 0  # payload bytes still to read and throw away
        self._out: list[Message] = []

    def get_buffer(self) -> memoryview:
        """Where the next bytes go (never empty; never asked for while a part is ``deferred``)."""
        if self._discard:
            return memoryview(self._buf)[: min(self._discard, len(self._buf))]
        return memoryview(self._buf)[self._n :]

    def buffer_updated(self, nbytes: int) -> list[Message]:
        """``nbytes`` were written into the last ``get_buffer()``; return the messages completed."""
        if self._discard:
            self._discard -= nbytes
            if not self._discard:
                raw, plen = self._raw, self._plen
                self._emit(raw, b"")
                self._out[-1].discarded = plen
        else:
            self._n += nbytes
            if self._n == len(self._buf):
                self._part_done()
        out, self._out = self._out, []
        return out

    def feed(self, data: bytes | bytearray | memoryview) -> list[Message]:
        view = memoryview(data).cast("B")
        pos = 0
        out: list[Message] = []
        while pos < len(view):
            buf = self.get_buffer()
            n = min(len(buf), len(view) - pos)
            buf[:n] = view[pos : pos + n]
            pos += n
            out += self.buffer_updated(n)
            if self.deferred is not None:
                out += self.resume(decode(self.deferred))
            if len(out) > MAX_PENDING_FRAMES:
                raise ProtocolError(f"more than {MAX_PENDING_FRAMES} frames queued unread")
        return out

    def _part_done(self) -> None:
        if self._raw is None:  # the frame head
            mlen, plen = FRAME_HEAD.unpack(self._buf)
            if mlen > self.max_msg:
                raise FrameTooLarge(f"message of {mlen} bytes (limit {self.max_msg})")
            if plen > self.max_payload:
                raise FrameTooLarge(f"payload of {plen} bytes (limit {self.max_payload})")
            if mlen == 0:
                raise ProtocolError("empty message")
            if self.admit_msg is not None:
                self.admit_msg(mlen)
            self._raw, self._plen, self._mlen = _UNSET, plen, mlen
            self._start(mlen)
        elif self._raw is _UNSET:  # the msgpack part
            if self.defer is not None and len(self._buf) >= self.defer:
                self.deferred = self._buf
            else:
                self._decoded(decode(self._buf))
        else:  # the payload
            self._emit(self._raw, self._buf)

    def resume(self, raw: Any) -> list[Message]:
        """``raw``, the ``deferred`` part decoded, goes on through the frame; the messages completed."""
        self.deferred = None
        self._decoded(raw)
        out, self._out = self._out, []
        return out

    def _decoded(self, raw: Any) -> None:
        if self._plen:
            self._raw = raw
            if self.admit_payload is None or self.admit_payload(raw, self._plen):
                self._start(self._plen)
            else:
                self._buf, self._n, self._discard = bytearray(min(DISCARD_CHUNK, self._plen)), 0, self._plen
        else:
            self._emit(raw, b"")

    def _start(self, size: int) -> None:
        # Payloads are filled by the socket: no need to zero them first (a memset of every byte received).
        self._buf = bytearray(size) if size < UNZEROED_MIN_BYTES else np.empty(size, np.uint8).data
        self._n = 0

    def _emit(self, raw: Any, payload: bytes | bytearray | memoryview) -> None:
        self._raw, self._plen = None, 0
        self._start(FRAME_HEAD.size)
        self._out.append(_message(raw, payload))
        self._out[-1].size = self._mlen

    @property
    def buffered(self) -> int:
        """Bytes of a frame started but not finished."""
        return self._n if self._raw is None else self._n + 1 + self._discard


_UNSET = object()


def frame(msg: list[Any], payload: bytes | memoryview = b"") -> list[bytes | memoryview]:
    """Encode one frame as buffers for a vectored send (the payload is not copied)."""
    body = msgpack.packb(msg, use_bin_type=True)
    if len(body) > MAX_MSG_BYTES:
        raise FrameTooLarge(f"message of {len(body)} bytes (limit {MAX_MSG_BYTES})")
    n = memoryview(payload).nbytes
    if n > MAX_PAYLOAD_BYTES:
        raise FrameTooLarge(f"payload of {n} bytes (limit {MAX_PAYLOAD_BYTES})")
    return [FRAME_HEAD.pack(len(body), n) + body, payload] if n else [FRAME_HEAD.pack(len(body), 0) + body]


def request(
    msgid: int, method: str, params: dict[str, Any], payload: bytes | memoryview = b""
) -> list[bytes | memoryview]:
    return frame([REQUEST, msgid, method, params], payload)


def error_map(error: errors.SpillError) -> dict[str, str]:
    """An error as it crosses the socket: its code and its message, cut to ``MAX_ERROR_MESSAGE``."""
    return {"code": error.code, "message": str(error)[:MAX_ERROR_MESSAGE]}


def response(msgid: int, result: Any = None, error: errors.SpillError | None = None) -> list[bytes | memoryview]:
    return frame([RESPONSE, msgid, None if error is None else error_map(error), result])


def notification(method: str, params: dict[str, Any], payload: bytes | memoryview = b"") -> list[bytes | memoryview]:
    return frame([NOTIFICATION, method, params], payload)


def raise_for(error: dict[str, str] | None) -> None:
    """Turn a response's error map back into the typed error."""
    if error is not None:
        raise errors.error_from_code(str(error.get("code", "error")), str(error.get("message", "")))


def not_a_daemon(path: str, why: errors.ProtocolError) -> errors.NotADaemon:
    """What a client says of a socket whose answer to the hello broke the protocol (an HTTP server's reply, read as
    a frame's length): not spilld, a daemon that cannot be reached."""
    return errors.NotADaemon(f"not a spilld daemon at {path} (its answer: {why})")


def hello_answer(answer: Any, path: str) -> dict[str, Any]:
    """The daemon's answer to the hello, which is a map; ``NotADaemon`` otherwise."""
    if not isinstance(answer, dict):
        raise errors.NotADaemon(f"not a spilld daemon at {path} (its answer to the hello is not a map)")
    return answer
