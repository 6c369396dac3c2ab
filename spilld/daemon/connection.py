"""One client's connection: frames in, requests run as tasks, the spills it is sending, and its lease."""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import __version__, errors
from .. import format as fmt
from .. import protocol as P
from ..lease import off_loop
from ..queue import SpillItem
from ..shm import ShmAttachments
from .listen import PeerRefused, peer_uid

if TYPE_CHECKING:
    from .server import Daemon

log = logging.getLogger("spilld.daemon")


class Incoming:
    """A spill being received: its header, one buffer per tensor, and how much of each arrived."""

    def __init__(self, header: fmt.Header, droppable: bool, key: str) -> None:
        self.header, self.droppable, self.key = header, droppable, key
        self.slots = header.slots()
        self.chunks: list[list[bytes | bytearray | memoryview]] = [[] for _ in self.slots]  # kept as received: no copy
        self.shm_names: list[str] = []  # client segments this spill reads from, handed back when it settles
        self.got = [0] * len(self.slots)
        self.error: errors.SpillError | None = None

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.slots)

    def put(self, index: int, offset: int, payload: memoryview | bytes | bytearray) -> None:
        n = memoryview(payload).nbytes
        if not 0 <= index < len(self.slots) or offset != self.got[index] or offset + n > self.slots[index].nbytes:
            raise P.BadParams(f"put out of order or out of range (tensor {index}, offset {offset}, {n} bytes)")
        self.chunks[index].append(payload)
        self.got[index] += n

    def complete(self) -> bool:
        return all(g == s.nbytes for g, s in zip(self.got, self.slots, strict=True))


