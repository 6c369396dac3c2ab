"""One client's connection: frames in, requests run as tasks, the spills it is sending, and its lease."""

from __future__ import annotations

import asyncio
import contextvars
import functools
import itertools
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .. import __version__, blocks, errors, mlxthreads, shm
from .. import format as fmt
from .. import protocol as P
from ..lease import Droppable, off_loop
from ..peer import peer_pid
from ..queue import SpillItem
from ..saver import BytesSource, waits_for_grant
from .budget import lookup_bytes
from .listen import PeerRefused, peer_uid
from .params import check as check_params

# An open spill must arrive at this pace on average, beyond its first --idle-timeout: its room is held meanwhile, and
# a byte now and then kept one of twice the cap open, every other spill refused busy (found in review); a put's
# payload likewise, within --request-timeout plus its bytes at this pace
MIN_SPILL_BYTES_PER_S = 8 * 1024**2

if TYPE_CHECKING:
    from .server import Daemon

log = logging.getLogger("spilld.daemon")

# The only methods whose params may be a big message (its tokens): the others' params are small, and some of them
# wait a long time (drain, barrier, commit) holding their params, which are counted only until a handler starts.
BIG_PARAMS_METHODS = frozenset({"spill", "lookup"})
# Requests whose only work is their answer: cancelled with a lost connection (a drain may wait for hours); the others
# (a commit, a barrier, an eviction, a delete) go on: what they started is the daemon's to finish
ANSWER_ONLY = frozenset({"drain", "lookup", "resume", "status"})
MAX_EXPIRED_KEPT = 64  # spills the daemon aborted whose commit can still say why (then: no such spill)
# What the daemon keeps written for a client that has not read it: past this, the client does not read its answers
# and is cut off (its requests are answered whether it reads or not; 64 in flight of the largest answer, a lookup's
# block paths, come to about 32 MiB)
MAX_UNREAD_BYTES = 64 * 1024**2
CLOSE_FLUSH_S = 5.0  # how long a closed connection's last bytes may wait for a peer to read them
# A spill's cost counts its tensor bytes, not the objects that hold them: a put smaller than this is copied onto
# the tensor's last chunk (one of at most COALESCED_CHUNK_BYTES), so a client sending 1-byte puts holds one object
# per MiB, not 66 bytes of objects per byte (found in review: 60x the cap)
COALESCE_BELOW = 64 * 1024
COALESCED_CHUNK_BYTES = 1024**2
# and a put_shm moves at least this many bytes, unless it ends its tensor (a client's segments are MiBs): each is a
# buffer and a copy job of its own
MIN_SHM_PUT_BYTES = 64 * 1024
# the segments a client hands over with ``shm_pool`` that its connection's end unlinks, at most (a pool has 8)
MAX_POOL_SEGMENTS = 1024
# the bytes counted for the message of the request a task handles (see Connection._call, release_message)
_MESSAGE_HOLD: contextvars.ContextVar[list[int] | None] = contextvars.ContextVar("message_hold", default=None)


class Incoming:
    """A spill being received: its header, one buffer per tensor, and how much of each arrived."""

    def __init__(
        self, header: fmt.Header, droppable: bool, key: str, parsed: int = 0, pin: bool = False, held_rows: int = 0
    ) -> None:
        self.header, self.droppable, self.key, self.pin = header, droppable, key, pin
        self.slots = header.slots()
        self.held_rows = held_rows  # rows of its positional caches the daemon holds as blocks: not sent
        self.hold: Any = None  # the store's pins on those blocks, until it is written or ends (Ingest)
        self.expect = [s.nbytes for s, _ in blocks.after_held(header, held_rows)]  # the bytes each tensor is sent
        self.cost = self.nbytes + parsed  # what it holds against the cap: tensor bytes and the parsed header
        self.last = self.opened = asyncio.get_running_loop().time()  # when it last received something, and began
        self.released = False  # its bytes were handed back to the daemon's count
        self.filling = False  # a put's payload is being read into a buffer counted as this spill's
        self.forget_when_filled = False  # it ended meanwhile: its count goes once that payload is read
        self.chunks: list[list[bytes | bytearray | memoryview]] = [[] for _ in self.slots]  # kept as received: no copy
        self._coalesced: list[bytearray | None] = [None] * len(self.slots)  # each tensor's chunk of small puts
        self.reads: set[asyncio.Future[None]] = set()  # segment copies under way into chunks of this spill
        self.got = [0] * len(self.slots)
        self.error: errors.SpillError | None = None

    @property
    def nbytes(self) -> int:
        return sum(self.expect)

    def next_within(self, index: int, offset: int, n: int) -> bool:
        """Whether ``n`` bytes at ``offset`` of tensor ``index`` are its next ones, within what it is sent (and was
        counted for: held rows are not sent)."""
        return 0 <= index < len(self.slots) and offset == self.got[index] and offset + n <= self.expect[index]

    def claim(self, index: int, offset: int, n: int) -> None:
        """Check that ``n`` bytes at ``offset`` of tensor ``index`` are the next ones, within it; count them."""
        if not self.next_within(index, offset, n):
            raise P.BadParams(f"put out of order or out of range (tensor {index}, offset {offset}, {n} bytes)")
        self.got[index] += n
        self.last = asyncio.get_running_loop().time()

    def put(self, index: int, offset: int, payload: memoryview | bytes | bytearray) -> None:
        n = memoryview(payload).nbytes
        self.claim(index, offset, n)
        chunks, tail = self.chunks[index], self._coalesced[index]
        if n >= COALESCE_BELOW:
            chunks.append(payload)  # kept as it came: no copy
        elif tail is not None and chunks and chunks[-1] is tail and len(tail) + n <= COALESCED_CHUNK_BYTES:
            tail += payload
        else:
            chunks.append(tail := bytearray(payload))
            self._coalesced[index] = tail

    def check_shm_length(self, index: int, offset: int, length: int) -> None:
        """A put_shm of at least ``MIN_SHM_PUT_BYTES``, or the last bytes of its tensor."""
        if length < MIN_SHM_PUT_BYTES and offset + length != self.expect[index]:
            raise P.BadParams(
                f"a put_shm of {length} bytes that does not end its tensor (at least {MIN_SHM_PUT_BYTES})"
            )

    def fail(self, exc: errors.SpillError) -> None:
        """The spill cannot be stored (the commit says why); what it received so far is let go now."""
        if self.error is None:
            self.error = exc
        self.chunks = [[] for _ in self.slots]
        self._coalesced = [None] * len(self.slots)

    async def settled_reads(self) -> None:
        """Wait for the segment copies still under way (each ends: a copy is bounded, never waits on the client)."""
        while self.reads:
            await asyncio.wait(list(self.reads))

    def complete(self) -> bool:
        return self.got == self.expect


