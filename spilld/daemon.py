"""The spilld service: one process, one Unix socket, one queue and one store for every engine.

Clients hand over file-ready spills: a planned header, then the tensors' bytes
(``put`` frames), then ``commit``. The daemon queues the complete item against
``--cap``, writes it with the generator saver (hashes computed here, never
trusted from the client) and answers the commit once the file is durable.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import os
import signal
import socket
import struct
import sys
import time
from typing import Any

from . import __version__, errors
from . import format as fmt
from . import protocol as P
from .config import Config, format_size
from .lease import NoLease, off_loop
from .queue import Outcome, SpillItem, SpillQueue
from .saver import BytesSource
from .service.activation import inherited_listener, socket_path
from .service.lifecycle import Lifecycle, Progress
from .shm import ShmAttachments
from .store import Hit, MissReason, Store, checkpoint_namespace

log = logging.getLogger("spilld.daemon")

DRAIN_PROGRESS_S = 0.5
MAX_OPEN_SPILLS = 16  # spills being received on one connection
CLIENT_ERROR_LOGS_PER_S = 10  # log lines a second about misbehaving clients; the rest are counted, then summarized


class AlreadyRunning(errors.SpillError):
    code = "already_running"


class PeerRefused(errors.SpillError):
    code = "peer_refused"


errors.ERRORS_BY_CODE.update({AlreadyRunning.code: AlreadyRunning, PeerRefused.code: PeerRefused})


def peer_uid(sock: socket.socket) -> int | None:
    """The uid of the process at the other end of a Unix socket (None where the OS cannot tell)."""
    if hasattr(socket, "SO_PEERCRED"):
        raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        return int(struct.unpack("3i", raw)[1])
    if sys.platform == "darwin":  # LOCAL_PEERCRED: struct xucred {u_int version; uid_t uid; ...}
        raw = sock.getsockopt(0, 0x001, 76)
        return int(struct.unpack_from("Ii", raw)[1])
    return None


class LogThrottle:
    """At most ``per_s`` lines a second; the lines held back are counted for a summary line.

    A client that misbehaves on purpose, in a loop, must not be able to fill the disk with our logs.
    """

    def __init__(self, per_s: int) -> None:
        self.per_s = per_s
        self.held = 0
        self._window = -1.0
        self._sent = 0

    def allow(self) -> bool:
        now = time.monotonic()
        if now - self._window >= 1.0:
            self._window, self._sent = now, 0
        if self._sent >= self.per_s:
            self.held += 1
            return False
        self._sent += 1
        return True

    def take_held(self) -> int:
        held, self.held = self.held, 0
        return held


class _Incoming:
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
        self.spills: dict[int, _Incoming] = {}
        self._spill_ids = itertools.count(1)
        self.tasks: set[asyncio.Task[None]] = set()
        self.client_name = "?"
        self.hello = False
        self.transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._closing = False
        self.closed = asyncio.get_running_loop().create_future()
        self.lease_grantor = False
        self.shm = ShmAttachments()
        self.asked: dict[int, asyncio.Future[bool]] = {}  # our requests to the client, by msgid
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

    async def ask_lease(self, timeout: float) -> bool:
        """Ask the client (its engine) for a turn; False if it is gone or does not answer in time."""
        if self._closing:
            return False
        msgid = next(self._ask_ids)
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self.asked[msgid] = fut
        self.send(P.request(msgid, "lease", {}))
        try:
            return await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            return False
        finally:
            self.asked.pop(msgid, None)

    def connection_lost(self, exc: Exception | None) -> None:
        self._closing = True
        for fut in self.asked.values():
            if not fut.done():
                fut.set_result(False)
        self.shm.close()  # mappings still read by queued items stay until those are written
        if self._timer is not None:
            self._timer.cancel()
        for sp in self.spills.values():
            self.daemon.forget_incoming(sp)
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
            if fut is not None and not fut.done():
                fut.set_result(msg.error is None)

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
        log.info("client %d connected: %s", self.id, self.client_name)
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


def _free_shm(item: SpillItem) -> None:
    """Hand a settled item's shared-memory segments back to their client."""
    conn, names = item.meta.get("shm", (None, []))
    if conn is not None:
        conn.free_shm(names)


class GrantorLease:
    """A lease granted by a client's engine: before each step the daemon asks, the engine answers between its
    decode steps. A grantor that is gone or silent past the timeout no longer holds anything up (a free lease)."""

    def __init__(self, conn: Connection, timeout: float) -> None:
        self.conn, self.timeout = conn, timeout

    async def __call__(self, fn: Any, /) -> Any:
        await self.conn.ask_lease(self.timeout)
        return await off_loop(fn)