class Connection(asyncio.BufferedProtocol):
    """One client. Socket bytes land straight in the frame decoder's buffers (payloads included);
    requests run as tasks and answer in order of completion."""

    _ids = itertools.count(1)

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.id = next(self._ids)
        self.decoder = P.FrameDecoder()
        self.spills: dict[int, Incoming] = {}
        self.spill_ids = itertools.count(1)  # ids of the spills it opens
        self.tasks: set[asyncio.Task[None]] = set()
        self.client_name = "?"
        self.hello = False
        self.transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._closing = False
        self.closed = asyncio.get_running_loop().create_future()
        self.lease_grantor = False
        self.shm = ShmAttachments()
        self.asked: dict[int, asyncio.Future[errors.SpillError | None]] = {}  # our requests to the client, by msgid
        self._ask_ids = itertools.count(1)

    # --- asyncio protocol -------------------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        if len(self.daemon.connections) >= self.daemon.cfg.max_clients or self.daemon.stopping.is_set():
            self._fail(P.Busy("too many clients, or the daemon is stopping"))
            return
        sock = transport.get_extra_info("socket")
        uid = peer_uid(sock) if sock is not None else None
        if uid is not None and uid != os.getuid():
            self._fail(PeerRefused(f"peer uid {uid} is not ours"))  # before a single frame is read
            return
        self.daemon.connections.add(self)
        self._arm_timer()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.decoder.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        if self._closing:
            return
        try:
            for msg in self.decoder.buffer_updated(nbytes):
                self._dispatch(msg)
        except errors.SpillError as exc:
            self._fail(exc)
            return
        except Exception as exc:  # whatever a client sends, it cannot crash the protocol callback
            self._fail(P.ProtocolError(f"malformed message: {exc!r}"[:200]))
            return
        self._arm_timer()

    def eof_received(self) -> bool:
        # A half-closed client still gets the answers it asked for; then we close.
        self._finish_later()
        return True

    async def ask_lease(self, timeout: float) -> int | None:
        """Ask the client (its engine) for a turn: the grant's id once granted (the engine then holds its lease
        until ``lease_done``), None if the client is gone. No grant within ``timeout`` raises ``Timeout``, and
        one the engine refuses raises its error: the step must not run unheld."""
        if self._closing:
            return None
        msgid = next(self._ask_ids)
        fut: asyncio.Future[errors.SpillError | None] = asyncio.get_running_loop().create_future()
        self.asked[msgid] = fut
        self.send(P.request(msgid, "lease", {"hold_s": timeout}))
        try:
            refused = await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise P.Timeout(f"the engine did not grant its lease in {timeout:g} s; nothing written") from None
        finally:
            self.asked.pop(msgid, None)
        if self._closing and refused is not None:
            return None
        if refused is not None:
            raise refused
        return msgid

    def lease_done(self, msgid: int) -> None:
        """The step a grant was asked for is over: the engine may go on."""
        if not self._closing:
            self.send(P.notification("lease_done", {"lease": msgid}))

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        for fut in self.asked.values():
            if not fut.done():
                fut.set_result(P.ConnectionLost("the lease grantor is gone"))
        self.shm.close()  # mappings still read by queued items stay until those are written
        if self._timer is not None:
            self._timer.cancel()
        log.debug(
            "client %d disconnected", self.id,
            extra={"client": self.id, "client_name": self.client_name, "spills_dropped": len(self.spills),
                   "error": repr(exc) if exc is not None else None},
        )  # fmt: skip
        for sp in self.spills.values():
            self.daemon.ingest.forget(sp)
        self.spills.clear()  # incomplete spills are dropped: no partial file ever exists
        self.daemon.connections.discard(self)
        if not self.closed.done():
            self.closed.set_result(None)

    # --- helpers --------------------------------------------------------------------------

    def _arm_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._closing or ((self.tasks or self.asked) and not self.decoder.buffered):
            return  # the client waits on us (a long commit or drain): silence is not idleness
        cfg = self.daemon.cfg
        timeout = cfg.request_timeout if self.decoder.buffered else cfg.idle_timeout
        if not self.hello:
            timeout = min(timeout, cfg.hello_timeout)
        if self._timer is not None:
            self._timer.cancel()
        self._timer = asyncio.get_running_loop().call_later(
            timeout, self._fail, P.Timeout(f"client silent for {timeout:.0f} s")
        )

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not self.tasks:
            self._arm_timer()  # idle again: the clock starts now

    def _fail(self, exc: errors.SpillError) -> None:
        """Tell the client why (a typed error notification), then close."""
        level = logging.INFO if isinstance(exc, P.Timeout) else logging.WARNING
        self.daemon.client_error(level, "client %d (%s): %s", self.id, self.client_name, exc)
        self.send(P.notification("error", {"code": exc.code, "message": str(exc)[: P.MAX_ERROR_MESSAGE]}))
        self.close()

    def _finish_later(self) -> None:
        async def finish() -> None:
            if self.tasks:
                await asyncio.wait(list(self.tasks), timeout=self.daemon.cfg.request_timeout)
            self.close()

        asyncio.get_running_loop().create_task(finish())

    def send(self, bufs: list[bytes | memoryview]) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.writelines(bufs)

    def free_shm(self, names: list[str]) -> None:
        """Hand shared-memory segments back to the client (nothing to say when there are none)."""
        if names:
            self.send(P.notification("shm_free", {"names": names}))

    def close(self) -> None:
        self._closing = True
        if self._timer is not None:
            self._timer.cancel()
        if self.transport is not None:
            self.transport.close()

    def _dispatch(self, msg: P.Message) -> None:
        if not self.hello and not (msg.kind == P.REQUEST and msg.method == "hello"):
            raise P.ProtocolError("the first message must be a hello request")
        if msg.kind == P.NOTIFICATION:
            if msg.method not in ("put", "put_shm"):
                raise P.UnknownMethod(f"unknown notification {msg.method!r}")
            self._put(msg)
        elif msg.kind == P.REQUEST:
            if msg.method == "hello":
                self._respond(msg.msgid, self._hello(msg.params))
                return
            if len(self.tasks) >= P.MAX_INFLIGHT_REQUESTS:
                raise P.ProtocolError(f"more than {P.MAX_INFLIGHT_REQUESTS} requests in flight")
            handler = self.daemon.methods.get(msg.method)
            if handler is None:
                self._respond(msg.msgid, error=P.UnknownMethod(f"unknown method {msg.method!r}"))
                return
            task = asyncio.get_running_loop().create_task(self._call(handler, msg))
            self.tasks.add(task)
            task.add_done_callback(self._task_done)
        else:  # an answer to a request of ours (a lease grant)
            fut = self.asked.pop(msg.msgid, None)
            refused = None if msg.error is None else errors.error_from_code(msg.error["code"], msg.error["message"])
            if fut is not None and not fut.done():
                fut.set_result(refused)
            elif refused is None:  # granted after we stopped waiting: let the engine go at once
                self.lease_done(msg.msgid)

    async def _call(self, handler: Any, msg: P.Message) -> None:
        try:
            result = await handler(self, msg.params, msg.msgid)
        except errors.SpillError as exc:
            self._respond(msg.msgid, error=exc)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:  # params of the wrong shape
            self._respond(msg.msgid, error=P.BadParams(f"{msg.method}: {exc!r}"[: P.MAX_ERROR_MESSAGE]))
        except Exception as exc:  # a bug must not take the daemon down
            log.exception("client %d: %s failed", self.id, msg.method)
            self._respond(msg.msgid, error=errors.SpillError(f"internal error: {exc!r}"))
        else:
            self._respond(msg.msgid, result)

    def _respond(self, msgid: int, result: Any = None, error: errors.SpillError | None = None) -> None:
        self.send(P.response(msgid, result, error))

    def _hello(self, params: dict[str, Any]) -> dict[str, Any]:
        if params.get("version") != P.PROTOCOL_VERSION:
            raise P.UnsupportedProtocol(
                f"protocol version {params.get('version')!r}; this daemon speaks {P.PROTOCOL_VERSION}"
            )
        self.hello = True
        self.client_name = str(params.get("client", "?"))[:64]
        self.lease_grantor = bool(params.get("lease_grantor", False))
        log.info(
            "client %d connected: %s", self.id, self.client_name,
            extra={"client": self.id, "client_name": self.client_name, "pid": params.get("pid"), "grantor": self.lease_grantor},
        )  # fmt: skip
        return {
            "version": P.PROTOCOL_VERSION,
            "server": f"spilld {__version__}",
            "pid": os.getpid(),
            "limits": {"max_msg": P.MAX_MSG_BYTES, "max_payload": P.MAX_PAYLOAD_BYTES},
            "shm": True,
            "dir": self.daemon.cfg.dir,
        }

    def _put(self, msg: P.Message) -> None:
        sp = self.spills.get(msg.params.get("spill")) if isinstance(msg.params.get("spill"), int) else None
        name = str(msg.params.get("shm", ""))[:64] if msg.method == "put_shm" else ""
        if name:
            if sp is None:
                self.free_shm([name])  # never keep a segment we will not use
            else:
                sp.shm_names.append(name)  # handed back when the spill settles, whatever happens to it
        if sp is None or sp.error is not None:
            return  # the commit reports the problem
        try:
            payload: memoryview | bytes | bytearray = msg.payload
            if name:
                payload = self.shm.view(name, int(msg.params["length"]))
            if not memoryview(payload).nbytes:
                raise P.BadParams("empty put")
            sp.put(int(msg.params["index"]), int(msg.params["offset"]), payload)
        except (errors.SpillError, KeyError, TypeError, ValueError, ArithmeticError) as exc:
            sp.error = exc if isinstance(exc, errors.SpillError) else P.BadParams(repr(exc)[:200])