class Connection(asyncio.BufferedProtocol):
    """One client. Socket bytes land straight in the frame decoder's buffers (payloads included);
    requests run as tasks and answer in order of completion."""

    _ids = itertools.count(1)

    def __init__(self, daemon: Daemon) -> None:
        self.daemon = daemon
        self.id = next(self._ids)
        self.decoder = P.FrameDecoder(
            admit_msg=self._admit_msg, admit_payload=self._admit_payload, defer=P.OFF_LOOP_MSG_BYTES
        )
        self._decoding: asyncio.Future[Any] | None = None  # a big message being decoded on a worker thread
        self.spills: dict[int, Incoming] = {}
        self.expired: dict[int, errors.SpillError] = {}  # spills aborted by the daemon: why, for their commit
        self._held_msg = 0  # bytes counted for the big message being received (see Ingest.hold_message)
        self.spill_ids = itertools.count(1)  # ids of the spills it opens
        self.tasks: set[asyncio.Task[None]] = set()
        self.client_name = "?"
        self.hello = False
        self.transport: asyncio.Transport | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._closing = False
        self.closed = asyncio.get_running_loop().create_future()
        self.lease_grantor = False
        self.session = f"connection {self.id}"  # who sent a spill, for ``cancel`` (the hello may name the client's)
        # whose share of the lookup budget its lookups take: its process, whatever its connections (connection_made)
        self.lookup_client = f"connection {self.id}"
        self.asked: dict[int, asyncio.Future[errors.SpillError | None]] = {}  # our requests to the client, by msgid
        self._eof = False  # the client sent EOF: it reads our answers, but sends (and grants) nothing more
        self._grant_missed: str | None = None  # why this client's engine is asked for no more grants
        self._filling: Incoming | None = None  # the spill whose put payload is being read now
        self._ask_ids = itertools.count(1)
        # Deadlines that a trickle of bytes does not push back (found in review: one byte every few seconds kept a
        # connection without a hello, or a big message holding the receiving budget, open for as long as it liked)
        self._hello_by = asyncio.get_running_loop().time() + daemon.cfg.hello_timeout
        self._msg_by: float | None = None  # the big message being received must be whole by then
        self._payload_by: float | None = None  # the put payload being read must be whole by then
        # the client's pool (its ``shm_pool``), unlinked once the connection ends and its copies are done: found in
        # review, a client killed with its process group (its resource tracker too) left 256 MiB in /dev/shm for good
        self.segments: set[str] = set()
        # the segment names this connection may name in a put_shm (``daemon.shm_owners`` maps each to it): its pool,
        # or for a client that hands none over, each name it used first; found in review, any same-uid client could
        # name another's segments, so the daemon read (and stored as its spill) what another engine was sending
        self.owned: set[str] = set()
        self.pooled = False  # it sent ``shm_pool``: only the names in it are its own
        self._copies: set[asyncio.Future[None]] = set()  # segment copies under way (committed spills' included)

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
        if sock is not None and (pid := peer_pid(sock)) is not None:  # the kernel's word, not the hello's
            self.lookup_client = f"pid {pid}"
        self.daemon.connections.add(self)
        self._arm_timer()

    def get_buffer(self, sizehint: int) -> memoryview:
        return self.decoder.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        if self._closing:
            return
        self._take(lambda: self.decoder.buffer_updated(nbytes))

    def _take(self, messages: Any) -> None:
        """Dispatch the ``messages()`` completed; a big message part left undecoded is decoded off the loop."""
        try:
            for msg in messages():
                self._dispatch(msg)
        except errors.SpillError as exc:
            self._fail(exc)
            return
        except Exception as exc:  # whatever a client sends, it cannot crash the protocol callback
            self._fail(P.ProtocolError(f"malformed message ({type(exc).__name__}: {exc})"[:200]))
            return
        if self.decoder.deferred is not None and not self._closing:
            self._decode_deferred(self.decoder.deferred)
        self._arm_timer()

    def _decode_deferred(self, part: bytearray | memoryview) -> None:
        """Decode a big message part on a worker thread, reading nothing meanwhile (its frame goes on after it):
        found in review, 4 MiB of small arrays decoded on the loop kept every other client waiting 0.5 s."""
        assert self.transport is not None
        self.transport.pause_reading()
        self._decoding = fut = asyncio.ensure_future(off_loop(functools.partial(P.decode, part), compute=True))
        started = asyncio.get_running_loop().time()

        def decoded(f: asyncio.Future[Any]) -> None:
            self._decoding = None
            if self._msg_by is not None:  # the decode's wait was ours, not the client's: its deadline moves with it
                self._msg_by += asyncio.get_running_loop().time() - started
            if self._closing or f.cancelled():  # gone meanwhile: nothing to dispatch (connection_lost lets it go)
                f.cancelled() or f.exception()
                return
            self._take(lambda: self.decoder.resume(f.result()))
            if not self._closing and self.transport is not None:
                self.transport.resume_reading()

        fut.add_done_callback(decoded)

    def eof_received(self) -> bool:
        # A half-closed client still gets the answers it asked for; then we close. It can grant nothing more: a
        # write waiting on its lease goes on unheld now (its commit is among what the close waits for).
        self._eof = True
        self._grantor_gone()
        self._finish_later()
        return True

    @property
    def _no_grants(self) -> bool:
        """The client is gone, or sent EOF: it grants nothing more."""
        return self._closing or self._eof

    def _grantor_gone(self) -> None:
        for fut in self.asked.values():
            if not fut.done():
                fut.set_result(P.ConnectionLost("the lease grantor is gone"))

    async def ask_lease(self, timeout: float) -> int | None:
        """Ask the client (its engine) for a turn: the grant's id once granted (the engine then holds its lease
        until ``lease_done``), None if the client is gone. No grant within ``timeout`` raises ``Timeout``, and
        one the engine refuses raises its error: the step must not run unheld."""
        if self._no_grants:
            return None
        if self._grant_missed is not None:  # it let a grant time out: asking again would hold the writer as long
            raise P.Timeout(f"the engine did not grant its lease before ({self._grant_missed}); nothing written")
        msgid = next(self._ask_ids)
        fut: asyncio.Future[errors.SpillError | None] = asyncio.get_running_loop().create_future()
        self.asked[msgid] = fut
        self.send(P.request(msgid, "lease", {"hold_s": timeout}))
        try:
            refused = await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            # one grant missed, and this connection's writes fail at once from now on: the daemon has one writer,
            # and an engine that does not answer must not hold every other client's writes a timeout an item
            self._grant_missed = f"no grant in {timeout:g} s"
            log.warning("client %d: its engine did not grant its lease in %g s; its spills now fail", self.id, timeout)
            raise P.Timeout(f"the engine did not grant its lease in {timeout:g} s; nothing written") from None
        finally:
            self.asked.pop(msgid, None)
        if self._no_grants and refused is not None:
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
        self._grantor_gone()
        for task in self.tasks:  # nobody will read their answers (a drain could wait for hours); commits and
            if task.get_name() in ANSWER_ONLY:  # barriers go on: what they started is the daemon's to finish
                task.cancel()
        if self._timer is not None:
            self._timer.cancel()
        log.debug(
            "client %d disconnected", self.id,
            extra={"client": self.id, "client_name": self.client_name, "spills_dropped": len(self.spills),
                   "error": repr(exc) if exc is not None else None},
        )  # fmt: skip
        for sp in self.spills.values():
            self.daemon.ingest.forget(sp)
            sp.fail(P.ConnectionLost("the client is gone"))
        self.spills.clear()  # incomplete spills are dropped: no partial file ever exists
        self._filled()
        held, self._held_msg = self._held_msg, 0
        if self._decoding is not None:  # its objects are being made: counted until the decode ends
            self._decoding.add_done_callback(lambda _: self.daemon.ingest.release(held))
        else:
            self.daemon.ingest.release(held)
        self.daemon.connections.discard(self)
        self.daemon.restores_gone(self)
        self._unlink_segments()
        if not self.closed.done():
            self.closed.set_result(None)

    def _unlink_segments(self) -> None:
        """The connection ended: the pool its client handed over is unlinked once its copies are done (a committed
        spill's copy goes on). The client never reuses a pool on another connection (``format.md``)."""
        if self._copies:
            next(iter(self._copies)).add_done_callback(lambda _: self._unlink_segments())
            return
        names, self.segments = self.segments, set()
        if not names:
            self._disown()
            return
        fut = asyncio.get_running_loop().run_in_executor(
            shm.reader_pool(), mlxthreads.releasing(lambda: shm.unlink_segments(names))
        )
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())  # (unlink_segments raises nothing)
        # owned until unlinked: another connection handing a name over meanwhile would lose its segment to this unlink
        fut.add_done_callback(lambda _: self._disown())

    def _disown(self) -> None:
        """The names this connection owned may be another's from now on (its copies and unlinks are done)."""
        owners = self.daemon.shm_owners
        for name in self.owned:
            if owners.get(name) is self:
                del owners[name]
        self.owned = set()

    # --- helpers --------------------------------------------------------------------------

    def _arm_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        if self._closing or ((self.tasks or self.asked) and not self.decoder.buffered):
            return  # the client waits on us (a long commit or drain): silence is not idleness
        if self._decoding is not None:  # nothing is read while its message is decoded (found in review: a decode
            return  # waiting for a compute thread timed the client out as silent); re-armed once it ends
        cfg, now = self.daemon.cfg, asyncio.get_running_loop().time()
        timeout = cfg.request_timeout if self.decoder.buffered else cfg.idle_timeout
        why = f"client silent for {timeout:g} s"
        if not self.hello and self._hello_by - now < timeout:
            timeout, why = self._hello_by - now, f"no hello within {cfg.hello_timeout:g} s"
        if self._held_msg and self._msg_by is not None and self._msg_by - now < timeout:
            timeout, why = self._msg_by - now, f"a message of this size not received within {cfg.request_timeout:g} s"
        # (found in review: a payload fed a byte at a time held its spill's whole count, after the spill expired too)
        if self._filling is not None and self._payload_by is not None and self._payload_by - now < timeout:
            timeout, why = self._payload_by - now, "a put's payload not received at the least pace"
        self._timer = asyncio.get_running_loop().call_later(max(0.0, timeout), self._fail, P.Timeout(why))

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self.tasks.discard(task)
        if not self.tasks:
            self._arm_timer()  # idle again: the clock starts now

    def _fail(self, exc: errors.SpillError, msgid: int | None = None) -> None:
        """Tell the client why, then close: as the response to request ``msgid`` when the fault is that
        request's, else as an ``error`` notification."""
        level = logging.INFO if isinstance(exc, P.Timeout) else logging.WARNING
        self.daemon.client_error(level, "client %d (%s): %s", self.id, self.client_name, exc)
        if msgid is not None:
            self._respond(msgid, error=exc)
        else:
            self.send(P.notification("error", P.error_map(exc)))
        self.close()

    def fail_spill(self, sid: Any, sp: Incoming | None, exc: errors.SpillError) -> None:
        """A spill (or a put naming none) fails: a ``spill_error`` notification says so at once, the first time;
        the spill's ``commit`` answers the same error."""
        if sp is not None:
            if sp.error is not None:
                return
            sp.fail(exc)
        params = {"spill": sid if type(sid) is int else -1, **P.error_map(exc)}
        self.send(P.notification("spill_error", params))

    def _finish_later(self) -> None:
        async def finish() -> None:
            if self.tasks:
                await asyncio.wait(list(self.tasks), timeout=self.daemon.cfg.request_timeout)
            self.close()

        asyncio.get_running_loop().create_task(finish())

    def send(self, bufs: list[bytes | memoryview]) -> None:
        t = self.transport
        if t is None or t.is_closing():
            return
        t.writelines(bufs)
        if t.get_write_buffer_size() > MAX_UNREAD_BYTES:
            why = f"more than {MAX_UNREAD_BYTES} bytes of answers left unread"
            self.daemon.client_error(
                logging.WARNING, "client %d (%s): %s; disconnected", self.id, self.client_name, why
            )
            self._closing = True
            t.abort()  # not close: that would keep the unread bytes until they are sent

    def free_shm(self, names: list[str]) -> None:
        """Hand shared-memory segments back to the client (nothing to say when there are none)."""
        if names:
            self.send(P.notification("shm_free", {"names": names}))

    def close(self) -> None:
        """Close after the bytes still buffered are sent, within ``CLOSE_FLUSH_S``; a client that does not read
        them is cut off then (found in review: a close waited for ever for a peer that never read, and its
        connection kept its slot and its unread answers)."""
        self._closing = True
        self._grantor_gone()  # it grants nothing more: a step waiting for it runs unheld now
        if self._timer is not None:
            self._timer.cancel()
        t = self.transport
        if t is not None and not t.is_closing():
            t.close()
            if t.get_write_buffer_size():
                asyncio.get_running_loop().call_later(CLOSE_FLUSH_S, self._cut_off, t)

    def _cut_off(self, t: asyncio.Transport) -> None:
        if not self.closed.done():  # still not lost: the peer reads nothing
            t.abort()

    def take_spill(self, sid: Any) -> Incoming:
        """Remove and return open spill ``sid`` (for its commit); the error that says why there is none."""
        sp = self.spills.pop(sid, None) if type(sid) is int else None
        if sp is None:
            raise self.expired.pop(sid, None) or P.BadParams(f"no open spill {sid!r} on this connection")
        return sp

    def expire(self, sid: int, why: errors.SpillError) -> None:
        """The daemon aborts open spill ``sid``; its commit will answer ``why``."""
        sp = self.spills.pop(sid)
        self.fail_spill(sid, sp, why)
        self.expired[sid] = why
        while len(self.expired) > MAX_EXPIRED_KEPT:
            del self.expired[next(iter(self.expired))]

    def _admit_msg(self, size: int) -> None:
        held = self.daemon.ingest.hold_message(size)
        if held and not self.hello:  # a hello is small: nothing is held for a client not yet known
            self.daemon.ingest.release(held)
            raise P.ProtocolError(f"a message of {size} bytes before the hello")
        self._held_msg = held
        if held:  # counted against the budget: it must arrive whole within the request timeout
            self._msg_by = asyncio.get_running_loop().time() + self.daemon.cfg.request_timeout

    def _admit_payload(self, raw: Any, size: int) -> bool:
        """Only a ``put`` for an open spill of this connection, at the next offset of one of its tensors and
        within it, gets a buffer: those bytes were counted when the spill was admitted. Others are thrown away."""
        if not (isinstance(raw, list) and len(raw) == 3 and raw[:2] == [P.NOTIFICATION, "put"]):
            return False
        p = raw[2] if isinstance(raw[2], dict) else {}
        sid, index, offset = p.get("spill"), p.get("index"), p.get("offset")
        sp = self.spills.get(sid) if type(sid) is int else None
        if sp is None or sp.error is not None or type(index) is not int or type(offset) is not int:
            return False
        if not sp.next_within(index, offset, size):
            return False
        sp.filling, self._filling = True, sp  # counted as the spill's until the frame ends, whatever ends the spill
        allowed = self.daemon.cfg.request_timeout + size / MIN_SPILL_BYTES_PER_S
        self._payload_by = asyncio.get_running_loop().time() + allowed
        return True

    def _filled(self) -> None:
        """The payload being read has ended (its frame, or the connection): a spill that ended meanwhile is let go."""
        sp, self._filling, self._payload_by = self._filling, None, None
        if sp is not None:
            sp.filling = False
            if sp.forget_when_filled:
                self.daemon.ingest.forget(sp)

    def _dispatch(self, msg: P.Message) -> None:
        self._filled()  # (a payload is the end of its frame: the message dispatched now is that put)
        held, self._held_msg = self._held_msg, 0
        task = None
        try:
            task = self._route(msg, held)
        finally:
            if task is None:  # else the request's task releases it (see _call)
                self.daemon.ingest.release(held)

    def _route(self, msg: P.Message, held: int) -> asyncio.Task[None] | None:
        if msg.kind == P.REQUEST and msg.method == "hello":
            self._on_hello(msg)
            return None
        if not self.hello:
            first = P.ProtocolError("the first message must be a hello request")
            self._fail(first, msg.msgid if msg.kind == P.REQUEST else None)
            return None
        if msg.discarded and not (msg.kind == P.NOTIFICATION and msg.method == "put"):
            raise P.ProtocolError(f"a payload on a message other than put ({msg.method or 'a response'})")
        if msg.kind == P.NOTIFICATION:
            if msg.method in ("put", "put_shm"):
                self._put(msg)
            elif msg.method == "shm_pool":
                self._own_pool(msg.params)
            else:  # like an unknown request, it does not end the connection; it has no answer to carry an error
                log.debug("client %d: unknown notification %r ignored", self.id, msg.method)
        elif msg.kind == P.REQUEST:
            # a task is done once its answer is sent; its done callback (which drops it) runs a loop turn later
            if sum(not t.done() for t in self.tasks) >= P.MAX_INFLIGHT_REQUESTS:
                raise P.ProtocolError(f"more than {P.MAX_INFLIGHT_REQUESTS} requests in flight")
            handler = self.daemon.methods.get(msg.method)
            if handler is None:
                self._respond(msg.msgid, error=P.UnknownMethod(f"unknown method {msg.method!r}"))
                return None
            if held and msg.method not in BIG_PARAMS_METHODS:  # a drain or commit would keep it, uncounted
                too_big = P.BadParams(f"{msg.method}: only spill and lookup take params this large")
                self._respond(msg.msgid, error=too_big)
                return None
            looking = 0  # a lookup holds its tokens until answered, however long it waits for a thread
            try:
                if msg.method == "spill" and not held:  # a big one is counted from its frame head
                    held = self.daemon.ingest.hold_spill_message(msg.size)
                elif msg.method == "lookup":
                    looking = self.daemon.looking.take(lookup_bytes(msg.size), self.lookup_client)
            except errors.SpillError as exc:  # (a big message's frame-head count: released by _dispatch)
                self._respond(msg.msgid, error=exc)
                return None
            hold = [held]  # released once: when the handler starts, or when the task ends if it never started
            call = self._call(handler, msg.method, msg.msgid, msg.params, hold)
            task = asyncio.get_running_loop().create_task(call, name=msg.method)
            task.add_done_callback(lambda _: self._release(hold))
            if looking:
                task.add_done_callback(lambda _: self.daemon.looking.give(looking, self.lookup_client))
            self.tasks.add(task)
            task.add_done_callback(self._task_done)
            return task
        else:  # an answer to a request of ours (a lease grant)
            # parsed before its wait is taken: a malformed answer closes the connection, whose close then settles
            # that wait as a grantor gone (found in review: the writer waited out --request-timeout)
            refused = None if msg.error is None else lease_refused(msg.error)
            fut = self.asked.pop(msg.msgid, None)
            if fut is not None and not fut.done():
                fut.set_result(refused)
            elif refused is None:  # granted after we stopped waiting: let the engine go at once
                self.lease_done(msg.msgid)
        return None

    def _release(self, hold: list[int]) -> None:
        self.daemon.ingest.release(hold[0])
        hold[0] = 0

    def release_message(self) -> None:
        """The message of the request being handled (this task's) is no longer held: a spill's handler has counted
        the header it parsed from it."""
        if (hold := _MESSAGE_HOLD.get()) is not None:
            self._release(hold)

    async def _call(self, handler: Any, method: str, msgid: int, raw: dict[str, Any], hold: list[int]) -> None:
        # A big message stays counted until its handler starts; a spill's until it has counted what it keeps (its
        # parsed header, made off the loop: ``release_message``), so it is counted twice for a moment, never not.
        _MESSAGE_HOLD.set(hold)  # (this task's own context: requests handled at once never share it)
        if method != "spill":
            self._release(hold)
        try:
            params = check_params(method, raw)
            del raw  # the handler (a drain may wait long) keeps its checked params only, never what came with them
            result = await handler(self, params, msgid)
        except errors.SpillError as exc:
            self._respond(msgid, error=exc)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:  # params of the wrong shape
            self._respond(msgid, error=bad_params(method, exc))
        except Exception:  # a bug must not take the daemon down
            log.exception("client %d: %s failed", self.id, method)
            self._respond(msgid, error=errors.SpillError(f"internal error in {method}; see the daemon's log"))
        else:
            self._respond(msgid, result)

    def _respond(self, msgid: int, result: Any = None, error: errors.SpillError | None = None) -> None:
        self.send(P.response(msgid, result, error))

    def _on_hello(self, msg: P.Message) -> None:
        """The first hello is answered (or refused, as its response, then the connection closes); a second one is
        refused with ``duplicate_hello`` and changes nothing."""
        if self.hello:
            self._respond(msg.msgid, error=P.DuplicateHello("this connection already said hello"))
            return
        try:
            result = self._hello(msg.params)
        except errors.SpillError as exc:
            self._fail(exc, msg.msgid)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            self._fail(bad_params("hello", exc), msg.msgid)
        else:
            self._respond(msg.msgid, result)

    def _hello(self, params: dict[str, Any]) -> dict[str, Any]:
        version = params.get("version")
        if type(version) is not int or version != P.PROTOCOL_VERSION:
            shown = version if isinstance(version, int | str) else type(version).__name__
            raise P.UnsupportedProtocol(f"protocol version {shown}; this daemon speaks {P.PROTOCOL_VERSION}")
        params = check_params("hello", params)
        self.hello = True
        # printable only: a name goes into log lines, and a newline in it could forge a second one (found in review)
        self.client_name = "".join(c if c.isprintable() else "?" for c in params.get("client", "?")[:64])
        self.lease_grantor = params.get("lease_grantor", False)
        # the client's across its reconnections (a cancel drops the spills it sent on any of them); else this one's
        self.session = params.get("session") or f"connection {self.id}"
        known = self.daemon.client_names.get(self.client_name) is not None
        self.daemon.client_names.put(self.client_name, True)
        # a new name is said at info, at most CLIENT_ERROR_LOGS_PER_S a second: a client connecting in a loop under
        # new names (a process's default name is its pid) must not fill the disk with our logs (found in review)
        said = not known and self.daemon.connect_log.allow()
        log.log(
            logging.INFO if said else logging.DEBUG, "client %d connected: %s", self.id, self.client_name,
            extra={"client": self.id, "client_name": self.client_name, "pid": params.get("pid"), "grantor": self.lease_grantor},
        )  # fmt: skip
        return {
            "version": P.PROTOCOL_VERSION,
            "server": f"spilld {__version__}",
            "pid": os.getpid(),
            "limits": self.daemon.limits(),
            "shm": True,
            "dir": self.daemon.cfg.dir,
            "remote": bool(self.daemon.cfg.remote),  # a lookup may fill from the shared tier before it answers
            "io_timeout": self.daemon.cfg.io_timeout,  # the bound of a restore's read, which the client makes
        }

    def _put(self, msg: P.Message) -> None:
        p = msg.params
        sp = self.spills.get(p.get("spill")) if type(p.get("spill")) is int else None
        name = p["shm"][:64] if msg.method == "put_shm" and isinstance(p.get("shm"), str) else ""
        if sp is None or sp.error is not None:
            self.free_shm([name] if name else [])  # never keep a segment we will not read
            if sp is None:  # (a spill that failed already said so once)
                why = self.expired.get(p.get("spill")) if type(p.get("spill")) is int else None
                self.fail_spill(p.get("spill"), None, why or P.BadParams(f"no open spill {p.get('spill')!r}"))
            return
        try:
            p = check_params(msg.method, p)
            index, offset = p["index"], p["offset"]
            if msg.method == "put_shm":
                self._put_shm(p["spill"], sp, (index, offset), p["shm"], p["length"])
                return
            if not msg.payload and not msg.discarded:
                raise P.BadParams("empty put")
            if msg.discarded:  # refused before a buffer was made: the same check, said the same way
                sp.claim(index, offset, msg.discarded)
                raise P.BadParams(f"put of {msg.discarded} bytes refused")
            sp.put(index, offset, msg.payload)
        except errors.SpillError as exc:
            self.fail_spill(p["spill"], sp, exc)
            self.free_shm([name] if name else [])
        except (KeyError, TypeError, ValueError, ArithmeticError) as exc:
            self.fail_spill(p["spill"], sp, bad_params(msg.method, exc))
            self.free_shm([name] if name else [])

    def _own_pool(self, p: dict[str, Any]) -> None:
        """The client hands over its segments (``shm_pool``): only they may be named in its put_shms from now on, and
        they are unlinked when this connection ends. Names that are not a pool's are ignored (a notification has no
        answer to refuse them with), as are those past the bound and those another connection owns."""
        self.pooled = True
        names = p.get("names")
        for name in names[:MAX_POOL_SEGMENTS] if isinstance(names, list) else []:
            if isinstance(name, str) and shm.NAME.fullmatch(name) and self._own(name):
                self.segments.add(name)

    def _own(self, name: str) -> bool:
        """Whether segment ``name`` is this connection's: it is already, or it is nobody's and is now (within
        ``MAX_POOL_SEGMENTS``)."""
        owner = self.daemon.shm_owners.get(name)
        if owner is None and len(self.owned) < MAX_POOL_SEGMENTS:
            owner = self.daemon.shm_owners[name] = self
            self.owned.add(name)
        return owner is self

    def _check_owned(self, name: str) -> None:
        """Refuse a segment that is not this connection's: another connection's, or, once this one handed its pool
        over, one outside it. A client that hands none over (it predates ``shm_pool``) owns each name it is the
        first to use, until its connection ends."""
        owner = self.daemon.shm_owners.get(name)
        if owner is self:
            return
        if owner is not None:
            raise shm.ShmRefused(f"segment {name} is another connection's: a client may name only its own segments")
        if self.pooled:
            raise shm.ShmRefused(f"segment {name} is not in the pool this connection handed over (shm_pool)")
        if not self._own(name):
            raise shm.ShmRefused(f"more than {MAX_POOL_SEGMENTS} segments named on one connection")

    def _put_shm(self, sid: int, sp: Incoming, at: tuple[int, int], name: str, length: int) -> None:
        """Copy ``length`` bytes of a client's segment into a buffer of the spill, on a worker thread; the
        segment goes back to the client once read, whatever the outcome."""
        shm.check_name(name)
        self._check_owned(name)
        if length <= 0:
            raise P.BadParams("empty put")
        index, offset = at
        sp.claim(index, offset, length)  # before allocating: only bytes the spill declared (and was admitted for)
        sp.check_shm_length(index, offset, length)
        buf = np.empty(length, np.uint8).data  # not zeroed: the copy fills every byte
        sp.chunks[index].append(buf)
        # releasing: no mlx runs in the daemon, but every hand-off to a pool goes through it (tests/test_mlxthreads.py)
        fut = asyncio.get_running_loop().run_in_executor(
            shm.reader_pool(), mlxthreads.releasing(lambda: shm.read_segment(name, buf))
        )
        sp.reads.add(fut)
        self._copies.add(fut)

        def done(f: asyncio.Future[None]) -> None:
            sp.reads.discard(f)
            self._copies.discard(f)
            self.free_shm([name])
            exc = f.exception()
            if exc is not None:
                why = exc if isinstance(exc, errors.SpillError) else shm.ShmRefused(f"segment {name}: {exc}")
                self.fail_spill(sid, sp, why)

        fut.add_done_callback(done)