class Daemon:
    """The service state shared by every connection. ``listener``: a listening socket handed over by a service
    manager (socket activation), served instead of binding ``cfg.socket``."""

    def __init__(self, cfg: Config, listener: socket.socket | None = None) -> None:
        self.cfg = cfg
        self.listener = listener
        self.service = Lifecycle.from_env()  # sd_notify; no-ops outside systemd
        self.store = Store(cfg.dir, disk_cap=cfg.disk_cap, durability=cfg.durability)
        self.queue = SpillQueue(cfg.cap, self._write, bytes_of=lambda it: int(it.meta["nbytes"]), release=_free_shm)
        self.lease = NoLease()
        self.connections: set[Connection] = set()
        self.receiving = 0  # bytes declared by spills being received (not yet in the queue)
        self.reserved = 0  # of those, the non-droppable ones: queue room held for their commit
        self.client_errors = 0  # connections ended for a client's fault (bad frames, timeouts, refusals)
        self.client_log = LogThrottle(CLIENT_ERROR_LOGS_PER_S)
        self.writing = 0  # saves under way (a drain that is writing is making progress)
        self.started = time.time()
        self.stopping = asyncio.Event()
        self._server: asyncio.AbstractServer | None = None
        self._signals = 0
        names = [
            "spill",
            "commit",
            "abort",
            "barrier",
            "cancel",
            "lookup",
            "touch",
            "delete",
            "report_bad",
            "drain",
            "status",
            "shutdown",
            "evict",
        ]
        self.methods: dict[str, Any] = {n: getattr(self, f"_{n}") for n in names}

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        async with self.service.extending(self._scan_progress):  # READY=1 waits for the scan: a big store needs time
            await off_loop(self.store.scan)
        if self.listener is not None:  # the manager owns the path: no stale-socket probe, no unlink at stop
            self._server = await asyncio.get_running_loop().create_unix_server(
                lambda: Connection(self), sock=self.listener
            )
            self.cfg.socket = socket_path(self.listener) or self.cfg.socket
        else:
            self._server = await bind(self.cfg.socket, lambda: Connection(self))
        log.info(
            "spilld %s serving on %s: dir %s, cap %s, disk cap %s, %d entries",
            __version__, self.cfg.socket, self.cfg.dir, format_size(self.cfg.cap),
            format_size(self.store.disk_cap), len(self.store.entries),
        )  # fmt: skip
        self.service.ready(f"serving on {self.cfg.socket}: {len(self.store.entries)} entries")

    async def serve(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._on_signal, sig)
        self.service.start_watchdog()  # before the scan: a long scan runs off the loop, which stays alive
        await self.start()
        await self.stopping.wait()
        return await self.stop()

    def _on_signal(self, sig: int) -> None:
        self._signals += 1
        if self._signals > 1:
            log.warning("second signal: exiting now")
            os._exit(1)
        log.info(
            "%s: stopping (finishing queued work within %.0f s)", signal.Signals(sig).name, self.cfg.drain_deadline
        )
        self.stopping.set()

    async def stop(self) -> int:
        self.service.stopping(self._drain_status())
        if self._server is not None:
            self._server.close()
        async with self.service.extending(self._drain_progress, budget_s=self.cfg.drain_deadline):
            report = await self.queue.close(timeout=self.cfg.drain_deadline)
        for conn in list(self.connections):
            if conn.tasks:  # commits answered before the connections go
                await asyncio.wait(list(conn.tasks), timeout=1.0)
            conn.close()
        if self.listener is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.cfg.socket)
        log.info("stopped: %s", json.dumps(self.queue.counters()))
        await self.service.close()
        return 0 if report.done else 3

    def client_error(self, level: int, msg: str, *args: Any) -> None:
        """Count a client's fault; log it unless too many came this second (then one summary line a second later)."""
        self.client_errors += 1
        if self.client_log.allow():
            log.log(level, msg, *args)
        elif self.client_log.held == 1:
            asyncio.get_running_loop().call_later(1.0, self._log_held_client_errors)

    def _log_held_client_errors(self) -> None:
        if held := self.client_log.take_held():
            log.warning("%d more client errors not logged (at most %d lines a second)", held, self.client_log.per_s)

    def _drain_status(self) -> str:
        return f"stopping: {self.queue.pending_items} items ({format_size(self.queue.pending_bytes)}) left to write"

    def _drain_progress(self) -> Progress:
        q = self.queue
        return Progress((q.pending_items, q.pending_bytes), busy=self.writing > 0, status=self._drain_status())

    def _scan_progress(self) -> Progress:
        found, c = len(self.store.entries), self.store.counters  # the scan appends from its thread
        return Progress((found, c.quarantined, c.reaped_temp), busy=False, status=f"scanning: {found} entries so far")

    # --- writing -------------------------------------------------------------------------

    async def _write(self, item: SpillItem) -> Any:
        header: fmt.Header = item.meta["header"]
        sources = [BytesSource(c, s.shape) for c, s in zip(item.meta["chunks"], header.slots(), strict=True)]
        grantor: Connection | None = item.meta.get("grantor")
        lease = GrantorLease(grantor, self.cfg.request_timeout) if grantor is not None else self.lease
        self.writing += 1
        try:
            return await self.store.put([], [], header.identity, planned=(header, list(sources)), run_step=lease)
        finally:
            self.writing -= 1

    # --- methods ---------------------------------------------------------------------------

    async def _spill(self, conn: Connection, p: dict[str, Any], msgid: int) -> dict[str, Any]:
        if self.stopping.is_set():
            raise P.Busy("the daemon is stopping")
        header = fmt.header_from_wire(p["header"])
        header.created_at_ms = time.time_ns() // 1_000_000
        for s in header.slots():
            s.hash = fmt.PLACEHOLDER_HASH  # computed here, never trusted
        fmt.check_nesting(header.caches)
        slots = header.slots()
        fmt.check_limits(slots)
        fmt.plan_offsets(slots)  # the daemon decides the layout
        if header.checkpoint is not None:
            header.identity.namespace = checkpoint_namespace(header.checkpoint.key)
        droppable = bool(p.get("droppable", True))
        sp = _Incoming(header, droppable, str(p.get("key", "")))
        if len(conn.spills) >= MAX_OPEN_SPILLS:
            raise P.Busy(f"more than {MAX_OPEN_SPILLS} spills open on one connection")
        if self.receiving and self.receiving + self.queue.pending_bytes + sp.nbytes > 2 * self.cfg.cap:
            raise P.Busy("too many bytes in flight to the daemon; retry later")  # memory stays bounded
        if not droppable and not self._fits(sp.nbytes):
            raise P.Busy(
                f"queue full ({format_size(self.queue.pending_bytes)} of {format_size(self.cfg.cap)}); retry later"
            )
        sid = next(conn._spill_ids)
        conn.spills[sid] = sp
        self.receiving += sp.nbytes
        if not droppable:  # its room is held from now, so the commit of its last byte is never refused
            self.reserved += sp.nbytes
        return {"spill": sid, "tensors": len(slots), "bytes": sp.nbytes}

    def _fits(self, nbytes: int) -> bool:
        # An empty queue takes any one item (a soft cap), so an item larger than the cap still goes out.
        if self.queue.pending_items == 0 and self.reserved == 0:
            return True
        return self.queue.would_fit(self.reserved + nbytes)

    def forget_incoming(self, sp: _Incoming) -> None:
        """A spill being received ends (committed, aborted, or its client gone): release what it held."""
        self.receiving -= sp.nbytes
        if not sp.droppable:
            self.reserved -= sp.nbytes

    async def _commit(self, conn: Connection, p: dict[str, Any], msgid: int) -> dict[str, Any]:
        sp = conn.spills.pop(int(p["spill"]), None)
        if sp is None:
            raise P.BadParams("no such spill")
        self.forget_incoming(sp)  # from here the queue counts it
        if sp.error is not None or not sp.complete():
            conn.free_shm(sp.shm_names)
            raise sp.error or P.BadParams("commit before every tensor byte arrived")
        item = SpillItem(
            tokens=sp.header.tokens,
            namespace=sp.header.identity.namespace,
            key=sp.key,
            droppable=sp.droppable,
            meta={
                "header": sp.header,
                "chunks": sp.chunks,
                "nbytes": sp.nbytes,
                "grantor": conn if conn.lease_grantor else None,
                "shm": (conn, sp.shm_names),
            },
        )
        settled = await self.queue.enqueue(item)
        out: dict[str, Any] = {"outcome": settled.outcome.value}
        if settled.outcome is Outcome.STORED:
            out |= {"path": settled.value.path, "file_bytes": settled.value.file_bytes}
        elif settled.error is not None:
            err = (
                settled.error
                if isinstance(settled.error, errors.SpillError)
                else errors.StorageError(str(settled.error))
            )
            out |= {"code": err.code, "message": str(err)}
        return out

    async def _abort(self, conn: Connection, p: dict[str, Any], msgid: int) -> None:
        sp = conn.spills.pop(int(p["spill"]), None)
        if sp is not None:
            self.forget_incoming(sp)
            conn.free_shm(sp.shm_names)

    async def _barrier(self, conn: Connection, p: dict[str, Any], msgid: int) -> dict[str, Any]:
        key = str(p.get("key", ""))
        delete = bool(p.get("delete_checkpoints", False))

        async def action() -> int:
            return self.store.remove_checkpoints(key) if delete else 0  # the index lives on this thread

        settled = await self.queue.enqueue(SpillItem(key=key, barrier=action, meta={"nbytes": 0}))
        return {"outcome": settled.outcome.value, "deleted": settled.value or 0}

    async def _cancel(self, conn: Connection, p: dict[str, Any], msgid: int) -> dict[str, Any]:
        ns, key = p.get("namespace"), p.get("key")
        if ns is None and key is None:
            raise P.BadParams("cancel needs a namespace or a key")
        n = self.queue.cancel_where(lambda it: (ns is None or it.namespace == ns) and (key is None or it.key == key))
        return {"cancelled": n}

    async def _lookup(self, conn: Connection, p: dict[str, Any], msgid: int) -> dict[str, Any]:
        ident = fmt.Identity(**{k: str(v) for k, v in p["identity"].items()})
        tokens = fmt.decode_tokens(p["tokens"])
        hit = self.store.lookup(ident, str(p.get("namespace", "")), tokens, codec_provider=p.get("codec_provider"))
        if isinstance(hit, Hit):
            e = hit.entry
            return {"hit": True, "path": e.path, "matched": hit.matched, "tokens": e.ntokens, "trimmable": e.trimmable}
        return {"hit": False, "reason": hit.reason.value}

    async def _touch(self, conn: Connection, p: dict[str, Any], msgid: int) -> dict[str, Any]:
        e = self.store.entry_at(str(p["path"]))
        if e is not None:
            self.store.touch(e)
            self.store.counters.hits += 1
        return {"found": e is not None}

    async def _delete(self, conn: Connection, p: dict[str, Any], msgid: int) -> dict[str, Any]:
        if "path" in p:
            n = self.store.remove_where(lambda e: e.path == str(p["path"]))
        elif "key" in p:
            n = self.store.remove_checkpoints(str(p["key"]))
        else:
            raise P.BadParams("delete needs a path or a key")
        return {"deleted": n}

    async def _report_bad(self, conn: Connection, p: dict[str, Any], msgid: int) -> dict[str, Any]:
        path = str(p["path"])
        e = self.store.entry_at(path)
        if e is None:
            return {"quarantined": False}
        self.store.quarantine(path, errors.error_from_code(str(p.get("code", "bad_file")), "reported by a client"))
        self.store.counters.misses[MissReason.CORRUPT.value] += 1
        return {"quarantined": True}

    async def _drain(self, conn: Connection, p: dict[str, Any], msgid: int) -> dict[str, Any]:
        deadline = time.monotonic() + float(p.get("timeout", 3600.0))
        while True:
            left = deadline - time.monotonic()
            rep = await self.queue.drain(timeout=max(0.0, min(DRAIN_PROGRESS_S, left)))
            if rep.done or left <= 0:
                return {"done": rep.done, "pending_items": rep.pending_items, "pending_bytes": rep.pending_bytes}
            conn.send(
                P.notification(
                    "drain_progress",
                    {"msgid": msgid, "pending_items": rep.pending_items, "pending_bytes": rep.pending_bytes},
                )
            )

    async def _evict(self, conn: Connection, p: dict[str, Any], msgid: int) -> dict[str, Any]:
        fp, older = p.get("fingerprint"), p.get("older_than_s")
        n, nbytes = self.store.evict_matching(fp, None if older is None else float(older))  # index: loop thread only
        return {"evicted": n, "bytes": nbytes}

    async def _status(self, conn: Connection, p: dict[str, Any], msgid: int) -> dict[str, Any]:
        return self.status()

    async def _shutdown(self, conn: Connection, p: dict[str, Any], msgid: int) -> dict[str, Any]:
        self.stopping.set()
        return {"stopping": True}

    def status(self) -> dict[str, Any]:
        return {
            "version": __version__,
            "pid": os.getpid(),
            "uptime_s": round(time.time() - self.started, 1),
            "socket": self.cfg.socket,
            "dir": self.cfg.dir,
            "cap": self.cfg.cap,
            "clients": len(self.connections),
            "client_errors": self.client_errors,
            "queue": self.queue.counters(),
            "store": self.store.stats(),
        }


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


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        d = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            d["exc"] = self.formatException(record.exc_info)
        return json.dumps(d)


def setup_logging(level: str = "info", json_logs: bool | None = None) -> None:
    """JSON lines when stderr is not a terminal (service managers, files); plain text on a terminal."""
    handler = logging.StreamHandler(sys.stderr)
    use_json = not sys.stderr.isatty() if json_logs is None else json_logs
    handler.setFormatter(
        JsonFormatter() if use_json else logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
    )
    root = logging.getLogger("spilld")
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def run(cfg: Config) -> int:
    """Run the daemon on uvloop until SIGTERM/SIGINT or a shutdown request, on the socket a service manager
    passed if there is one (raises ``ActivationError`` if what it passed is unusable)."""
    import uvloop

    listener = inherited_listener()  # before anything could start a child: it unsets LISTEN_*

    async def main() -> int:
        return await Daemon(cfg, listener).serve()

    return int(uvloop.run(main()))
