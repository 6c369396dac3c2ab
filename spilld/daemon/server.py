"""The spilld service: one process, one Unix socket, one queue and one store for every engine.

Clients hand over file-ready spills: a planned header, then the tensors' bytes
(``put`` frames), then ``commit``. The daemon queues the complete item against
``--cap``, writes it with the generator saver (hashes computed here, never
trusted from the client) and answers the commit once the file is durable.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import signal
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

from .. import __version__, errors, fileio
from .. import format as fmt
from .. import protocol as P
from ..config import Config, format_size
from ..entries import CHECKPOINT_NS_PREFIX, Hit, Miss, MissReason, token_array
from ..lease import off_loop
from ..lockfile import FileLock
from ..lru import LRU
from ..metrics import METRICS_EVERY_S, RESTORE_BUCKETS_S, LatencyHistogram, exposition, write_textfile
from ..queue import SpillItem, SpillQueue, matching, of_generation
from ..readahead import ReadAhead, warm_order
from ..saver import WRITE_BATCH_BYTES, AnySource
from ..scrub import Scrub
from ..service.activation import inherited_listener, socket_path
from ..service.lifecycle import Lifecycle, Progress
from ..store import Store
from .budget import LOOKUP_CLIENT_SHARE, LOOKUP_SHARE, Budget
from .connection import BackgroundLease, Connection, GrantorLease, Received, StepLog, received_bytes, sent_by
from .ingest import MAX_OPEN_SPILLS, MAX_OPEN_TENSORS, MAX_OPEN_TOKENS, Ingest
from .listen import bind, claim, serve_inherited, socket_lock
from .logs import CLIENT_ERROR_LOGS_PER_S, CLIENT_NAMES_KEPT, LogThrottle
from .params import IDENTITY_FIELDS

# The requests the daemon answers itself (``_<name>``); ingest answers spill, commit and abort. Each has its table of
# params in ``params.METHODS``.
SERVED_METHODS = (
    "barrier",
    "cancel",
    "lookup",
    "resume",
    "touch",
    "read_failed",
    "delete",
    "report_bad",
    "drain",
    "status",
    "shutdown",
    "evict",
    "pin",
)

if TYPE_CHECKING:
    from ..remote.link import RemoteLink

log = logging.getLogger("spilld.daemon")

DRAIN_PROGRESS_S = 0.5
# SIGHUP (a closed terminal, or `kill -HUP`) stops the daemon like SIGTERM: it drains; there is no config to reload
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
SECOND_SIGNAL_EXIT = 3  # a stop that left work unfinished, as a drain past its deadline
EXPIRE_EVERY_S = 1.0  # how often open spills are checked for silence


def open_store(cfg: Config) -> Store:
    """The store on ``--dir``, its folder made (0700) if missing; a folder that cannot be is ``UnusableFolder``."""
    try:
        return Store(
            cfg.dir, disk_cap=cfg.disk_cap, durability=cfg.durability, block_tokens=cfg.block_tokens,
            write_budget=cfg.write_budget, namespace_quota=cfg.namespace_quota, pin_cap=cfg.pin_cap,
            admit_after=cfg.admit_after, io_timeout=cfg.io_timeout,
        )  # fmt: skip
    except (errors.StorageError, OSError) as exc:
        why = exc.reason if isinstance(exc, errors.SpillError) else (exc.strerror or str(exc))
        raise errors.UnusableFolder(f"--dir {cfg.dir} cannot be used: {why}") from None


BUSY_AFTER_LOOKUP_S = 1.0  # after a lookup, background reads wait this long: its client's restore reads first
MAX_RESTORING = 4096  # hits remembered as being read by their clients (each until its touch or its read's deadline)
REMOTE_CLOSE_S = 5.0  # a stop waits this long for queued pushes to the remote tier
MAX_LOOKUP_BLOCK_PATHS = 4096  # block files a lookup reply names at most (the client lists the folder for more)


class Daemon:
    """The service state shared by every connection. ``listener``: a listening socket handed over by a service
    manager (socket activation), served instead of binding ``cfg.socket``."""

    def __init__(self, cfg: Config, listener: socket.socket | None = None, claimed: FileLock | None = None) -> None:
        """``claimed``: the socket's lock, held by a caller that claimed the socket before this made the store's
        folder (``run``); else the socket is claimed at ``start``."""
        self.cfg = cfg
        self.listener = listener
        self.service = Lifecycle.from_env()  # sd_notify; no-ops outside systemd
        self.store = open_store(cfg)
        self.queue = SpillQueue(cfg.cap, self._write, bytes_of=received_bytes)
        self.lease = BackgroundLease()
        self.stopping = asyncio.Event()
        self.connections: set[Connection] = set()
        # each shared-memory segment name to the one connection whose put_shms may name it (Connection.owned)
        self.shm_owners: dict[str, Connection] = {}
        self.remote: RemoteLink | None = None  # the shared tier (--remote), once started
        self.ingest = Ingest(cfg, self.queue, self.stopping, self.store.hold_blocks, self.store.release_blocks)
        self.client_errors = 0  # connections ended for a client's fault (bad frames, timeouts, refusals)
        self.client_log = LogThrottle(CLIENT_ERROR_LOGS_PER_S)
        self.connect_log = LogThrottle(CLIENT_ERROR_LOGS_PER_S)  # "client connected" lines at info
        self.client_names: LRU[str, bool] = LRU(CLIENT_NAMES_KEPT)  # names whose connection was logged at info
        self.writing = 0  # saves under way (a drain that is writing is making progress)
        self.started = time.monotonic()  # uptime: a clock a step of the wall clock (NTP at boot) does not move
        self.lookups = 0  # lookup requests answered (hits are counted when the client reports its restore: touch)
        looking = max(cfg.cap // LOOKUP_SHARE, 1)  # what lookups being served hold, and one client of them
        self.looking = Budget(looking, "lookups", share=max(looking // LOOKUP_CLIENT_SHARE, 1))
        self.last_lookup = -math.inf  # monotonic time of the last one: a client restore follows a lookup
        # hits whose client is reading them (until its touch, or the read's deadline): (client, path) -> when it ends
        self.restoring: dict[tuple[int, str], float] = {}
        self.readahead: ReadAhead | None = None  # warm start (--warm-bytes), once the scan is done
        self._warming: asyncio.Task[None] | None = None
        self.scrub: Scrub | None = None  # --scrub-rate
        self._scrubbing: asyncio.Task[None] | None = None
        self.restore_seconds = LatencyHistogram(RESTORE_BUCKETS_S)
        self._server: asyncio.AbstractServer | None = None
        self._socket_lock: FileLock | None = claimed
        self._expiry: asyncio.TimerHandle | None = None
        self._signals = 0
        self._halt = threading.Event()  # a stop signal, as the scan's thread can see it
        self._metrics_failing = False
        self.methods: dict[str, Any] = {n: getattr(self, f"_{n}") for n in SERVED_METHODS}
        self.methods |= {"spill": self.ingest.spill, "commit": self.ingest.commit, "abort": self.ingest.abort}

    # --- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Claim the socket, own the folder, check it takes writes, scan it, then listen; a refusal releases what was
        taken. The socket's checks come first: a refusal for it touches no store folder and waits for no scan."""
        try:
            if self.listener is None:
                lock = self._socket_lock = self._socket_lock or socket_lock(self.cfg.socket)
                await off_loop(lambda: claim(self.cfg.socket, lock))
            await off_loop(self._own_folder)
            async with self.service.extending(self._scan_progress):  # READY=1 waits for the scan (a big store)
                await off_loop(lambda: self.store.scan(stopped=self._halt.is_set))
            if self._halt.is_set():  # told to stop while it scanned: it never serves (serve() stops at once)
                return
            if self.cfg.remote:
                from ..remote.link import open_link  # needs the remote extra (redis): imported only when asked

                self.remote = await open_link(self.cfg, self.store)
            await self._listen()
        except BaseException:
            self._release_locks(refused=True)
            if self.remote is not None:  # its push worker, health task and connections end with the refusal
                remote, self.remote = self.remote, None
                await remote.close(0)
            raise
        if self.cfg.warm_bytes:
            self.readahead = ReadAhead(warm_order(self.store, self.cfg.warm_bytes), self.cfg.warm_rate, self._busy)
            self._warming = asyncio.get_running_loop().create_task(self.readahead.run())
        if self.cfg.scrub_rate:
            self.scrub = Scrub(self.store, self.cfg.scrub_rate, self._clients_active, interval=self.cfg.scrub_every)
            self._scrubbing = asyncio.get_running_loop().create_task(self.scrub.run())
        log.info(
            "spilld %s serving on %s: dir %s, cap %s, disk cap %s, %d entries",
            __version__, self.cfg.socket, self.cfg.dir, format_size(self.cfg.cap),
            format_size(self.store.disk_cap), self.store.count,
        )  # fmt: skip
        self.service.ready(f"serving on {self.cfg.socket}: {self.store.count} entries")
        self._expire_idle()

    def _expire_idle(self) -> None:
        loop = asyncio.get_running_loop()
        self.ingest.expire(self.connections, loop.time())
        if not self.stopping.is_set():
            self._expiry = loop.call_later(EXPIRE_EVERY_S, self._expire_idle)

    async def serve(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._on_signal, sig)
        self.service.start_watchdog()  # before the scan: a long scan runs off the loop, which stays alive
        await self.start()
        metrics = loop.create_task(self._write_metrics_every()) if self.cfg.metrics_file else None
        await self.stopping.wait()
        code = await self.stop()
        if metrics is not None:
            metrics.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await metrics  # its write in flight ends first: the final one below is the last
            await self._write_metrics()  # the final counts
        return code

    async def _write_metrics(self) -> None:
        """Render ``status`` on the loop (a snapshot), write the textfile on a worker thread."""
        path, data = str(self.cfg.metrics_file), exposition(self.status())
        try:
            await off_loop(lambda: write_textfile(path, data))
            self._metrics_failing = False
        except OSError as exc:
            if not self._metrics_failing:  # one line per run of failures, not one every few seconds
                log.warning("cannot write the metrics file", extra={"path": path, "error": str(exc)})
            self._metrics_failing = True

    async def _write_metrics_every(self) -> None:
        while True:
            await self._write_metrics()
            await asyncio.sleep(METRICS_EVERY_S)

    def _own_folder(self) -> None:
        """One daemon per folder (its lock, held for our life), and a folder that takes writes, or no start."""
        self.store.acquire()
        try:
            fileio.probe_writable(self.store.ops, self.store.root)
        except errors.StorageError as exc:
            raise errors.UnusableFolder(f"--dir {self.store.root} does not take writes: {exc.reason}") from None

    async def _listen(self) -> None:
        if self.listener is not None:  # the manager owns the path: no stale-socket probe, no unlink at stop
            self._server = await serve_inherited(self.listener, lambda: Connection(self))
            inherited = socket_path(self.listener)
            if inherited and os.path.abspath(inherited) != os.path.abspath(self.cfg.socket):  # a unit edited by hand
                log.warning(
                    "serving the socket the service manager passed, %s, not --socket %s", inherited, self.cfg.socket
                )
            self.cfg.socket = inherited or self.cfg.socket
        else:  # claimed at the start, before the scan
            self._server = await bind(self.cfg.socket, lambda: Connection(self), self._socket_lock)

    def _release_locks(self, refused: bool = False) -> None:
        """Let go of the socket's lock and the folder's; ``refused``: a start that did not serve, whose socket lock
        file goes too if it made it (a stop keeps it, for the next owner)."""
        if self._socket_lock is not None:
            if refused:
                self._socket_lock.discard()
            else:
                self._socket_lock.release()
        self.store.close()

    def _on_signal(self, sig: int) -> None:
        self._signals += 1
        if self._signals > 1:  # the operator insists: what is still queued is lost (never a partial file)
            left = self.queue.pending_items
            # exit 3 says work was left; with none left the stop's own 0 (found in review: a second signal on an
            # idle daemon, as `timeout` sends to a process group, exited 3 with nothing lost)
            code = SECOND_SIGNAL_EXIT if left else 0
            log.warning(
                "second signal: exiting now",
                extra={"signal": signal.Signals(sig).name, "items_lost": left,
                       "bytes_lost": self.queue.pending_bytes, "exit": code},
            )  # fmt: skip
            os._exit(code)
        log.info(
            "%s: stopping (finishing queued work within %.0f s)", signal.Signals(sig).name, self.cfg.drain_deadline
        )
        self._halt.set()
        self.stopping.set()

    async def stop(self) -> int:
        ends = asyncio.get_running_loop().time() + self.cfg.drain_deadline
        self.service.stopping(self._drain_status())
        for task in (self._warming, self._scrubbing):
            if task is not None:
                task.cancel()
        if self._expiry is not None:
            self._expiry.cancel()
        if self._server is not None:
            self._server.close()
        async with self.service.extending(self._drain_progress, budget_s=self.cfg.drain_deadline):
            await self.ingest.committed(timeout=self.cfg.request_timeout)  # a commit received is not cancelled
            report = await self.queue.close(timeout=self.cfg.drain_deadline)
            if self.remote is not None:  # what was stored is pushed while the deadline lasts; the rest is not
                left = max(0.0, ends - asyncio.get_running_loop().time())  # (found in review: 5 s past a 1 s one)
                if not await self.remote.close(min(REMOTE_CLOSE_S, left)):
                    log.warning("stopping: pushes to the shared tier still queued were dropped (stored locally)")
        for conn in list(self.connections):
            if conn.tasks:  # commits answered before the connections go
                await asyncio.wait(list(conn.tasks), timeout=1.0)
            conn.close()
        if self.listener is None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.cfg.socket)
        await self.store.record_wear()  # (the store's lock still held: no successor counts the same bytes)
        self._release_locks()  # after the socket is gone: a successor never finds ours
        code = 0 if report.done else 3
        if code:  # work lost: said at warning, with what (found in review: an info line whose counts read 0)
            log.warning(
                "stopped with work left: not written within the %g s drain deadline, items %d (%d bytes)",
                self.cfg.drain_deadline, report.pending_items, report.pending_bytes,
                extra={"items_lost": report.pending_items, "bytes_lost": report.pending_bytes},
            )  # fmt: skip
        log.info("stopped", extra={"queue": self.queue.counters(), "store": self.store.stats(), "exit": code})
        await self.service.close()
        return code

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

    def _busy(self) -> bool:
        """Serving: a write under way or queued, a lookup being answered or answered in the last
        ``BUSY_AFTER_LOOKUP_S``, or a hit its client is still reading (found in review: a restore longer than that
        second had the scrub reading beside it). Background readers (warm start) wait meanwhile."""
        now = time.monotonic()
        # a lookup counts in ``looking`` from its dispatch until answered (found in review: a fill from the shared
        # tier, 0.3 s, ran with the scrub reading beside it and its client waiting for the answer)
        recent = self.looking.held > 0 or now - self.last_lookup < BUSY_AFTER_LOOKUP_S
        for k in [k for k, ends in self.restoring.items() if ends <= now]:
            del self.restoring[k]
        return recent or bool(self.restoring) or self.writing > 0 or self.queue.pending_items > 0

    def _clients_active(self) -> bool:
        """``_busy``, or a client sending a spill: the scrub waits for an idle daemon."""
        return self._busy() or any(c.spills for c in self.connections)

    def _drain_status(self) -> str:
        return f"stopping: {self.queue.pending_items} items ({format_size(self.queue.pending_bytes)}) left to write"

    def _drain_progress(self) -> Progress:
        q = self.queue
        return Progress((q.pending_items, q.pending_bytes), busy=self.writing > 0, status=self._drain_status())

    def _scan_progress(self) -> Progress:
        seen = self.store.scan_tally.files  # counted by the scan's thread as it goes
        return Progress((seen,), busy=False, status=f"scanning: {seen} files so far")

    # --- writing -------------------------------------------------------------------------

    async def _write(self, item: SpillItem) -> Any:
        got = item.payload
        assert isinstance(got, Received)  # barriers never reach the writer
        header = got.header
        sources = got.sources()
        grantor = got.grantor
        lease: Any = GrantorLease(grantor, self.cfg.request_timeout) if grantor is not None else self.lease
        if log.isEnabledFor(logging.DEBUG):
            lease = StepLog(lease, got.conn.client_name)
        self.writing += 1
        t0 = time.perf_counter()
        try:
            # Each write step (hash, write; the publish's fsync) runs inside the lease: a granting engine is
            # kept from decoding during the daemon's disk work, not only while bytes are taken.
            planned: tuple[fmt.Header, list[AnySource]] = (header, list(sources))
            result = await self.store.put(
                [], [], header.identity, planned=planned, run_step=lease, write_in_lease=True,
                droppable=item.droppable, pin=item.pin, held_rows=got.held_rows,
                batch_bytes=WRITE_BATCH_BYTES if grantor is None else 0,  # a granting engine is held per step
            )  # fmt: skip
        except Exception as exc:
            log.debug("store failed", extra={"error": repr(exc)[:200], "tokens": len(header.tokens)})
            raise
        finally:
            self.writing -= 1
        log.debug(
            "stored",
            extra={"path": result.path, "bytes": result.file_bytes, "tokens": len(header.tokens),
                   "namespace": header.identity.namespace, "ms": round(1e3 * (time.perf_counter() - t0), 2)},
        )  # fmt: skip
        return result

    # --- methods ---------------------------------------------------------------------------

    async def _barrier(self, conn: Connection, p: dict[str, Any], msgid: int) -> dict[str, Any]:
        key, delete = p.get("key", ""), p.get("delete_checkpoints", False)

        async def action() -> int:
            return await self.store.remove_checkpoints_async(key) if delete else 0  # unlinks on a worker

        if delete:  # a finished generation: its work still queued is moot (a client's ``finish``); now, before any
            self.queue.cancel_where(of_generation(key))  # wait: what comes after this request is not cancelled
        # after every spill committed before it: a commit may still wait for its shared-memory copies (one that
        # lands during this wait is written, then its checkpoint removed by the action)
        await self.ingest.committed(timeout=self.cfg.request_timeout)
        settled = await self.queue.enqueue(SpillItem(key=key, barrier=action))
        return {"outcome": settled.outcome.value, "deleted": settled.value or 0}

    async def _cancel(self, conn: Connection, p: dict[str, Any], msgid: int) -> dict[str, Any]:
        """The asking client's own queued spills of a namespace and/or a key, as a Spiller's ``cancel`` drops its
        own (found in review: one engine's cancel dropped every client's spills of that namespace)."""
        try:
            which = matching(p.get("namespace"), p.get("key"))
        except ValueError as exc:
            raise P.BadParams(str(exc)) from None
        return {"cancelled": self.queue.cancel_where(lambda it: which(it) and sent_by(it, conn))}

    async def _lookup(self, conn: Connection, p: dict[str, Any], msgid: int) -> dict[str, Any]:
        ident = _identity(p["identity"])  # its namespace, if sent, is not used
        tokens = token_array(p["tokens"])
        ns, provider = p.get("namespace", ""), p.get("codec_provider")
        if ns.startswith(CHECKPOINT_NS_PREFIX):  # checkpoints are found by ``resume`` only, never by a lookup (review)
            raise P.BadParams("lookup: namespaces starting with the checkpoint prefix are reserved")
        # compared off the loop; a miss not counted yet: the answer may be the next lookup's, after a fill (found in
        # review: counted, then taken back once the fill kept the prompt, `misses` went down under a status or a
        # metrics write made while the fill ran, and Prometheus read that as a counter reset)
        hit = await self.store.lookup_async(ident, ns, tokens, codec_provider=provider, tally=False)
        filled = (
            self.remote is not None
            and not self._served_here(hit, len(tokens))
            and await self.remote.fill(ident, ns, tokens, provider or self.store.provider_id)
        )
        stale = isinstance(hit, Hit) and self.store.entry_at(hit.entry.path) is not hit.entry
        if filled or stale:  # held now; or the entry found went while the fill ran (superseded, evicted: review)
            hit = await self.store.lookup_async(ident, ns, tokens, codec_provider=provider, counted=False)
        elif isinstance(hit, Miss):  # one lookup, one answer counted (found in review: a filled lookup read as a
            self.store.tally_miss(hit)  # miss and a hit)
        return self._answer_lookup(conn, hit, len(tokens), p.get("longer_than") or 0)

    def _served_here(self, hit: Hit | Miss, ntokens: int) -> bool:
        """The local hit covers every block a fill could fetch for the prompt: the shared tier is not asked (found
        in review: a full local hit waited on it, up to its bound when it hung)."""
        size = self.store.block_tokens
        return isinstance(hit, Hit) and (not size or hit.matched >= (ntokens - 1) // size * size)

    async def _resume(self, conn: Connection, p: dict[str, Any], msgid: int) -> dict[str, Any]:
        """The latest durable checkpoint of generation ``key``: answered as a lookup that matched all of it."""
        e = self.store.find_checkpoint(_identity(p["identity"]), p["key"], codec_provider=p.get("codec_provider"))
        return self._answer_lookup(conn, Hit(e, e.ntokens) if e is not None else Miss(MissReason.NO_ENTRY), None)

    def _answer_lookup(
        self, conn: Connection, hit: Hit | Miss, ntokens: int | None, longer_than: int = 0
    ) -> dict[str, Any]:
        """``longer_than``: the client reads no hit of at most that many tokens (its engine has them in memory)."""
        self.lookups += 1
        self.last_lookup = time.monotonic()
        if isinstance(hit, Hit):
            e = hit.entry
            # a hit the client will read holds background reads until its touch, or the read's deadline (a client
            # that never says it has read them); one it will not read, none (found in review: an engine's lookups
            # of prefixes it held in memory each held the scrub for --io-timeout, and one every 4 s starved it)
            if hit.matched > longer_than and len(self.restoring) < MAX_RESTORING:
                self.restoring[(conn.id, e.path)] = time.monotonic() + self.cfg.io_timeout
            log.debug(
                "lookup: hit", extra={"client": conn.id, "tokens": ntokens, "matched": hit.matched, "path": e.path}
            )
            named = [self.store.block_path(k) for k in e.blocks[:MAX_LOOKUP_BLOCK_PATHS]]
            return {
                "hit": True, "path": e.path, "matched": hit.matched, "tokens": e.ntokens, "trimmable": e.trimmable,
                "blocks_only": hit.blocks_only, "blocks": [b for b in named if b is not None],
            }  # fmt: skip
        log.debug("lookup: miss", extra={"client": conn.id, "tokens": ntokens, "reason": hit.reason.value})
        return {"hit": False, "reason": hit.reason.value}

    async def _touch(self, conn: Connection, p: dict[str, Any], msgid: int) -> dict[str, Any]:
        self.restoring.pop((conn.id, p["path"]), None)  # read: the background readers need not wait for it
        e = self.store.entry_at(p["path"])
        if e is not None:  # a restore the client completed (and kept): the one place a hit is counted
            self.store.counters.hits += 1
            await self.store.touch_async(e)  # the file's mtime set off the loop
            seconds = p.get("restore_s")
            if seconds is not None:
                self.restore_seconds.observe(float(seconds))  # measured by the client: lookup to loaded caches
            log.debug("restored", extra={"client": conn.id, "path": e.path, "restore_s": seconds})
        return {"found": e is not None}

    async def _read_failed(self, conn: Connection, p: dict[str, Any], msgid: int) -> dict[str, Any]:
        """The client could not read a hit (gone since its lookup, or a file it cannot use): background reads wait
        for it no more (found in review: they waited for --io-timeout, no touch coming). The file it could not
        read, if this daemon finds it gone from the disk, leaves the index (found in review: a file removed by hand
        stayed a hit, and every lookup of it a failed read, until the scrub came by)."""
        released = self.restoring.pop((conn.id, p["path"]), None) is not None
        file = p.get("file", p["path"])
        gone = await self.store.lost_async(file)  # the daemon's own check, not the client's word
        if gone:
            log.warning("a stored file is gone from the disk (a client's read found it): %s", file)
        return {"released": released, "gone": gone}

    def restores_gone(self, conn: Connection) -> None:
        """``conn`` is gone: background reads wait for none of the hits it was reading (found in review: a client
        gone before its touch held them for --io-timeout)."""
        for k in [k for k in self.restoring if k[0] == conn.id]:
            del self.restoring[k]

    async def _delete(self, conn: Connection, p: dict[str, Any], msgid: int) -> dict[str, Any]:
        if "path" in p:
            n = await self.store.remove_where_async(lambda e: e.path == p["path"])
        elif "key" in p:
            n = await self.store.remove_checkpoints_async(p["key"])
        else:
            raise P.BadParams("delete: bad params: a path or a key is needed")
        return {"deleted": n}

    async def _pin(self, conn: Connection, p: dict[str, Any], msgid: int) -> dict[str, Any]:
        """Pin (``on`` true, the default) or unpin the entry at ``path``: ``found`` false if there is none."""
        on = p.get("on", True)
        found = await self.store.pin_async(p["path"], on)
        if found:  # said, as an evict is: a pin changes what the disk cap evicts
            log.info(
                "client %d (%s) %s %s", conn.id, conn.client_name, "pinned" if on else "unpinned", p["path"],
                extra={"client": conn.id},
            )  # fmt: skip
        return {"found": found}

    async def _report_bad(self, conn: Connection, p: dict[str, Any], msgid: int) -> dict[str, Any]:
        path = p["path"]
        self.restoring.pop((conn.id, path), None)  # its read ended (found in review: it held background reads on)
        e = self.store.entry_at(path)
        if e is None:
            return {"quarantined": False}
        self.store.counters.misses[MissReason.CORRUPT.value] += 1
        why = errors.error_from_code(p.get("code", "bad_file"), "reported by a client")
        if not isinstance(why, errors.FileFormatError):
            why = errors.FileFormatError(f"reported by a client: {why.code}")
        why.path = p.get("file", path)  # the file found bad: the entry's own or one of its blocks
        await self.store.bad_read_async(e, why)
        return {"quarantined": True}

    async def _drain(self, conn: Connection, p: dict[str, Any], msgid: int) -> dict[str, Any]:
        deadline = time.monotonic() + p.get("timeout", P.DRAIN_DEFAULT_S)
        # what was queued at the request, waited for in slices: never what comes after it (found in review: each
        # slice took the queue anew, so under steady load a drain never said done)
        before = self.queue.settling()
        while True:
            left = deadline - time.monotonic()
            rep = await self.queue.drain(timeout=max(0.0, min(DRAIN_PROGRESS_S, left)), of=before)
            if rep.done or left <= 0:
                return {
                    "done": rep.done, "pending_items": rep.pending_items, "pending_bytes": rep.pending_bytes,
                    "not_stored": rep.not_stored,
                }  # fmt: skip
            conn.send(
                P.notification(
                    "drain_progress",
                    {"msgid": msgid, "pending_items": rep.pending_items, "pending_bytes": rep.pending_bytes},
                )
            )

    async def _evict(self, conn: Connection, p: dict[str, Any], msgid: int) -> dict[str, Any]:
        fp, older = p.get("fingerprint"), p.get("older_than_s")
        loop = asyncio.get_running_loop()

        def progress(items: int, nbytes: int) -> None:  # from the worker that unlinks: sent from the loop
            note = {"msgid": msgid, "pending_items": items, "pending_bytes": nbytes}
            loop.call_soon_threadsafe(conn.send, P.notification("evict_progress", note))

        older_s = None if older is None else float(older)
        n, nbytes = await self.store.evict_async(fp, older_s, progress=progress)  # unlinks: a worker
        # the one trace in the daemon's log of what an operator's `spilld evict` removed, and who asked (found in
        # review: none, and the command's connection is said at info only the first time its name connects)
        log.info(
            "client %d (%s) evicted %d entries (%d bytes)", conn.id, conn.client_name, n, nbytes,
            extra={"client": conn.id, "fingerprint": fp, "older_than_s": older_s, "evicted": n, "bytes": nbytes},
        )  # fmt: skip
        return {"evicted": n, "bytes": nbytes}

    async def _status(self, conn: Connection, p: dict[str, Any], msgid: int) -> dict[str, Any]:
        return self.status(asker=conn)

    async def _shutdown(self, conn: Connection, p: dict[str, Any], msgid: int) -> dict[str, Any]:
        if not self.stopping.is_set():  # why the daemon stops, as for a signal (found in review: only "stopped")
            log.info(
                "client %d (%s) asked it to stop: stopping (finishing queued work within %.0f s)",
                conn.id, conn.client_name, self.cfg.drain_deadline, extra={"client": conn.id},
            )  # fmt: skip
        self.stopping.set()
        return {"stopping": True}

    def limits(self) -> dict[str, int]:
        """The limits a client must keep to, as hello tells them."""
        return {
            "max_msg": P.MAX_MSG_BYTES,
            "max_payload": P.MAX_PAYLOAD_BYTES,
            "max_inflight_requests": P.MAX_INFLIGHT_REQUESTS,
            "max_open_spills": MAX_OPEN_SPILLS,
            "max_open_tokens": MAX_OPEN_TOKENS,
            "max_open_tensors": MAX_OPEN_TENSORS,
            "max_spill_bytes": self.ingest.max_spill,
        }

    def status(self, asker: Connection | None = None) -> dict[str, Any]:
        """The daemon's counters; ``clients`` leaves out ``asker``, the connection that asks (``spilld status``
        with nobody else connected says 0, not 1)."""
        return {
            "version": __version__,
            "pid": os.getpid(),
            "uptime_s": round(time.monotonic() - self.started, 1),
            "socket": self.cfg.socket,
            "dir": self.cfg.dir,
            "cap": self.cfg.cap,
            "clients": len(self.connections - {asker}),
            "client_errors": self.client_errors,
            "lookups": self.lookups,
            "lookup_bytes": self.looking.held,
            "queue": self.queue.counters(),
            "ingest": self.ingest.counters(sum(len(c.spills) for c in self.connections)),
            "store": self.store.stats(),
            **({"remote": self.remote.counters()} if self.remote is not None else {}),
            **({"warm": dataclasses.asdict(self.readahead.stats)} if self.readahead is not None else {}),
            **({"scrub": dataclasses.asdict(self.scrub.stats)} if self.scrub is not None else {}),
            "restore_seconds": self.restore_seconds.to_wire(),
        }


def _identity(raw: dict[str, Any]) -> fmt.Identity:
    """A request's model identity (its fields checked by ``params``)."""
    return fmt.Identity(**{k: raw.get(k, "") for k in IDENTITY_FIELDS})


def run(cfg: Config) -> int:
    """Run the daemon on uvloop until SIGTERM/SIGINT or a shutdown request, on the socket a service manager
    passed if there is one (raises ``ActivationError`` if what it passed is unusable)."""
    import uvloop

    listener = inherited_listener()  # before anything could start a child: it unsets LISTEN_*
    lock = None
    if listener is None:  # a socket in use is refused before the store's folder is made or scanned
        lock = socket_lock(cfg.socket)
        try:
            claim(cfg.socket, lock)
        except BaseException:
            lock.discard()  # its file goes too if this start made it
            raise

    async def main() -> int:
        code = await Daemon(cfg, listener, claimed=lock).serve()
        # stopped: a signal now changes nothing (found in review: once the loop let its handlers go as it closed,
        # a second signal killed the process, which had logged its exit 0)
        loop = asyncio.get_running_loop()
        for sig in STOP_SIGNALS:
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.remove_signal_handler(sig)
                signal.signal(sig, signal.SIG_IGN)
        return code

    try:
        return int(uvloop.run(main()))
    finally:
        if lock is not None:
            lock.release()