@dataclass(eq=False)
class Received:
    """A committed spill as the daemon's queue holds it (``SpillItem.payload``)."""

    header: fmt.Header
    chunks: list[list[bytes | bytearray | memoryview]]  # each tensor's bytes, as received
    nbytes: int  # what it counts against --cap
    grantor: Connection | None  # the client whose engine grants the lease for its write steps, if any
    conn: Connection  # the client that sent it (for the logs)
    held_rows: int = 0  # its positional tensors start at this row: the store held the blocks before it

    def sources(self) -> list[BytesSource]:
        """Each tensor's received bytes as a source; positional ones start at ``held_rows``."""
        cut = blocks.after_held(self.header, self.held_rows)
        return [BytesSource(c, s.shape, start) for c, (s, start) in zip(self.chunks, cut, strict=True)]


def lease_refused(error: dict[str, Any]) -> errors.LeaseRefused:
    """A grantor's error answer, its code and message quoted (cut to ``P.MAX_ERROR_MESSAGE``), never rebuilt as
    the error it names: a client's ``disk_full`` would make the store evict everyone's entries. A map without
    them raises ``KeyError`` (a malformed answer: the connection closes)."""
    code, message = error["code"], error["message"]
    return errors.LeaseRefused(f"the engine's lease failed: {str(code)[:64]}: {message}"[: P.MAX_ERROR_MESSAGE])


