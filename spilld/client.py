"""What an engine imports to talk to the daemon.

    async with AsyncClient(identity=spilld.model_identity(model, tokenizer), lease=ThreadLockLease(lock)) as client:
        client.spill(tokens, cache)                 # clones now; ships one tensor per loop turn, in the lease
        loaded = await client.load(new_tokens)      # the engine reads the file itself; None on a miss

``await AsyncClient.open(...)`` connects without ``async with``. ``Client`` is the same API (``spilld.api``) for
engines that decode in a thread of their own.
A lost connection fails every waiting call with ``ConnectionLost``; the next
call reconnects.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import itertools
import logging
import os
import secrets
import threading
import time
import weakref
from collections.abc import Callable, Coroutine, Iterator, Sequence
from typing import Any, TypeVar

from . import blocks, errors, fileio
from . import format as fmt
from . import protocol as P
from .api import Deadline, Hit
from .assemble import beside
from .bytecopy import copy_into
from .codecs import CodecProvider, default_provider
from .config import DEFAULT_IO_TIMEOUT_S, MAX_DURATION_S, default_socket
from .entries import Miss, MissReason, check_namespace, checkpoint_namespace
from .lease import NoLease, RunStep, off_loop, within
from .loader import Loaded, load
from .loopthread import STOP_TASKS_TIMEOUT_S, LoopThread
from .peer import refuse_foreign
from .queue import (
    CLOSE_STOP_MIN_S,
    CLOSE_STOP_S,
    DEFAULT_QUEUE_CAP,
    DrainReport,
    Outcome,
    Settled,
    SpillItem,
    SpillQueue,
    matching,
    of_generation,
)
from .saver import (
    LIVE_CHUNK_BYTES,
    AnySource,
    Attachment,
    SaveResult,
    Staging,
    TensorBytes,
    token_ids_now,
    token_list,
)
from .shm import ShmPool
from .snapshot import (
    AnyFuture,
    Handoffs,
    item_bytes,
    new_item,
    on_loop,
    planned,
    settle_closed,
    snapshot_of,
    threadsafe,
)

log = logging.getLogger("spilld.client")
T = TypeVar("T")

MAX_INFLIGHT_COMMITS = 8  # items shipped and awaiting the daemon's durable answer
BUSY_RETRIES = 50
BUSY_BACKOFF_S = 0.05
LEASE_HOLD_MAX_S = 30.0  # the longest a grant holds the engine's lease, whatever the daemon asks
CLOSE_REASON_WAIT_S = 1.0  # a failed write waits this long for the daemon's reason to arrive
ANSWER_GRACE_S = 1.0  # a drain waits this long past its deadline for the daemon's answer to travel back
ABORT_SEND_S = 1.0  # a spill that failed while shipping tells the daemon to drop it, if that takes no longer
CLOSE_FLUSH_S = 1.0  # a closing connection's unsent bytes get this long to leave, then the socket is dropped
# An engine waits on these two (its first request, and each prompt's lookup), so a hung daemon must cost it
# little: a healthy one answers both in milliseconds.
CONNECT_TIMEOUT_S = 5.0  # connecting and the hello's answer
LOOKUP_TIMEOUT_S = 2.0  # a lookup's answer (a restore's read of the files is not bounded by it)


class AsyncClient:
    """An asyncio connection to the daemon plus a bounded local queue of clones to ship."""

    def __init__(
        self,
        socket_path: str | None = None,
        *,
        identity: fmt.Identity,
        name: str = "",
        lease: RunStep | None = None,
        queue_cap: int = DEFAULT_QUEUE_CAP,
        provider: CodecProvider | None = None,
        timeout: float = 30.0,
        grant_lease: bool = False,
        shm: bool = True,
    ) -> None:
        self.socket_path = socket_path or default_socket()
        self.identity = identity
        self.name = name or f"pid {os.getpid()}"
        self.lease: RunStep = lease or NoLease()
        self.provider = provider or default_provider()
        self.timeout = timeout
        self.queue = SpillQueue(
            queue_cap, self._ship, bytes_of=lambda it: item_bytes(it, self.provider), done=Outcome.SHIPPED
        )
        self._staging = Staging()
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._pending: dict[int, asyncio.Future[Any]] = {}
        self._progress: dict[int, Callable[[dict[str, Any]], None]] = {}
        self._ids = itertools.count(1)
        self._read_task: asyncio.Task[None] | None = None
        self._connect_lock = asyncio.Lock()
        self._send_lock = asyncio.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handoffs = Handoffs()  # spill_threadsafe's futures (watched once a loop is bound: ``_ensure``)
        self._commits: set[asyncio.Future[Any]] = set()
        self._grants: set[asyncio.Task[None]] = set()
        self._holds: dict[int, threading.Event] = {}  # grants being held, until the daemon's lease_done
        self.grant_lease = grant_lease
        self.use_shm = shm
        self._pool: ShmPool | None = None
        self._pool_made: asyncio.Future[ShmPool] | None = None  # the pool being made, off the loop
        self._pool_maker: _PoolMaker | None = None  # what makes it (and closes it, if dropped before it is made)
        self.server: dict[str, Any] = {}
        self._told: errors.SpillError | None = None  # the error the daemon sent before it closed
        self._open: set[asyncio.Future[Settled]] = set()  # callers' futures the daemon has yet to answer
        # each spill's future (settled with the daemon's answer to its commit) by its item: kept here, not in the
        # item's snapshot, which goes once the item is shipped, long before that answer a later spill may lean on
        self._outcomes: weakref.WeakKeyDictionary[SpillItem, asyncio.Future[Settled]] = weakref.WeakKeyDictionary()
        self._watching: list[_Verdicts] = []  # a drain's or a close's: the daemon's answers to the items it waits for
        self._closed = False  # close has run: no call connects again
        self._close_report: DrainReport | None = None  # the first close's, which a second one gives
        self._session = secrets.token_hex(16)  # names this client to the daemon across its reconnections

    @classmethod
    async def open(cls, socket_path: str | None = None, **kwargs: Any) -> AsyncClient:
        """Connect to the daemon (``ConnectionLost`` if none answers); ``async with AsyncClient(...)`` does the same."""
        client = cls(socket_path, **kwargs)
        await client._ensure()
        return client

    async def __aenter__(self) -> AsyncClient:
        await self._ensure()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- connection ----------------------------------------------------------------------

    async def _ensure(self) -> None:
        if self._closed:
            raise errors.Closed("this client is closed")
        async with self._connect_lock:
            if self._writer is not None and not self._writer.is_closing():
                return
            await self._old_reader_gone()
            if (loop := asyncio.get_running_loop()) is not self._loop:
                self._loop = loop
                self._handoffs = Handoffs.watching(loop)  # spill_threadsafe's, settled if the loop ends first
            self._told = None
            limit = min(self.timeout, CONNECT_TIMEOUT_S)
            try:
                self._reader, self._writer = await asyncio.wait_for(
                    asyncio.open_unix_connection(self.socket_path, limit=4 * 1024 * 1024), limit
                )
            except (OSError, TimeoutError) as exc:
                raise P.ConnectionLost(f"cannot reach spilld at {self.socket_path}: {exc}") from exc
            self._check_peer()  # before a single byte goes out
            self._read_task = asyncio.get_running_loop().create_task(self._read_loop())
            hello = {"version": P.PROTOCOL_VERSION, "client": self.name, "pid": os.getpid(), "session": self._session}
            try:
                self.server = await self._hello(hello, limit)
            except BaseException:  # refused, timed out or cancelled: nothing of this connection is left open
                await self._disconnect()
                raise

    async def _hello(self, hello: dict[str, Any], limit: float) -> dict[str, Any]:
        """The daemon's answer to the hello; ``NotADaemon`` for an answer that breaks the protocol, as the command
        line says it (found in review: an HTTP server's reply was "message of 1347703880 bytes")."""
        try:
            server = await self._call("hello", hello | {"lease_grantor": self.grant_lease}, timeout=limit)
        except errors.ProtocolError as exc:
            raise P.not_a_daemon(self.socket_path, exc) from None
        return P.hello_answer(server, self.socket_path)

    async def _old_reader_gone(self) -> None:
        """Let a lost connection's reader end before a new connection is made: its last act fails the calls and
        closes the writer it finds, which must be its own connection's, never the next one's."""
        task = self._read_task
        if task is None or task.done():
            return
        await asyncio.wait([task], timeout=CLOSE_REASON_WAIT_S)  # it may still read the daemon's last words
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    def _check_peer(self) -> None:
        """Refuse a daemon that runs as another user: our caches are not theirs to receive."""
        assert self._writer is not None
        sock = self._writer.get_extra_info("socket")
        if sock is None:
            return
        try:
            refuse_foreign(sock, self.socket_path)
        except errors.ForeignDaemon:
            self._writer.close()
            self._writer = None
            raise

    async def _read_loop(self) -> None:
        decoder = P.FrameDecoder()
        assert self._reader is not None
        err: errors.SpillError = P.ConnectionLost("the daemon closed the connection")
        try:
            while data := await self._reader.read(1 << 20):
                for msg in decoder.feed(data):
                    self._on_message(msg)
        except (OSError, errors.SpillError) as exc:
            err = exc if isinstance(exc, errors.SpillError) else P.ConnectionLost(str(exc))
        finally:
            # A daemon that closes with a reason (busy, peer_refused, ...) sent it first: waiting calls get that.
            self._fail_all(self._told or err)

    def _on_message(self, msg: P.Message) -> None:
        if msg.kind == P.RESPONSE:
            fut = self._pending.pop(msg.msgid, None)
            if fut is not None and not fut.done():
                if msg.error is not None:
                    try:
                        P.raise_for(msg.error)
                    except errors.SpillError as exc:
                        fut.set_exception(exc)
                else:
                    fut.set_result(msg.result)
        elif msg.kind == P.REQUEST and msg.method == "lease":
            hold_s = min(float(msg.params.get("hold_s", LEASE_HOLD_MAX_S)), LEASE_HOLD_MAX_S)
            task = asyncio.get_running_loop().create_task(self._grant(msg.msgid, hold_s))
            self._grants.add(task)
            task.add_done_callback(self._grants.discard)
        elif msg.kind == P.NOTIFICATION:
            if msg.method == "lease_done" and (held := self._holds.get(int(msg.params.get("lease", 0)))):
                held.set()
            elif msg.method == "drain_progress" and (cb := self._progress.get(int(msg.params.get("msgid", 0)))):
                cb(msg.params)
            elif msg.method == "shm_free" and self._pool is not None:
                for name in msg.params.get("names", []):
                    self._pool.give(str(name))
            elif msg.method == "error":
                code, message = str(msg.params.get("code", "error")), str(msg.params.get("message", ""))
                self._told = errors.error_from_code(code, message)
                log.warning("daemon: %s", message)

    async def _grant(self, msgid: int, hold_s: float) -> None:
        """The daemon asks for a turn: take our engine's lease, answer while holding it, and hold it until the
        daemon says its step is done (``lease_done``), the connection is lost, or ``hold_s`` has passed."""
        done = threading.Event()
        self._holds[msgid] = done
        loop = asyncio.get_running_loop()

        loop_thread = threading.get_ident()

        def hold() -> bool:
            if threading.get_ident() == loop_thread:  # blocking here would stop the loop that hears lease_done
                raise errors.SpillError("a lease grantor's lease must run its steps off the event loop's thread")
            loop.call_soon_threadsafe(self._answer, msgid, {"granted": True})
            return done.wait(hold_s)

        try:
            if not await self.lease(hold):
                log.warning(
                    "lease %d: the daemon's step outlasted %.1f s; the engine's lease was let go", msgid, hold_s
                )
        except Exception as exc:  # the engine's lease failed: the daemon must not write
            self._answer(msgid, None, exc if isinstance(exc, errors.SpillError) else errors.SpillError(repr(exc)))
        finally:
            self._holds.pop(msgid, None)

    def _answer(self, msgid: int, result: Any, error: errors.SpillError | None = None) -> None:
        """Send an answer to one of the daemon's requests; a lost connection has already ended the ask."""
        if self._writer is None or self._writer.is_closing():
            return
        write_each(self._writer, P.response(msgid, result, error))

    def _fail_all(self, err: errors.SpillError) -> None:
        # The daemon may still be writing from our segments: never reuse them; a new pool comes with the next connection.
        self._drop_pool()
        for held in list(self._holds.values()):
            held.set()  # the daemon is gone: it writes nothing more of ours in our engine's turn
        pending, self._pending = self._pending, {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(err)
        if self._writer is not None:
            self._writer.close()

    async def _send(self, bufs: list[bytes | memoryview], wrote: Callable[[], None] | None = None) -> None:
        """Write ``bufs`` (after the sends before it) and wait for room in the socket; ``wrote`` is told once they
        are in the transport, which sends them even if this call is cancelled while it waits for room."""
        if self._writer is None or self._writer.is_closing():
            raise await self._why_closed(P.ConnectionLost("not connected"))
        async with self._send_lock:
            write_each(self._writer, bufs)
            if wrote is not None:
                wrote()
            try:
                await self._writer.drain()
            except (OSError, RuntimeError) as exc:
                raise await self._why_closed(P.ConnectionLost(str(exc))) from exc

    async def _why_closed(self, lost: errors.SpillError) -> errors.SpillError:
        """The reason the daemon gave for closing (busy, peer_refused, ...), else ``lost``.

        A write can fail before the reader has seen the daemon's last words: let the reader finish first.
        """
        task = self._read_task
        if self._told is None and task is not None and not task.done() and task is not asyncio.current_task():
            await asyncio.wait([task], timeout=CLOSE_REASON_WAIT_S)
        return self._told or lost

    async def _call(
        self,
        method: str,
        params: dict[str, Any],
        *,
        timeout: float | None = -1.0,
        unsent: Callable[[], None] | None = None,
        late: Callable[[Any], None] | None = None,
        **kw: Any,
    ) -> Any:
        """One request on the connection as it is. Given up on (cancelled, timed out) before its answer: ``unsent``
        runs if it was never written; if it was, ``late`` gets the daemon's answer once that comes (none comes for
        an error, nor once the connection is lost)."""
        msgid = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[msgid] = fut
        if "progress" in kw:
            self._progress[msgid] = kw["progress"]
        sent = answered = False

        def wrote() -> None:
            nonlocal sent
            sent = True

        try:
            # the send too: a daemon that stopped reading leaves it waiting for room in the socket
            async with asyncio.timeout(self.timeout if timeout == -1.0 else timeout):
                await self._send(P.request(msgid, method, params), wrote)
                result = await fut
                answered = True
                return result
        except TimeoutError as exc:
            if isinstance(exc, errors.SpillError):
                raise  # the daemon's own timeout, already typed
            raise P.Timeout(f"{method}: no answer from the daemon") from None
        finally:
            self._pending.pop(msgid, None)
            self._progress.pop(msgid, None)
            if not answered and not sent and unsent is not None:
                unsent()
            elif not answered and sent and late is not None:
                self._answer_later(msgid, fut, late)
            _drop(fut)

    def _answer_later(self, msgid: int, fut: asyncio.Future[Any], late: Callable[[Any], None]) -> None:
        """Request ``msgid`` was written and given up on: ``late`` gets its answer, already in ``fut`` (the caller
        was cancelled as it came) or once it comes. Its wait ends with the connection's (``_fail_all``)."""
        if fut.done() and not fut.cancelled():
            if fut.exception() is None:
                late(fut.result())
            return
        if self._writer is None or self._writer.is_closing():
            return  # lost: no answer will come
        later: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        later.add_done_callback(lambda f: None if f.cancelled() or f.exception() is not None else late(f.result()))
        self._pending[msgid] = later

    async def call(
        self, method: str, params: dict[str, Any] | None = None, *, timeout: float | None = -1.0, **kw: Any
    ) -> Any:
        """One request; reconnects first if the connection was lost, ``timeout`` (default: the client's) bounding
        both (found in review: a drain of 0.2 s that had to reconnect to a hung daemon took the connect's 5 s)."""
        deadline = Deadline(self.timeout if timeout == -1.0 else timeout)
        try:
            async with asyncio.timeout(deadline.left()):
                await self._ensure()
        except TimeoutError as exc:
            if isinstance(exc, errors.SpillError):
                raise  # the hello's own bound, already typed
            raise P.Timeout(f"{method}: the daemon did not answer the reconnection in time") from None
        return await self._call(method, params or {}, timeout=deadline.left(), **kw)

    async def _wait_commits(self, timeout: float | None) -> int:
        """Wait for the daemon's answers to the commits sent; how many are still unanswered."""
        if not self._commits:
            return 0
        _, pending = await asyncio.wait(list(self._commits), timeout=timeout)
        return len(pending)

    async def close(self, timeout: float | None = None) -> DrainReport:
        """Ship what is queued and hear back about it, then close the connection; ``timeout`` bounds the call. A
        second close gives the first one's report."""
        if self._close_report is not None:
            return self._close_report
        deadline = Deadline(timeout)
        try:
            with self._verdicts() as ours:
                local = await self.queue.close(deadline.left())
                unanswered = await self._wait_commits(deadline.left())
            lost = local.not_stored + ours.not_stored  # the daemon's, of the items queued before the close
        finally:  # cancelled too: the shared-memory pool, the socket and the reader go
            self._closed = True
            self._drop_pool()  # (one still being made is closed by the thread making it)
            await self._disconnect(deadline.within(CLOSE_FLUSH_S))  # (found in review: 2 s past the timeout)
        self._close_report = DrainReport(
            local.done and not unanswered, local.pending_items + unanswered, local.pending_bytes, lost
        )
        return self._close_report

    async def _disconnect(self, flush_s: float = CLOSE_FLUSH_S) -> None:
        """Close the connection, its unsent bytes given ``flush_s`` to leave, and wait for its reader to end (it
        fails what still waits for an answer)."""
        writer, task, self._writer, self._read_task = self._writer, self._read_task, None, None
        if writer is not None:
            writer.close()
        if task is not None:
            task.cancel()
        try:
            if writer is not None:
                try:
                    with contextlib.suppress(Exception):
                        async with asyncio.timeout(flush_s):
                            await writer.wait_closed()
                finally:  # cancelled too: what a daemon that stopped reading never took is dropped, with the socket
                    writer.transport.abort()
        finally:
            if task is not None:
                await asyncio.gather(task, return_exceptions=True)

    # --- spilling -----------------------------------------------------------------------

    def spill(
        self,
        tokens: Sequence[int],
        caches: Sequence[Any],
        meta: dict[str, str] | None = None,
        *,
        namespace: str = "",
        key: str = "",
        droppable: bool = True,
        attachments: Sequence[Attachment] = (),
        checkpoint: fmt.GenerationCheckpoint | None = None,
        live: bool = False,
        pin: bool = False,
        behind: AnyFuture | None = None,
    ) -> asyncio.Future[Settled]:
        """Clone now, ship behind; a future of the daemon's outcome (its ``value`` a ``SaveResult``).

        Call it on the event loop's thread; an engine decoding in a thread of its own calls
        ``spill_threadsafe`` (same arguments, a ``concurrent.futures.Future``).

        ``behind``: the future of an earlier droppable spill of the same entry made here (a write-behind). Where that
        one still stands for this spill it is kept in its place, made not droppable if this one is not, and this one
        is held, not written as well, until that one ends: if that one's write fails (or the write gate sheds it as
        it is written), this one is written in its place. Where it no longer can, this one is queued. When each way
        in keeps it: ``spill_threadsafe``. The future is then the one kept's.
        """
        item = new_item(
            self.identity, self.provider, tokens, caches, meta=meta, namespace=namespace, key=key,
            droppable=droppable, attachments=attachments, checkpoint=checkpoint, live=live, pin=pin,
            leased=not isinstance(self.lease, NoLease),
        )  # fmt: skip
        return self._handoffs.hand_over_here(self._bound(), item, behind, self._enqueue, self._keep)

    def spill_threadsafe(
        self,
        tokens: Sequence[int],
        caches: Sequence[Any],
        meta: dict[str, str] | None = None,
        *,
        behind: concurrent.futures.Future[Settled] | None = None,
        **kw: Any,
    ) -> concurrent.futures.Future[Settled]:
        """``spill`` from any thread (the engine's own): clones here, queued and shipped on the loop.

        ``behind``, as in ``Spiller.spill_threadsafe``: the future of a droppable spill of the same entry made here
        earlier. While that one waits in this client's queue, not shipped yet, it is kept in place of this spill
        (made not droppable if this one is not), and this one is held until the daemon answers it: sent in its
        place, next, if its ship fails or the daemon fails it (the writer waits for that answer before it ships
        anything more), let go once it is stored (or shed, a droppable one). Once shipping or shipped it is the
        daemon's, which may still shed it: this one is queued, and sent only if the daemon's answer to that one,
        waited for at its turn, is not stored (``_keep``). Once stored it stands for this one."""
        leased = not isinstance(self.lease, NoLease)
        item = new_item(self.identity, self.provider, tokens, caches, meta=meta, leased=leased, **kw)
        return self._handoffs.hand_over(self._bound(), item, behind, self._enqueue, self._keep)

    def _keep(self, item: SpillItem, prior: SpillItem) -> asyncio.Future[Settled]:
        """``prior`` not shipped yet stands for ``item`` (its future, the daemon's answer); else ``item`` is queued.
        Kept, ``item`` is held on ``prior`` and sent in its place if ``prior``'s write fails after all, which for this
        queue is its ship and the daemon's write of it (``_ship``: a connection lost, a failing disk); that one's
        answer then settles the future. ``prior`` stored already stands for ``item`` too (let go). ``prior`` being
        shipped, or shipped and not answered yet: ``item`` is queued leaning on it, and sent only if the daemon's
        answer to ``prior`` says not stored (``_stood_for``; found in review: it was sent at once, the entry shipped
        twice in full, and the daemon then wrote both)."""
        outcome = self._outcomes.get(prior)
        if outcome is None:
            return self._enqueue(item)
        self._outcomes[item] = outcome  # (sent in prior's place, its answer settles the same future)
        if self.queue.promote(prior, item.droppable, stand_in=item) is not None:
            return outcome
        if outcome.done() and not outcome.cancelled() and outcome.result().stored:
            self.queue.let_go(item)
            return outcome
        # (one answered otherwise, or whose caller cancelled its future, stands for nothing: the wait is none)
        snapshot_of(item).leans_on = outcome
        return self._enqueue(item)

    def _enqueue(self, item: SpillItem) -> asyncio.Future[Settled]:
        """Queue locally; the returned future settles with the daemon's answer to the commit."""
        outcome: asyncio.Future[Settled] = asyncio.get_running_loop().create_future()
        self._outcomes[item] = outcome
        self._open.add(outcome)
        self.queue.enqueue(item).add_done_callback(lambda f: self._unless_shipped(f, outcome))
        return outcome

    def _unless_shipped(self, local: asyncio.Future[Settled], outcome: asyncio.Future[Settled]) -> None:
        """A local item's end settles the caller's future, unless it was shipped: then the daemon's answer will."""
        s = local.result()
        if s.outcome is not Outcome.SHIPPED:
            self._open.discard(outcome)
            if not outcome.done():
                outcome.set_result(s)

    @contextlib.contextmanager
    def _verdicts(self) -> Iterator[_Verdicts]:
        """Count the daemon's not-stored answers to the items queued or shipped so far (found in review: a drain
        also counted those spilled while it ran, which a ``Spiller``'s drain does not)."""
        watch = _Verdicts(set(self._open))
        self._watching.append(watch)
        try:
            yield watch
        finally:
            self._watching.remove(watch)

    def _bound(self) -> asyncio.AbstractEventLoop:
        if self._loop is None:
            raise errors.NotStarted("the client is not started: use 'await AsyncClient.open(...)' or 'async with'")
        return self._loop

    async def _ship(self, item: SpillItem) -> Any:
        """Send one planned item: header, each tensor's bytes (taken inside the lease), then commit.

        Returns once the commit is sent: the next item ships while the daemon writes this one. One that leans on a
        write-behind shipped before it (``_keep``) first waits for the daemon's answer to that one, and is not sent if
        it was stored.
        """
        if await self._stood_for(item):
            return
        header, sources = planned(item)
        await self._ensure()
        await self._room_for_a_commit()
        for attempt in range(BUSY_RETRIES):
            try:
                # "held": the daemon may answer the rows it holds as blocks (those are not sent)
                params = {"header": header.to_wire(), "droppable": item.droppable, "key": item.key, "pin": item.pin}
                started = await self._call("spill", params | {"held": True})
                break
            except P.Busy:
                if attempt == BUSY_RETRIES - 1:
                    raise
                await asyncio.sleep(BUSY_BACKOFF_S * (attempt + 1))
        sid = started["spill"]
        try:
            for i, (slot, src) in enumerate(_unheld(header, sources, started.get("held_rows", 0))):
                tb = TensorBytes(i, slot, src, self._staging)
                try:
                    await tb.take_in_lease(self.lease, LIVE_CHUNK_BYTES)
                    await self._send_tensor(sid, i, tb.runs, tb.borrowed)
                finally:
                    tb.release()
                await asyncio.sleep(0)  # one tensor per loop turn
            commit = await self._start_call("commit", {"spill": sid})
        except BaseException:
            if self._writer is not None and not self._writer.is_closing():
                # bounded: a daemon that stopped reading would hold a cancelled ship (and a close) forever
                with contextlib.suppress(Exception):
                    async with asyncio.timeout(ABORT_SEND_S):
                        await self._send(P.request(next(self._ids), "abort", {"spill": sid}))
            raise
        finally:
            snapshot_of(item).planned = None  # shipped: the sources' references go now
        outcome = self._outcomes[item]  # (set by _enqueue, or _keep, before the item was queued)
        self._commits.add(commit)
        if not self.queue.holds_stand_in(item):
            commit.add_done_callback(lambda f: self._settle(f, outcome, header))
            return
        # a later spill is held on this one (``_keep``): the daemon's answer is waited for here, and one that failed
        # has the queue send that spill in its place, next (``SpillQueue._write_instead``)
        commit.add_done_callback(self._answered)
        await asyncio.wait([commit])
        settled = _commit_settled(commit, header)
        if settled.outcome is Outcome.FAILED:
            raise settled.error or errors.SpillError("the daemon failed the spill")
        self._settle_with(outcome, settled)

    async def _stood_for(self, item: SpillItem) -> bool:
        """Whether the write-behind ``item`` leans on (``_keep``), shipped before it, was stored: then its answer is
        ``item``'s (settled here; the local queue counts ``item`` as shipped, its answer given). Waited for here, at
        ``item``'s turn, so that what was queued after ``item`` (a barrier) still waits for it. A droppable spill sent
        is not a stored one: the daemon's queue or its store (a write budget, the write gate) may still shed it, and
        its write or the connection may fail; then ``item`` is sent."""
        snap = snapshot_of(item)
        prior, snap.leans_on = snap.leans_on, None
        if prior is None:
            return False
        await asyncio.wait([prior])  # (not awaited itself: a cancelled ship must not cancel the caller's future)
        if prior.cancelled() or not prior.result().stored:
            return False
        self._settle_with(self._outcomes[item], prior.result())
        return True

    def _answered(self, commit: asyncio.Future[Any]) -> None:
        """A commit whose answer ``_ship`` waits for (or gave up on: cancelled) is no longer awaited."""
        self._commits.discard(commit)
        _drop(commit)  # (its error read: a connection lost fails it)

    async def _room_for_a_commit(self) -> None:
        """Wait until fewer than ``MAX_INFLIGHT_COMMITS`` requests wait for the daemon's durable answer (commits and
        barriers: the daemon takes ``max_inflight_requests`` at once from a connection)."""
        while len(self._commits) >= MAX_INFLIGHT_COMMITS:
            await asyncio.wait(list(self._commits), return_when=asyncio.FIRST_COMPLETED)

    def _settle(self, commit: asyncio.Future[Any], outcome: asyncio.Future[Settled], header: fmt.Header) -> None:
        self._commits.discard(commit)
        self._settle_with(outcome, _commit_settled(commit, header))

    def _settle_with(self, outcome: asyncio.Future[Settled], settled: Settled) -> None:
        """The daemon's answer settles the caller's future. One not stored counts in ``not_stored`` before anyone
        waiting on it wakes (a drain reads the count next), and even when its caller gave up waiting (cancelled its
        future): found in review, a drain then said done with nothing lost while the daemon had dropped it."""
        self._open.discard(outcome)
        if not settled.stored:
            for watch in self._watching:
                watch.not_stored += outcome in watch.items
        if not outcome.done():
            outcome.set_result(settled)

    async def _start_call(self, method: str, params: dict[str, Any]) -> asyncio.Future[Any]:
        """Send a request; return the future of its answer (no timeout: the caller decides)."""
        msgid = next(self._ids)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._pending[msgid] = fut
        fut.add_done_callback(lambda _: self._pending.pop(msgid, None))
        try:
            await self._send(P.request(msgid, method, params))
        except BaseException:
            _drop(fut)  # nobody will wait for its answer now
            raise
        return fut

    async def _send_tensor(self, sid: int, index: int, runs: list[memoryview], borrowed: bool) -> None:
        """``borrowed``: the runs are a buffer the next tensor reuses (see ``_send_runs_inline``)."""
        if self.use_shm and self.server.get("shm") and (pool := await self._shm_pool()) is not None:
            await self._send_tensor_shm(pool, sid, index, runs, borrowed)
        else:
            await self._send_runs_inline(sid, index, 0, runs, borrowed)

    async def _send_tensor_shm(
        self, pool: ShmPool, sid: int, index: int, runs: list[memoryview], borrowed: bool
    ) -> None:
        """Copy the bytes into pool segments (off the loop) and send their names."""
        offset = 0
        pending = [r for r in runs if r.nbytes]
        while pending:
            got = pool.try_take()
            if got is None:  # every segment is with the daemon: the rest goes inline
                await self._send_runs_inline(sid, index, offset, pending, borrowed)
                return
            name, seg = got
            filled, pending = await off_loop(functools.partial(_fill, seg, pending), background=True)
            params = {"spill": sid, "index": index, "offset": offset, "shm": name, "length": filled}
            await self._send(P.notification("put_shm", params))
            offset += filled

    async def _send_runs_inline(
        self, sid: int, index: int, offset: int, runs: list[memoryview], borrowed: bool
    ) -> None:
        """``runs``, one after another from ``offset`` of the tensor, in ``put`` frames. The transport may keep
        what it is given past ``drain`` (below its high-water mark, uvloop and Python 3.12+ keep the views
        themselves), so ``borrowed`` runs, which the next tensor writes over, are copied first."""
        if borrowed:
            runs = [memoryview(bytes(r)) for r in runs]
        for run in runs:
            await self._send_inline(sid, index, offset, run)
            offset += run.nbytes

    async def _shm_pool(self) -> ShmPool | None:
        """The segment pool, made on first use on a worker thread (its pages reserved: a few hundred ms the
        engine's loop must not wait for); None, and inline from then on, when it cannot be made."""
        if self._pool is None:
            if self._pool_made is None:
                self._pool_maker = _PoolMaker()
                self._pool_made = asyncio.ensure_future(off_loop(self._pool_maker.make, background=True))
            made = self._pool_made
            try:
                pool = await asyncio.shield(made)
            except OSError as exc:
                log.warning("shared memory unavailable (%s): tensors go inline", exc)
                self.use_shm = False
                return None
            if self._pool_made is not made:  # the connection failed meanwhile: that pool is closed, not ours
                return None
            self._pool = pool
            # handed over: the daemon unlinks it once this connection ends, even if this process and its resource
            # tracker die together (killed with their process group); a daemon that predates it ignores this
            await self._send(P.notification("shm_pool", {"names": pool.names}))
        return self._pool

    def _drop_pool(self) -> None:
        """Close the segment pool, and one still being made once it is (by the thread making it: this loop may be
        closed by then)."""
        maker, pool, self._pool_maker, self._pool_made, self._pool = self._pool_maker, self._pool, None, None, None
        if pool is not None:
            pool.close()
        if maker is not None:
            maker.drop()

    async def _send_inline(self, sid: int, index: int, offset: int, run: memoryview) -> None:
        pos = 0
        while pos < run.nbytes:
            chunk = run[pos : pos + P.MAX_PAYLOAD_BYTES]
            await self._send(P.notification("put", {"spill": sid, "index": index, "offset": offset + pos}, chunk))
            pos += chunk.nbytes

    # --- other requests --------------------------------------------------------------------

    async def lookup(self, tokens: Sequence[int], namespace: str = "") -> Hit | Miss:
        """The daemon's longest usable prefix for ``tokens`` (the file is not read)."""
        return (await self._lookup(tokens, namespace))[0]

    async def _lookup(
        self, tokens: Sequence[int], namespace: str, longer_than: int = 0
    ) -> tuple[Hit | Miss, dict[str, str]]:
        """The hit, and the files of its blocks the daemon named (key hex -> path; may be empty). ``longer_than``:
        told to the daemon, which then waits for no read of a hit that short (this client reads none)."""
        await self._connected_within()
        params = {
            "identity": self.identity.to_wire() | {"namespace": check_namespace(namespace)},
            "namespace": namespace,
            "tokens": fmt.encode_tokens(token_list(tokens)),  # (ints that fit u32, else BadParams)
            "codec_provider": self.provider.id,
            **({"longer_than": longer_than} if longer_than > 0 else {}),
        }
        return _hit_of(dict(await self.call("lookup", params, timeout=self._lookup_timeout(), late=self._unread)))

    async def _connected_within(self) -> None:
        """Connect if need be: a connection another call is making (its hello bounded by CONNECT_TIMEOUT_S) is
        waited for so long only; the hello says how long a lookup may take."""
        try:
            async with asyncio.timeout(CONNECT_TIMEOUT_S if self._writer is None else LOOKUP_TIMEOUT_S):
                await self._ensure()
        except TimeoutError:
            raise P.Timeout("lookup: no connection to the daemon within its bound") from None

    def _lookup_timeout(self) -> float:
        """A lookup is an index probe, answered in milliseconds, unless the daemon fills it from a shared tier first
        (its hello says ``remote``): then it may take seconds, and the full timeout applies."""
        return self.timeout if self.server.get("remote") is True else min(self.timeout, LOOKUP_TIMEOUT_S)

    async def load(self, tokens: Sequence[int], namespace: str = "", *, longer_than: int = 0) -> Loaded | None:
        """Look up and read the longest usable prefix. A file gone since the lookup, or bad, is a miss; a read
        that passes its deadline (a hung disk) raises ``StorageTimeout``, as a lookup the daemon does not answer
        raises ``Timeout``.

        ``longer_than``: a prefix of at most this many tokens is not worth reading (the engine has as much in
        memory): None, and the daemon does not count it as a hit."""
        t0 = time.perf_counter()
        found, named = await self._lookup(tokens, namespace, longer_than)
        if isinstance(found, Miss) or found.matched <= longer_than:
            return None
        return await self._restore(found, named, dataclasses.replace(self.identity, namespace=namespace), t0)

    def _read_timeout(self) -> float:
        """The daemon's ``--io-timeout`` (its hello says it), else the default: a restore read here has the bound
        the daemon's own reads have (found in review: always the default's 30 s)."""
        t = self.server.get("io_timeout")
        if isinstance(t, int | float) and not isinstance(t, bool) and 0 < t <= MAX_DURATION_S:
            return float(t)
        return DEFAULT_IO_TIMEOUT_S

    async def _restore(self, found: Hit, named: dict[str, str], ident: fmt.Identity, t0: float) -> Loaded | None:
        """Read a hit's files here (the daemon told where), cut to its match; a bad file is reported, a miss."""
        path, matched, only = found.path, found.matched, found.blocks_only
        # the daemon's index names the blocks (a folder of many files is not listed); any it did not: listed
        fallback = beside(path)
        resolve = (lambda key: named.get(key.hex()) or fallback(key)) if named else None
        try:  # a read a hung disk holds is left to its thread: the engine gets a miss at the deadline
            loaded = await within(
                off_loop(
                    lambda: load(
                        path,
                        expect=ident,
                        upto=matched,
                        provider=self.provider,
                        blocks_only=only,
                        blocks=resolve,
                        ops=fileio.OWN_OPS,  # the store's own files: a link put in place of one is never read
                    )
                ),
                self._read_timeout(),
                "a restore's read",
            )
        except errors.FileFormatError as exc:
            try:  # the daemon moves the bad file aside; the engine's miss does not wait on that
                bad = {"path": path, "code": exc.code, "file": exc.path or path}
                unsent = functools.partial(self._tell, "report_bad", bad)
                await self.call("report_bad", bad, timeout=LOOKUP_TIMEOUT_S, unsent=unsent)
            except errors.SpillError as why:
                log.debug("a bad file's report was not answered: %s", why)
            return None
        except asyncio.CancelledError:  # the engine gave up on it; ``within`` let its thread end first
            self._read_ended(path)
            raise
        except errors.StorageTimeout:
            raise  # a hung disk: said, so that the caller can stop asking for a while (each ask would wait as long)
        except errors.SpillError as exc:  # evicted between lookup and open, or a file this model cannot use
            try:  # the daemon's background reads wait for this read no more (an older daemon: unknown_method)
                failed = {"path": path, "file": exc.path or path}
                unsent = functools.partial(self._tell, "read_failed", failed)
                await self.call("read_failed", failed, timeout=LOOKUP_TIMEOUT_S, unsent=unsent)
            except errors.SpillError as why:
                log.debug("a failed read's report was not answered: %s (the read: %s)", why, exc)
            return None
        try:  # the daemon's LRU and histogram: the restore is done and good, whatever becomes of this report
            params = {"path": path, "restore_s": time.perf_counter() - t0}
            unsent = functools.partial(self._tell, "touch", params)
            await self.call("touch", params, timeout=min(self.timeout, LOOKUP_TIMEOUT_S), unsent=unsent)
        except errors.SpillError as exc:
            log.debug("a restore's touch was not answered: %s", exc)
        return loaded

    def _unread(self, answer: Any) -> None:
        """The answer to a lookup (or a resume) its caller gave up on, cancelled or timed out: a hit is read by
        nobody (found in review: a cancel that came during the lookup held the daemon's background reads for
        ``--io-timeout``, the hit it answered waiting for a touch that never came)."""
        if isinstance(answer, dict) and answer.get("hit") is True and isinstance(path := answer.get("path"), str):
            self._read_ended(path)

    def _read_ended(self, path: str) -> None:
        """A hit will not be read, or its read was cancelled and has ended: the daemon's background reads wait for
        it no more (found in review: they waited for ``--io-timeout``, no touch coming). Its ``read_failed`` names
        no file it found gone, and the daemon takes a file out of its index only where it finds that file gone
        itself."""
        self._tell("read_failed", {"path": path})

    def _tell(self, method: str, params: dict[str, Any]) -> None:
        """Write a small request without waiting for room or an answer (between two frames of another send), as a
        cancel must not wait on the daemon; none once the connection is lost (its end tells the daemon as much).
        A restore's last word (``touch``, ``read_failed``, ``report_bad``) that waited behind another send until
        its caller was cancelled, or its timeout, goes so (found in review: it was never sent, and the hit held
        the daemon's background reads for ``--io-timeout``)."""
        if self._writer is not None and not self._writer.is_closing():
            write_each(self._writer, P.request(next(self._ids), method, params))

    def barrier(self, key: str = "") -> asyncio.Future[Settled]:
        """A future that settles once every spill queued before it is settled (shipped here, then at the daemon)."""
        return on_loop(self._bound(), lambda: self._enqueue_barrier(key, delete_checkpoints=False))

    def _enqueue_barrier(self, key: str, *, delete_checkpoints: bool) -> asyncio.Future[Settled]:
        """Queue a barrier locally; once it is its turn, it is sent (the daemon orders it after our commits), and
        the daemon's answer settles the returned future, as a commit's answer settles a spill's."""
        outcome: asyncio.Future[Settled] = asyncio.get_running_loop().create_future()

        async def send() -> None:  # the local queue's "write" of a barrier
            await self._ensure()
            await self._room_for_a_commit()  # a barrier waits at the daemon as long as a commit: counted as one
            answer = await self._start_call("barrier", {"key": key, "delete_checkpoints": delete_checkpoints})
            self._commits.add(answer)  # a drain and a close wait for it as for a commit
            answer.add_done_callback(lambda f: self._settle_barrier(f, outcome, delete_checkpoints))

        self._open.add(outcome)
        self.queue.enqueue(SpillItem(key=key, barrier=send)).add_done_callback(
            lambda f: self._unless_shipped(f, outcome)
        )
        return outcome

    def _settle_barrier(self, answer: asyncio.Future[Any], outcome: asyncio.Future[Settled], deleting: bool) -> None:
        """The daemon's answer settles the caller's future: its value the checkpoints deleted (``finish``), else
        None, as a ``Spiller``'s; one not stored counts in ``not_stored``, as a ``Spiller``'s drain counts it."""
        self._commits.discard(answer)
        if answer.cancelled() or answer.exception() is not None:
            err = P.ConnectionLost("barrier cancelled") if answer.cancelled() else answer.exception()
            settled = Settled(Outcome.FAILED, error=err)
        else:
            settled = _barrier_settled(answer.result(), deleting)
        self._settle_with(outcome, settled)

    def checkpoint(
        self,
        tokens: Sequence[int],
        caches: Sequence[Any],
        checkpoint: fmt.GenerationCheckpoint,
        *,
        attachments: Sequence[Attachment] = (),
    ) -> asyncio.Future[Settled]:
        """Checkpoint an in-flight generation (a ``spill`` with ``checkpoint``): it cancels the older checkpoints
        of the same key still queued (here and at the daemon), and is found by ``resume(key)``, never by a lookup."""
        return self.spill(tokens, caches, attachments=attachments, checkpoint=checkpoint)

    async def resume(self, key: str) -> Loaded | None:
        """Load the latest durable checkpoint of generation ``key``, or None."""
        t0 = time.perf_counter()
        await self._connected_within()
        params = {"identity": self.identity.to_wire(), "key": key, "codec_provider": self.provider.id}
        found, named = _hit_of(
            dict(await self.call("resume", params, timeout=self._lookup_timeout(), late=self._unread))
        )
        if isinstance(found, Miss):
            return None
        ident = dataclasses.replace(self.identity, namespace=checkpoint_namespace(key))
        return await self._restore(found, named, ident, t0)

    def finish(self, key: str) -> asyncio.Future[Settled]:
        """The generation is done: its queued work (checkpoints, and spills given ``key``) is cancelled, here and at
        the daemon, then its stored checkpoints deleted once the spills queued before this are settled; the
        ``Settled``'s value is how many were deleted."""

        def enqueue() -> asyncio.Future[Settled]:
            self.queue.cancel_where(of_generation(key))
            return self._enqueue_barrier(key, delete_checkpoints=True)

        return on_loop(self._bound(), enqueue)

    async def cancel(self, *, namespace: str | None = None, key: str | None = None) -> int:
        """Cancel the queued items (here and at the daemon; not one being written) of ``namespace`` and of ``key``."""
        local = self.queue.cancel_where(matching(namespace, key))
        params = {k: v for k, v in (("namespace", namespace), ("key", key)) if v is not None}
        remote = await self.call("cancel", params)
        return local + int(remote["cancelled"])

    async def drain(self, timeout: float | None = None) -> DrainReport:
        """Ship everything queued here, then wait for the daemon's queue to be durable; ``timeout`` bounds the call.

        ``pending_*`` count what is left here and at the daemon (every client's items there).
        """
        deadline = Deadline(timeout)
        with self._verdicts() as ours:  # ours the daemon answers as not stored meanwhile
            local = await self.queue.drain(deadline.left())
            unanswered = await self._wait_commits(deadline.left())
        left = deadline.left()
        params = {"timeout": P.DRAIN_DEFAULT_S if left is None else min(left, MAX_DURATION_S)}  # (inf: the longest)
        wait = None if left is None else left + ANSWER_GRACE_S  # the daemon answers at its deadline
        try:
            r = await self.call("drain", params, timeout=wait, progress=lambda _: None)
        except errors.Timeout:
            r = {"done": False, "pending_items": 0, "pending_bytes": 0}
        done = local.done and not unanswered and bool(r["done"])
        items = local.pending_items + unanswered + int(r["pending_items"])
        lost = local.not_stored + ours.not_stored + int(r.get("not_stored", 0))
        return DrainReport(done, items, local.pending_bytes + int(r["pending_bytes"]), lost)

    async def status(self) -> dict[str, Any]:
        return dict(await self.call("status"))


def _refused() -> concurrent.futures.Future[Settled]:
    """What a closed ``Client`` answers a spill with, as the asynchronous client's closed queue says it."""
    done: concurrent.futures.Future[Settled] = concurrent.futures.Future()
    settle_closed(done)
    return done


def _hit_of(r: dict[str, Any]) -> tuple[Hit | Miss, dict[str, str]]:
    """A ``lookup`` or ``resume`` answer: the hit and the files of its blocks the daemon named (key hex -> path)."""
    if not r["hit"]:
        return Miss(MissReason(str(r["reason"]))), {}
    hit = Hit(str(r["path"]), int(r["matched"]), int(r["tokens"]), bool(r["trimmable"]), r.get("blocks_only") is True)
    named = r.get("blocks")
    paths = [p for p in named if isinstance(p, str)] if isinstance(named, list) else []
    return hit, {os.path.basename(p).split("-", 1)[0]: p for p in paths}


def _commit_settled(commit: asyncio.Future[Any], header: fmt.Header) -> Settled:
    """A ``commit`` answer (or its loss: the connection went first) as the ``Settled`` a ``Spiller``'s spill gives."""
    if commit.cancelled() or commit.exception() is not None:  # not stored as far as anyone here knows
        return Settled(
            Outcome.FAILED, error=P.ConnectionLost("commit cancelled") if commit.cancelled() else commit.exception()
        )
    r = commit.result()
    if r["outcome"] == "stored":
        return Settled(Outcome.STORED, value=SaveResult(str(r["path"]), header, int(r["file_bytes"])))
    if r["outcome"] in ("dropped", "cancelled"):  # with the reason when there is one (a store's shed)
        why = errors.error_from_code(str(r["code"]), str(r.get("message", ""))) if "code" in r else None
        return Settled(Outcome(r["outcome"]), error=why)
    err = errors.error_from_code(str(r.get("code", "error")), str(r.get("message", r["outcome"])))
    return Settled(Outcome.FAILED, error=err)


def _barrier_settled(r: Any, deleting: bool) -> Settled:
    """A ``barrier`` answer (``outcome``, ``deleted``) as the ``Settled`` a ``Spiller``'s barrier gives."""
    try:
        outcome, deleted = Outcome(r["outcome"]), int(r["deleted"])
    except (KeyError, TypeError, ValueError):
        return Settled(Outcome.FAILED, error=errors.ProtocolError(f"a barrier's answer is malformed: {r!r}"))
    if outcome is Outcome.FAILED:
        return Settled(outcome, error=errors.StorageError("the daemon's barrier action failed (see its log)"))
    return Settled(outcome, value=deleted if deleting and outcome is Outcome.STORED else None)


@dataclasses.dataclass
class _Verdicts:
    """The items a drain or a close waits for, and how many of them the daemon answered as not stored."""

    items: set[asyncio.Future[Settled]]
    not_stored: int = 0


def _drop(fut: asyncio.Future[Any]) -> None:
    """Give up on a request's future: cancel it, or take the error a lost connection left in it (else asyncio
    logs 'Future exception was never retrieved' for a request its caller had already given up on)."""
    if not fut.done():
        fut.cancel()
    elif not fut.cancelled():
        fut.exception()


def write_each(writer: asyncio.StreamWriter, bufs: list[bytes | memoryview]) -> None:
    """A frame's buffers written one by one, with no await between them (nothing can come between two parts of a
    frame). Not ``writelines``: on Python 3.11 the standard loop joins them into one new bytes object first (a copy
    of every payload on the engine's loop: 1.8 s of CPU a GiB sent, against 0.4 s written one by one), and on
    3.13.0 it queues them without the pause that ``drain`` waits on."""
    for buf in bufs:
        writer.write(buf)


class _PoolMaker:
    """Makes a segment pool on a worker thread; one dropped before it is made is closed by that thread once made
    (found in review: a close that waited for it passed its own timeout, and one that did not leaked it)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._dropped = False
        self._pool: ShmPool | None = None

    def make(self) -> ShmPool:
        pool = ShmPool()
        pool.make()
        with self._lock:
            if not self._dropped:
                self._pool = pool
                return pool
        pool.close()  # dropped meanwhile: nobody will adopt it
        return pool

    def drop(self) -> None:
        with self._lock:
            self._dropped, pool = True, self._pool
        if pool is not None:
            pool.close()  # closing twice is harmless: a pool adopted was closed already


def _unheld(header: fmt.Header, sources: list[AnySource], held: Any) -> list[tuple[fmt.Slot, AnySource]]:
    """Each tensor's slot and source, its positional ones cut to the rows after the ``held`` the daemon has."""
    if type(held) is not int or held <= 0:
        return list(zip(header.slots(), sources, strict=True))
    try:
        cut = blocks.after_held(header, held)
    except ValueError as exc:
        raise errors.ProtocolError(f"the daemon holds more rows than the spill has: {exc}") from None
    return [
        (s, src.row_slice(start, s.shape[-2]) if start else src) for (s, start), src in zip(cut, sources, strict=True)
    ]


def _fill(seg: memoryview, runs: list[memoryview]) -> tuple[int, list[memoryview]]:
    """Copy as much of ``runs`` as fits into ``seg``; return the bytes copied and what is left."""
    pos = 0
    left = list(runs)
    while left and pos < len(seg):
        r = left[0]
        n = min(r.nbytes, len(seg) - pos)
        copy_into(seg[pos : pos + n], r[:n])
        pos += n
        left = left[1:] if n == r.nbytes else [r[n:], *left[1:]]
    return pos, left


class Client:
    """The same API, synchronous, for engines that decode in a thread of their own.

    The constructor connects (on a private event-loop thread) and raises ``ConnectionLost`` if no daemon
    answers; ``with Client(...) as c:`` closes it at the end. Every other call may come from any thread.
    """

    def __init__(self, socket_path: str | None = None, **kwargs: Any) -> None:
        self._lt, self._async = LoopThread.start_with(
            "spilld-client", lambda lt: lt.run(AsyncClient.open(socket_path, **kwargs))
        )
        self._closed: DrainReport | None = None  # close's report, once it ran
        self._closing = threading.Lock()  # closes from other threads than the loop's, one at a time
        # spills handed to the loop: settled cancelled if it stops before it runs them
        self._handoffs = Handoffs.closed_by(self._lt.on_close)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run on the client's loop thread; ``ConnectionLost`` once the client is closed (or closing), as the
        asynchronous client says it."""
        if self._closed is not None:
            coro.close()
            raise errors.Closed("this client is closed")
        try:
            return self._lt.run(coro)
        except concurrent.futures.CancelledError:
            raise errors.Closed("this client was closed while the call waited") from None

    def spill(
        self,
        tokens: Sequence[int],
        caches: Sequence[Any],
        meta: dict[str, str] | None = None,
        *,
        namespace: str = "",
        key: str = "",
        droppable: bool = True,
        attachments: Sequence[Attachment] = (),
        checkpoint: fmt.GenerationCheckpoint | None = None,
        live: bool = False,
        pin: bool = False,
        behind: concurrent.futures.Future[Settled] | None = None,
    ) -> concurrent.futures.Future[Settled]:
        """Clone now, on the calling (engine's) thread; a future of the daemon's outcome.

        ``behind``: the future of an earlier droppable spill of the same entry made here (a write-behind). Where that
        one still stands for this spill it is kept in its place, made not droppable if this one is not, and this one
        is held, not written as well, until that one ends: if that one's write fails (or the write gate sheds it as
        it is written), this one is written in its place. Where it no longer can, this one is queued. When each way
        in keeps it: ``spill_threadsafe``. The future is then the one kept's.
        """
        if self._closed is not None:
            return _refused()
        return self._handoffs.track(self._async.spill_threadsafe(
            tokens, caches, meta, namespace=namespace, key=key, droppable=droppable, attachments=attachments,
            checkpoint=checkpoint, live=live, pin=pin, behind=behind,
        ))  # fmt: skip

    def _submit(self, enqueue: Callable[[], asyncio.Future[Settled]]) -> concurrent.futures.Future[Settled]:
        """Queue on the client's loop (``enqueue`` runs there) from any thread: a future of the outcome."""
        return _refused() if self._closed is not None else self._handoffs.track(threadsafe(self._lt.loop, enqueue))

    # The token ids are read here, on the caller's thread: an mlx array it left lazy can be evaluated by no other
    # thread (found in review: the loop thread's read raised "There is no Stream(cpu, 0) in current thread").

    def lookup(self, tokens: Sequence[int], namespace: str = "") -> Hit | Miss:
        return self._run(self._async.lookup(token_ids_now(tokens), namespace))

    def load(self, tokens: Sequence[int], namespace: str = "", *, longer_than: int = 0) -> Loaded | None:
        return self._run(self._async.load(token_ids_now(tokens), namespace, longer_than=longer_than))

    def barrier(self, key: str = "") -> concurrent.futures.Future[Settled]:
        return self._submit(lambda: self._async.barrier(key))

    def checkpoint(
        self,
        tokens: Sequence[int],
        caches: Sequence[Any],
        checkpoint: fmt.GenerationCheckpoint,
        *,
        attachments: Sequence[Attachment] = (),
    ) -> concurrent.futures.Future[Settled]:
        return self.spill(tokens, caches, attachments=attachments, checkpoint=checkpoint)

    def resume(self, key: str) -> Loaded | None:
        return self._run(self._async.resume(key))

    def finish(self, key: str) -> concurrent.futures.Future[Settled]:
        return self._submit(lambda: self._async.finish(key))

    def cancel(self, *, namespace: str | None = None, key: str | None = None) -> int:
        return self._run(self._async.cancel(namespace=namespace, key=key))

    def drain(self, timeout: float | None = None) -> DrainReport:
        return self._run(self._async.drain(timeout))

    def status(self) -> dict[str, Any]:
        return self._run(self._async.status())

    def close(self, timeout: float | None = None) -> DrainReport:
        """As ``AsyncClient.close``; then the loop thread ends. A second close gives the first one's report.

        From the client's own loop thread (a spill future's callback) the close cannot be waited for: it runs once
        the callback returns, and this returns at once a report that is not ``done``."""
        if self._lt.on_own_thread:
            if self._closed is None:
                self._closed = DrainReport(False, 0, 0, 0)
                self._lt.stop(first=self._async.close(timeout))
            return self._closed
        with self._closing:  # one close at a time from other threads: the others get its report (found in review)
            return self._close_here(timeout)

    def _close_here(self, timeout: float | None) -> DrainReport:
        if self._closed is not None:  # one begun on the loop's own thread may still run: wait for its end, as long
            self._lt.stop(wait=timeout)  # as this close may take
            return self._closed
        end = None if timeout is None else time.monotonic() + timeout + CLOSE_STOP_S
        try:
            self._closed = self._lt.run(self._async.close(timeout))
        except concurrent.futures.CancelledError:
            self._closed = DrainReport(False, 0, 0, 0)  # (a close from another thread won: it stopped the loop)
        finally:
            if self._closed is None:
                self._closed = DrainReport(False, 0, 0, 0)
            # a step waiting on the caller's own lock outlasts any wait: the timeout bounds this one too (found
            # in review: 10 s, the tasks' and the executor's 5 s each, for a close of 0.2 s)
            left = STOP_TASKS_TIMEOUT_S if end is None else max(CLOSE_STOP_MIN_S, end - time.monotonic())
            self._lt.stop(unwind=min(STOP_TASKS_TIMEOUT_S, left))
        return self._closed