@dataclass(eq=False)
class Received:
    """A committed spill as the daemon's queue holds it (``SpillItem.payload``)."""

    header: fmt.Header
    chunks: list[list[bytes | bytearray | memoryview]]  # each tensor's bytes, as received
    nbytes: int  # what it counts against --cap
    grantor: Connection | None  # the client whose engine grants the lease for its write steps, if any
    conn: Connection  # where its shared-memory segments go back
    shm_names: list[str]


def received_bytes(item: SpillItem) -> int:
    """What an item counts against the daemon's cap (a barrier: nothing)."""
    return item.payload.nbytes if isinstance(item.payload, Received) else 0


def free_item_shm(item: SpillItem) -> None:
    """Hand a settled item's shared-memory segments back to their client."""
    if isinstance(item.payload, Received):
        item.payload.conn.free_shm(item.payload.shm_names)


class GrantorLease:
    """A lease granted by a client's engine: before each step the daemon asks; the engine answers between two
    of its decode steps and holds its lease until the daemon says the step is done. A grant that does not come
    within the timeout fails the step (never run unheld); a grantor that is gone has no engine to keep out."""

    def __init__(self, conn: Connection, timeout: float) -> None:
        self.conn, self.timeout = conn, timeout

    async def __call__(self, fn: Any, /) -> Any:
        grant = await self.conn.ask_lease(self.timeout)
        if grant is None:
            return await off_loop(fn, background=True)
        t0 = time.monotonic()
        try:
            return await off_loop(fn, background=True)
        finally:
            self.conn.lease_done(grant)
            if time.monotonic() - t0 > self.timeout:
                log.warning("client %d: a write step outlasted its %g s grant", self.conn.id, self.timeout)


class BackgroundLease:
    """No engine to keep out: each step on a low-priority thread."""

    def __call__(self, fn: Any, /) -> Any:
        return off_loop(fn, background=True)


class StepLog:
    """Logs the span of each write step (CLOCK_MONOTONIC, at debug level): when it ran against engine steps."""

    def __init__(self, lease: Any, client: str) -> None:
        self.lease, self.client = lease, client.replace(" ", "_")

    def __call__(self, fn: Any, /) -> Any:
        def timed() -> Any:
            t0 = time.monotonic()
            try:
                return fn()
            finally:
                log.debug("write step for %s: %.6f-%.6f", self.client, t0, time.monotonic())

        return self.lease(timed)