def received_bytes(item: SpillItem) -> int:
    """What an item counts against the daemon's cap (a barrier: nothing)."""
    return item.payload.nbytes if isinstance(item.payload, Received) else 0


def sent_by(item: SpillItem, conn: Connection) -> bool:
    """Whether ``item`` is a spill the client on ``conn`` sent (on that connection, or on an earlier one of its
    session: found in review, a cancel after a reconnection dropped none of the client's own)."""
    return isinstance(item.payload, Received) and item.payload.conn.session == conn.session


def bad_params(method: str, exc: Exception) -> P.BadParams:
    """Params of the wrong shape, said in words (a missing key, a wrong type), never as a Python repr."""
    what = f"missing {exc}" if isinstance(exc, KeyError) else str(exc)
    return P.BadParams(f"{method}: bad params: {what}"[: P.MAX_ERROR_MESSAGE])


class GrantorLease:
    """A lease granted by a client's engine: before each step the daemon asks; the engine answers between two
    of its decode steps and holds its lease until the daemon says the step is done. A grant that does not come
    within the timeout fails the step (never run unheld); a grantor that is gone has no engine to keep out. A step
    no thread has begun within the timeout (hung writes hold every one) fails too (``StorageTimeout``), and is never
    run later: found in review, the saver's deadline counts from a granted step's start, so it waited for ever."""

    def __init__(self, conn: Connection, timeout: float) -> None:
        self.conn, self.timeout = conn, timeout

    async def __call__(self, fn: Any, /) -> Any:
        grant = await self.conn.ask_lease(self.timeout)
        work = Droppable(fn)
        # granted: the engine waits, so never behind background work; no grantor: no engine to keep out
        step = asyncio.ensure_future(off_loop(work, held=grant is not None, background=grant is None))
        try:
            done, _ = await asyncio.wait([step], timeout=self.timeout)
        except asyncio.CancelledError:
            if grant is not None:
                self.conn.lease_done(grant)
            if not work.drop():
                await asyncio.wait([step])
            raise
        finally:
            step.add_done_callback(lambda t: t.cancelled() or t.exception())  # (a dropped step's error: retrieved)
        # The engine decodes again after the grant's timeout whatever the step does: a step held up by a hung
        # disk goes on unheld (it is no decode's competitor while it waits), it never holds the engine.
        if grant is not None:
            self.conn.lease_done(grant)
        if not done and work.drop():
            raise errors.StorageTimeout(
                f"no writer thread began a write step within {self.timeout:g} s: hung writes hold them all (the disk "
                "is hung or failing)"
            )
        if not done:
            log.warning(
                "client %d: a write step outlasted its %g s grant; the engine goes on", self.conn.id, self.timeout
            )
        return await step


class BackgroundLease:
    """No engine to keep out: each step on a low-priority thread."""

    waits_for_grant = False  # a step's deadline counts from when it is asked for (``saver.drive``)

    def __call__(self, fn: Any, /) -> Any:
        return off_loop(fn, background=True)


class StepLog:
    """Logs the span of each write step (CLOCK_MONOTONIC, at debug level): when it ran against engine steps."""

    def __init__(self, lease: Any, client: str) -> None:
        self.lease, self.client = lease, client.replace(" ", "_")
        self.waits_for_grant = waits_for_grant(lease)

    def __call__(self, fn: Any, /) -> Any:
        def timed() -> Any:
            t0 = time.monotonic()
            try:
                return fn()
            finally:
                log.debug("write step for %s: %.6f-%.6f", self.client, t0, time.monotonic())

        return self.lease(timed)
