"""The remote tier: block and manifest bytes shared by every host through Redis (or Valkey, or a Redis Cluster).

It can only make a host faster: every failure is a miss and a counter, never an exception to the caller and
never a wait past its bound. A circuit breaker turns a down or slow server into fast misses; a background task
tries it again. Fetched bytes are returned as they are (decrypted): verifying them is the store's job, which
reports a refusal through ``bad_value``, which removes the value from the server (every value is named by the key of
its content in this host's key space: one that does not verify is right for no one, and while it stays there a
push of the right bytes finds the key taken).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import os
import ssl
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

from redis import exceptions as rx

from ..lease import off_loop
from . import credentials
from . import keys as rkeys
from .breaker import Breaker, State, Work
from .client import MAX_VALUE_BYTES, Client, close_client, make_client, replies_up_to, tls_context
from .config import RemoteConfig
from .crypto import SEALED_OVERHEAD, Sealer
from .errors import DecryptError, RemoteConfigError
from .keys import Kind
from .pushqueue import Push, PushQueue
from .stats import Reason, Stats

log = logging.getLogger("spilld.remote")
T = TypeVar("T")

OFFLOAD_BYTES = 1024**2  # encrypt or decrypt more than this on a worker thread, off the event loop
DRAIN_POLL_S = 0.005  # how often drain() looks at the queue
# GETs per pipeline of a fetch, and pipelines in flight at once. Redis answers a pipeline only once it has copied
# every reply: 32 values of 8 MiB waited 100 ms for their first byte, and a larger one outwaits the socket's
# read timeout. Pipelines of 2 values, 2 at once, came at 1.5 GB/s over loopback against 0.9-1.0 for one of 32.
FETCH_BATCH_KEYS = 2
FETCH_IN_FLIGHT = 2
# EXISTS per probe round trip: 512 took 19-25 ms on a loaded 2-core VM, 2,048 (a 131k-token prompt at B = 64)
# 63-85 ms, past the probe's bound; each batch of a long chain has the whole bound
PROBE_BATCH_KEYS = 256
MAX_EVENT_KEYS = 1024  # block keys per stream entry (64 hex digits each); a longer list takes several entries
# A server that is no longer the primary (a failover behind the same address): it keeps our connections and
# refuses every write; new connections may find the new primary (found in review: pushes failed for good)
NOT_PRIMARY = (rx.ReadOnlyError, rx.MasterDownError)
WRONG_TYPE = "WRONGTYPE"  # how Redis (and Valkey) refuse a command on a key holding another type of value
# A call's bound that fired this late (a share of the bound) was overrun by the loop, not the server: no verdict
LATE_LOOP_SHARE = 0.5


class EventKind(StrEnum):
    """What an event on a namespace's stream says of its blocks: a host stored them, or evicted them; or, with no
    keys, that it holds none of those its earlier events said it held, only those its later ``stored`` events name
    (``reset``: its first event of a namespace in a run, so a disk wiped, or files removed while it was down, is
    no longer taken for blocks it holds)."""

    STORED = "stored"
    EVICTED = "evicted"
    RESET = "reset"


@dataclass(frozen=True)
class _Failed:
    reason: Reason


_EMPTY = _Failed(Reason.BAD_BYTES)  # a read of ``fetch`` that found its key there, holding an empty value


_WORK: contextvars.ContextVar[tuple[Work, ...] | None] = contextvars.ContextVar("spilld_remote_work", default=None)


@contextlib.contextmanager
def one_failure() -> Iterator[None]:
    """The calls made within, and in the tasks started within (each takes a copy of the context), are one piece of
    work: they count one failure at most towards the breaker, however many of them fail (found in review: each
    pipeline of a fill's block reads that timed out counted, so one large fill on a slow link opened the breaker for
    every lookup and push). Pushes offered within belong to it too: the push worker's batches of them count towards
    it (found in review: each timed-out batch of one entry's push counted). A half-open trial's failure still
    counts: it is the breaker's one verdict."""
    token = _WORK.set((Work(),))
    try:
        yield
    finally:
        _WORK.reset(token)


def _work_of(batch: Sequence[Push]) -> tuple[Work, ...] | None:
    """The pieces of work a batch of pushes belongs to (a batch may end one entry's pushes and begin the next's);
    None when one of them was offered outside any: its failure is its own."""
    works: list[Work] = []
    for p in batch:
        if p.work is None:
            return None
        works += [w for w in p.work if w not in works]
    return tuple(works)


class RemoteTier:
    """Probe, fetch and push blocks (and manifests) named by their 32-byte keys, per namespace.

    ``RemoteConfigError`` (a bad URL, a password file open to others, a short key file) is raised here, at
    construction; nothing after it raises for a remote failure.
    """

    def __init__(
        self,
        config: RemoteConfig,
        *,
        environ: Mapping[str, str] = os.environ,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        config.check()
        self.config = config
        self._password = credentials.password(config.password_file, environ)
        if (tls_key := config.tls_key_file) is not None:  # a secret as the password is (found in review: any file)
            credentials.check_private_file(tls_key, "the TLS client key file")
        self._sealer = Sealer.from_file(config.key_file) if config.key_file else None
        self.key_tag = self._sealer.tag if self._sealer is not None else None  # names its sealed space (keys.py)
        self.breaker = Breaker(config.breaker_threshold, config.breaker_cooldown_s, clock)
        # one call a connection of the pool: a call waits for one (within its bound) rather than fail at once
        # with the pool's error, which read as the server failing (found in review: 100 probes at once opened
        # the breaker of a healthy server)
        self._slots = asyncio.Semaphore(config.max_connections)
        self.queue = PushQueue(config.queue_items, config.queue_bytes)
        self.stats = Stats()
        self._client: Client | None = None
        self._tls: ssl.SSLContext | None = None  # one per tier, for every connection (rediss:// only)
        self._disabled: str | None = None  # why, once the server refused our credentials
        self._tasks: list[asyncio.Task[None]] = []
        self._busy = 0  # pushes taken by the worker and not finished
        self._closing: set[asyncio.Task[None]] = set()  # old clients being closed
        self._removing: set[asyncio.Task[None]] = set()  # bad values being removed from the server

    # --- life ---------------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Connect (within ``trial_bound_s``) and start the push worker and the reconnection task.

        A server that cannot be reached leaves the breaker open (the tier retries in the background); one that
        refuses the password, or TLS settings that cannot be used (a missing CA file), disable the tier, with one
        log line.
        """
        try:
            self._tls = await off_loop(lambda: tls_context(self.config, self._password), compute=True)
        except (OSError, ValueError, rx.RedisError) as e:  # a CA file missing or not one, a bad ssl_cert_reqs
            self._disable(f"its TLS settings cannot be used ({e})")
        try:
            self._client = make_client(self.config, self._password, self._tls)
        except (ValueError, rx.RedisError) as e:  # settings the client refuses: the daemon serves without the tier
            self._disable(f"its client cannot be made ({e})")
        if isinstance(await self._call(_ping, self.config.trial_bound_s), _Failed) and not self._disabled:
            self.breaker.trip()
            log.warning("remote tier %s unreachable; misses until it answers", self._where())
        self._tasks = [asyncio.create_task(self._push_worker()), asyncio.create_task(self._health_loop())]

    async def close(self) -> None:
        """Stop the tasks (waiting pushes are dropped) and close the connections."""
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []
        for t in list(self._removing):
            t.cancel()
        for t in list(self._closing | self._removing):
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self.queue.clear()
        client, self._client = self._client, None
        if client is not None:
            with contextlib.suppress(Exception):
                await close_client(client)

    async def drain(self, timeout_s: float) -> bool:
        """Wait until every offered push is done (written or failed); False if ``timeout_s`` passed first."""
        deadline = time.monotonic() + timeout_s
        while len(self.queue) or self._busy:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(DRAIN_POLL_S)
        return True

    @property
    def state(self) -> str:
        """``disabled``, ``stopped`` (not started or closed), else the breaker's state."""
        if self._disabled:
            return "disabled"
        if self._client is None:
            return "stopped"
        return self.breaker.state.value

    @property
    def taking_pushes(self) -> bool:
        """Whether ``offer`` may queue now (not disabled, not stopped, the breaker not open)."""
        return self.state not in ("disabled", "stopped", State.OPEN.value)

    # --- lookups ------------------------------------------------------------------------------------------

    async def probe_chain(
        self, namespace: str, keys: Sequence[bytes], start: int = 0, why: list[Reason] | None = None
    ) -> int:
        """How many of ``keys`` (a chain, in order) exist from the first on, the first ``start`` taken as there
        (the caller holds them): pipelined EXISTS of ``PROBE_BATCH_KEYS`` keys a round trip, each bounded by
        ``probe_timeout_s`` (a long prompt's chain gets a bound per batch, not one for all), until a batch finds
        one missing. On a failure, what the batches before it found; ``start`` when none found more. ``why``, if
        given, gets the failure's reason (nothing when the chain was read to its first gap or its end)."""
        found = start
        failed: Reason | None = None
        while found < len(keys):
            batch = keys[found : found + PROBE_BATCH_KEYS]
            r = await self._call(
                _pipeline([_cmd("exists", rkeys.block_key(namespace, k, self.key_tag)) for k in batch]),
                self.config.probe_timeout_s,
            )
            if isinstance(r, _Failed):
                failed = r.reason
                break
            found += (n := _leading_ones(r))
            if n < len(batch):
                if isinstance(r[n], Exception):  # that key's command failed (an ACL, a cluster node): not absent
                    failed = _reason_of(r[n])
                break
        self.stats.probes += 1
        self.stats.probe_blocks_found += found - start
        if failed is not None:
            self.stats.misses[failed] += 1
            if why is not None:
                why.append(failed)
        elif found == start and keys:
            self.stats.misses[Reason.ABSENT] += 1
        return found

    async def fetch(
        self,
        namespace: str,
        keys: Sequence[bytes],
        kind: Kind = Kind.BLOCK,
        max_bytes: int | None = None,
        why: list[Reason | None] | None = None,
        timeout_s: float | None = None,
    ) -> list[bytes | None]:
        """The values of ``keys`` (None for each one absent, undecryptable, lost, empty, or larger than ``max_bytes``
        of plaintext), through pipelines of ``FETCH_BATCH_KEYS`` reads, ``FETCH_IN_FLIGHT`` at once, each bounded
        by ``timeout_s`` (default ``fetch_timeout_s``, sized for blocks); with a TTL, each one found has its TTL
        refreshed. With ``max_bytes`` a read takes at most one byte more than that (GETRANGE): a value someone made
        larger is never read whole. ``why``, if given, gets a reason per key: None for a value, else why there is
        none (absent, or a failed read)."""
        if not keys:
            return []
        names = [rkeys.value_key(namespace, k, kind, self.key_tag) for k in keys]
        limit = None if max_bytes is None else max_bytes + (SEALED_OVERHEAD if self._sealer is not None else 0)
        cmds, stride = self._reads(names, limit)
        slots = asyncio.Semaphore(FETCH_IN_FLIGHT)
        per = FETCH_BATCH_KEYS * stride
        bound = self.config.fetch_timeout_s if timeout_s is None else timeout_s

        async def batch(lo: int) -> list[Any]:
            async with slots:
                r = await self._call(_pipeline(cmds[lo : lo + per]), bound)
            if isinstance(r, _Failed):
                return [r] * (min(per, len(cmds) - lo) // stride)
            read, there = (r[1::2], r[::2]) if stride == 2 else (r, [int(v is not None) for v in r])  # (GET: None)
            return [
                _EMPTY if isinstance(v, bytes) and not v and n == 1 else v for v, n in zip(read, there, strict=True)
            ]

        with replies_up_to(MAX_VALUE_BYTES if limit is None else limit + 1):  # (GETRANGE: one byte past)
            got = await asyncio.gather(*(batch(lo) for lo in range(0, len(cmds), per)))
        r = [v for part in got for v in part]
        values = [v if isinstance(v, bytes) and v and (limit is None or len(v) <= limit) else None for v in r]
        self._remove_later([n for n, v in zip(names, r, strict=True) if _wrong_for_all(v, kind, limit)])
        reasons = [_read_failure(v, limit) for v in r]
        for reason in reasons:
            if reason is not None:
                self.stats.misses[reason] += 1
        out = await self._open_all(namespace, keys, values, kind)
        for i, v in enumerate(out):
            if v is not None:
                self.stats.hits += 1
                self.stats.bytes_fetched += len(v)
            elif reasons[i] is None:  # read, then refused by the key (counted by ``_open_all``)
                reasons[i] = Reason.DECRYPT
        if why is not None:
            why[:] = reasons
        return out

    def _reads(self, names: list[str], limit: int | None) -> tuple[list[_Cmd], int]:
        """The commands that read ``names`` (a TTL refreshed as they are read), each at most ``limit`` bytes and one
        more (so that a larger value is seen to be larger), and how many commands there are a name."""
        ttl = self.config.ttl_s
        if limit is None:
            return [_cmd("get", n) if ttl is None else _cmd("getex", n, ex=ttl) for n in names], 1
        # GETRANGE's end is inclusive: limit + 1 bytes at most. It reads a key not there as empty: before it, what
        # says whether the key is there (EXISTS, or the EXPIRE that renews it), so that an empty value is told apart
        # (asked first: a key written between the two is never taken for an empty one)
        there = (lambda n: _cmd("exists", n)) if ttl is None else (lambda n: _cmd("expire", n, ttl))
        return [c for n in names for c in (there(n), _cmd("getrange", n, 0, limit))], 2

    def bad_value(self, namespace: str, key: bytes, kind: Kind = Kind.BLOCK, remove: bool = True) -> None:
        """The caller refused the value ``fetch`` gave for ``key`` (wrong bytes under it): counted as a miss, and
        unless ``remove`` is False (bytes of a newer writer, not wrong ones), removed from the server in the
        background (best effort, once)."""
        self.stats.refused += 1  # (fetch counted it a hit before it was checked: a counter never goes back)
        self.stats.misses[Reason.BAD_BYTES] += 1
        if remove:
            self._remove_later([rkeys.value_key(namespace, key, kind, self.key_tag)])

    def _remove_later(self, names: list[str]) -> None:
        if not names:
            return

        async def remove() -> None:
            r = await self._call(_pipeline([_cmd("delete", n) for n in names]), self.config.push_timeout_s)
            if not isinstance(r, _Failed):
                self.stats.bad_removed += sum(1 for x in r if x == 1)

        task = asyncio.get_running_loop().create_task(remove())
        self._removing.add(task)
        task.add_done_callback(self._removing.discard)

    # --- pushes -------------------------------------------------------------------------------------------

    def offer(self, namespace: str, key: bytes, data: bytes, kind: Kind = Kind.BLOCK) -> bool:
        """Queue a push for the background worker; never waits. When the queue is full the oldest pushes are
        dropped (counted). False, at once, while the tier is disabled, stopped or its breaker open."""
        rkeys.value_key(namespace, key, kind, self.key_tag)  # a malformed key is the caller's bug: say so now
        if not self.taking_pushes or not self.queue.offer(Push(namespace, key, data, kind, _WORK.get())):
            self.stats.offers_refused += 1
            return False
        return True

    async def offer_in_turn(self, namespace: str, key: bytes, data: bytes, kind: Kind = Kind.BLOCK) -> bool:
        """``offer`` that waits for room instead of dropping older pushes: for a producer that can wait and whose
        pushes are useful only together (an entry's chain: a block dropped from its middle makes the rest
        unreachable). False, as soon as it is so, once the tier is not taking pushes."""
        while self.taking_pushes and not self.queue.fits(len(data)):
            await self.queue.room()
        return self.offer(namespace, key, data, kind)

    async def absent(self, namespace: str, keys: Sequence[bytes]) -> list[bytes] | None:
        """Which of the blocks ``keys`` the tier neither holds nor has a push of under way (pipelined EXISTS,
        ``PROBE_BATCH_KEYS`` a round trip, each bounded by ``push_timeout_s``); None if the tier could not say
        (those keys counted in ``push_failed``). Those it holds count in ``push_present``. With a TTL, EXPIRE
        asks instead, and renews those it holds: an entry that names them is a use of them (found in review:
        shared leading blocks, never pushed again, expired before the manifests that name them)."""
        asked = [k for k in keys if not self.queue.pending(namespace, k)]
        ttl = self.config.ttl_s
        out: list[bytes] = []
        for lo in range(0, len(asked), PROBE_BATCH_KEYS):
            batch = asked[lo : lo + PROBE_BATCH_KEYS]
            names = [rkeys.block_key(namespace, k, self.key_tag) for k in batch]
            r = await self._call(
                _pipeline([_cmd("exists", n) if ttl is None else _cmd("expire", n, ttl) for n in names]),
                self.config.push_timeout_s,
            )
            failed = (
                r.reason
                if isinstance(r, _Failed)
                else next((_reason_of(x) for x in r if isinstance(x, Exception)), None)
            )
            if failed is not None:
                self.stats.push_failed[failed] += len(asked) - lo
                return None
            assert not isinstance(r, _Failed)
            out += [k for k, there in zip(batch, r, strict=True) if there != 1]
            self.stats.push_present += sum(1 for there in r if there == 1)
        return out

    async def push(self, namespace: str, key: bytes, data: bytes, kind: Kind = Kind.BLOCK) -> bool:
        """Write one value if its key is absent (EXISTS, then SET NX, with the tier's TTL): True if written."""
        return (await self._push_batch([Push(namespace, key, data, kind, _WORK.get())]))[0]

    async def _push_worker(self) -> None:
        while True:
            batch = await self.queue.take(self.config.push_batch, self.config.push_batch_bytes)
            self._busy = len(batch)
            token = _WORK.set(_work_of(batch))  # its calls count towards the work its pushes were offered in
            try:
                await self._push_batch(batch)
            except Exception:  # a bug here must not end the worker: the pushes are lost, the tier lives
                log.exception("remote push worker")
                self.stats.push_failed[Reason.REFUSED] += len(batch)
            finally:
                _WORK.reset(token)
                self._busy = 0
                self.queue.done(batch)

    async def _push_batch(self, batch: Sequence[Push]) -> list[bool]:
        """Probe the batch's keys, then write the absent ones: shared prefixes cross the network once."""
        names = [rkeys.value_key(p.namespace, p.key, p.kind, self.key_tag) for p in batch]
        timeout_s = self.config.push_timeout_s
        present = await self._call(_pipeline([_cmd("exists", n) for n in names]), timeout_s)
        if isinstance(present, _Failed):
            self.stats.push_failed[present.reason] += len(batch)
            return [False] * len(batch)
        # a block's reference names the newest manifest that names the block: written over the one there (which
        # may name a manifest gone: found in review, prompts ending in a shared prefix then missed for good); a
        # space's root is the newest layout's (found in review: the first one pushed, kept by every push after,
        # left a layout of a newer codec version unreachable for good)
        over = [p.kind in (Kind.REF, Kind.ROOT) for p in batch]
        todo = [i for i, r in enumerate(present) if r != 1 or over[i]]
        self.stats.push_present += len(batch) - len(todo)
        sealed = await self._seal_all([batch[i] for i in todo])
        ttl = self.config.ttl_s
        cmds = [_cmd("set", names[i], v, nx=not over[i], ex=ttl) for i, v in zip(todo, sealed, strict=True)]
        if ttl is not None:  # a push of a value already there is a use of it: its TTL starts again
            cmds += [_cmd("expire", names[i], ttl) for i, r in enumerate(present) if r == 1 and not over[i]]
        written = await self._call(_pipeline(cmds), timeout_s) if cmds else []
        return self._count_writes(len(batch), todo, sealed, written)

    def _count_writes(self, n: int, todo: list[int], sealed: list[bytes], written: list[Any] | _Failed) -> list[bool]:
        out = [False] * n
        if isinstance(written, _Failed):
            self.stats.push_failed[written.reason] += len(todo)
            return out
        for i, v, r in zip(todo, sealed, written, strict=False):
            if isinstance(r, Exception):
                self.stats.push_failed[_reason_of(r)] += 1
            elif r:
                out[i] = True
                self.stats.pushed += 1
                self.stats.bytes_pushed += len(v)
            else:  # SET NX found it: another host wrote it between our probe and our write
                self.stats.push_present += 1
        return out

    # --- events -------------------------------------------------------------------------------------------

    async def publish_event(
        self, kind: EventKind, namespace: str, keys: Sequence[bytes], host: str, why: list[Reason] | None = None
    ) -> bool:
        """Tell routers that ``host`` now holds (or no longer holds) the blocks ``keys`` of ``namespace`` (``reset``:
        none of those it was said to hold before, no keys): one XADD per ``MAX_EVENT_KEYS`` keys on the namespace's
        stream, trimmed to about ``events_maxlen``. Fields: ``kind``, ``ns`` (the namespace tag), ``host``, ``keys``
        (hex, comma separated; empty for a reset), ``t_ms``. A reset makes no stream (``NOMKSTREAM``): a namespace
        without one holds no claim to withdraw, and a lookup of any namespace a client names may send one. ``why``,
        if given, gets the failure's reason."""
        stream = rkeys.events_key(namespace, self.key_tag)
        t_ms = str(int(time.time() * 1000))
        cmds = []
        only_to = {"nomkstream": True} if kind is EventKind.RESET else {}  # (a stream that is there)
        for lo in range(0, max(len(keys), 1), MAX_EVENT_KEYS):
            fields = {"kind": str(kind), "ns": rkeys.namespace_tag(namespace, self.key_tag), "host": host, "t_ms": t_ms}
            fields["keys"] = ",".join(k.hex() for k in keys[lo : lo + MAX_EVENT_KEYS])
            cmds.append(_cmd("xadd", stream, fields, maxlen=self.config.events_maxlen, approximate=True, **only_to))
        r = await self._call(_pipeline(cmds), self.config.push_timeout_s)
        if isinstance(r, _Failed):
            failed: Reason | None = r.reason
        else:  # a command's own error is in its place (a reset with no stream to go to: nil, nothing appended)
            failed = next((_reason_of(x) for x in r if isinstance(x, Exception)), None)
            if failed is None:
                self.stats.events_published += sum(x is not None for x in r)
        if failed is not None:
            self.stats.events_failed += len(cmds)
            if why is not None:
                why.append(failed)
        return failed is None

    # --- status -------------------------------------------------------------------------------------------

    def counters(self) -> dict[str, Any]:
        """Everything ``spilld status`` shows of the remote tier."""
        out = self.stats.as_dict()
        out["state"] = self.state
        out["disabled_reason"] = self._disabled
        out["breaker_opened"] = self.breaker.entered[State.OPEN]
        out["queue"] = {
            "len": len(self.queue),
            "bytes": self.queue.nbytes,
            "dropped": self.queue.dropped,
            "refused": self.queue.refused,
        }
        out["encrypted"] = self._sealer is not None
        return out

    # --- the one way to the server --------------------------------------------------------------------------

    async def _call(self, op: Callable[[Client], Awaitable[T]], timeout_s: float) -> T | _Failed:
        """Run ``op`` if the breaker lets it, within ``timeout_s``; every failure becomes a reason."""
        client = self._client
        trial = self.breaker.trial_free  # this call takes the half-open trial if it is let through now
        if self._disabled or client is None or not self.breaker.allow():
            return _Failed(Reason.DOWN)
        # no verdict: the trial given back if this call holds it, never another's (found in review: a late reply
        # let a second trial through beside one still running)
        no_verdict = self.breaker.abandon if trial else _nothing
        asked = False  # the call reached the server (not only waited for a connection)
        loop, password = asyncio.get_running_loop(), self._password
        try:
            async with asyncio.timeout(timeout_s):  # a connection of the pool, within the bound: no verdict if not
                await self._slots.acquire()
            try:
                asked, due = True, loop.time() + timeout_s
                async with asyncio.timeout(timeout_s):  # the call's own bound, from when it has its connection
                    result = await op(client)
            finally:
                self._slots.release()
        except asyncio.CancelledError:  # (a fill gave up on the batch it fetched ahead)
            no_verdict()
            raise
        except rx.AuthenticationError as e:
            if await self._password_rotated(password):
                no_verdict()  # the next call tries it
            else:
                self._disable(self._auth_problem(e))
            return _Failed(Reason.DOWN)
        except (TimeoutError, rx.TimeoutError, rx.MaxConnectionsError) as e:
            # every connection busy, or a bound the loop itself overran (a large reply parsed on it held it past
            # the deadline: the server may have answered in time; found in review), is no verdict on the server
            late = asked and loop.time() - due > timeout_s * LATE_LOOP_SHARE
            if asked and not late and not isinstance(e, rx.MaxConnectionsError):
                self._failed(trial)
            else:
                no_verdict()
            return _Failed(Reason.TIMEOUT)
        except (rx.ConnectionError, rx.ClusterError, rx.RedisClusterException, rx.InvalidResponse, OSError):
            # (InvalidResponse: a reply declared longer than allowed: its connection went.) On connections left
            # already (closed by the renewal itself) no verdict on the new ones (found in review: it reopened a
            # half-open breaker, a cooldown more of misses)
            if client is self._client:
                self._failed(trial)
            else:
                no_verdict()
            return _Failed(Reason.DOWN)
        except NOT_PRIMARY:
            self._not_primary(client, no_verdict)
            return _Failed(Reason.DOWN)
        except rx.ResponseError as e:  # the server answered: it is up, it said no
            self.breaker.success()
            return _Failed(_reason_of(e))
        except Exception:
            log.exception("remote tier: unexpected failure")
            self.breaker.failure()
            return _Failed(Reason.DOWN)
        if isinstance(result, list) and any(isinstance(r, NOT_PRIMARY) for r in result):  # inside a pipeline
            self._not_primary(client, no_verdict)
        else:
            self.breaker.success()
        return result

    def _failed(self, trial: bool) -> None:
        """A call failed for want of the server: a failure for the breaker, unless every piece of work it was made
        for (``one_failure``; a batch of pushes may serve several) counted one already and this one is not the
        half-open trial."""
        works = _WORK.get()
        if trial or works is None or not all(w.failed for w in works):
            self.breaker.failure()
        for w in works or ():
            w.failed = True

    def _not_primary(self, client: Client, no_verdict: Callable[[], None]) -> None:
        """The server refused a write as a replica: open the breaker (every call misses at once meanwhile) and
        leave ``client``'s connections now, so that whichever call takes the next trial runs on new ones, which
        may reach the new primary (found in review: a lookup's probe took the trial on the old connections, read
        from the demoted replica, and closed the breaker; the next write failed again, and so on)."""
        if client is not self._client:  # a reply on connections left already: no word on the new ones
            no_verdict()
            return
        if self.breaker.state is not State.OPEN:
            log.warning("remote tier %s is not a primary (read-only); reconnecting", self._where())
        self.breaker.trip()
        self._renew_client()

    def _disable(self, why: str) -> None:
        if self._disabled is None:
            self._disabled = why
            dropped = self.queue.clear()
            log.error("remote tier %s disabled: %s; the local tier serves alone", self._where(), why)
            self.stats.push_failed[Reason.DOWN] += dropped

    async def _health_loop(self) -> None:
        """While the breaker is open, try the server once per cooldown (on a new client: the old connections
        may be half-dead); a PING that answers closes the breaker."""
        while not self._disabled:
            await asyncio.sleep(self.config.health_interval_s)
            if not self.breaker.trial_free:  # closed, still open, or a call has the trial: its client stays
                continue
            self._renew_client()
            if not isinstance(await self._call(_ping, self.config.trial_bound_s), _Failed):
                log.info("remote tier %s answers again", self._where())

    async def _password_rotated(self, refused: str | None) -> bool:
        """The server refused password ``refused``: a password file that now holds another one (a rotation: the
        file rewritten, then the old password removed) is taken, on new connections; True too when another call
        took it meanwhile. False: none to take (found in review: a rotation disabled the tier until a restart)."""
        path = self.config.password_file
        if path is None:
            return False
        if self._password != refused:  # another call found the rotation first (calls fail together)
            return True
        try:
            new = await off_loop(lambda: credentials.password(path, {}))
        except RemoteConfigError as exc:  # gone, or no longer private: the refusal stands
            log.warning("remote tier: the password file could not be read again: %s", exc)
            return False
        if self._password != refused:
            return True
        if new == refused:
            return False
        log.warning("remote tier %s refused the password; taking the new one in %s", self._where(), path)
        self._password = new
        self._renew_client()
        return True

    def _renew_client(self) -> None:
        """New connections from now on; the old client closed aside (a socket to a hung server may take its
        timeout to close)."""
        old, self._client = self._client, make_client(self.config, self._password, self._tls)
        if old is not None:
            task = asyncio.create_task(_close_quietly(old))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def _auth_problem(self, e: Exception) -> str:
        if self._password is None:
            return f"the server requires a password: set ${credentials.PASSWORD_ENV} or a password file (it said: {e})"
        return f"the server refused the password (it said: {e})"

    def _where(self) -> str:
        return self.config.url

    # --- encryption, off the loop when large ------------------------------------------------------------------

    async def _seal_all(self, pushes: Sequence[Push]) -> list[bytes]:
        sealer = self._sealer
        if sealer is None:
            return [p.data for p in pushes]

        def run() -> list[bytes]:
            return [sealer.seal(p.namespace, p.key, p.data, p.kind) for p in pushes]

        return await _maybe_thread(run, sum(len(p.data) for p in pushes))

    async def _open_all(
        self, namespace: str, keys: Sequence[bytes], values: list[bytes | None], kind: Kind
    ) -> list[bytes | None]:
        sealer = self._sealer
        if sealer is None:
            return values

        def one(key: bytes, v: bytes | None) -> bytes | DecryptError | None:
            if v is None:
                return None
            try:
                return sealer.open(namespace, key, v, kind)
            except DecryptError as e:
                return e

        def run() -> list[bytes | DecryptError | None]:  # perhaps on a worker thread: counts nothing itself
            return [one(k, v) for k, v in zip(keys, values, strict=True)]

        opened = await _maybe_thread(run, sum(len(v) for v in values if v is not None))
        bad = [k for k, v in zip(keys, opened, strict=True) if isinstance(v, DecryptError)]
        self.stats.misses[Reason.DECRYPT] += len(bad)
        self._remove_later([rkeys.value_key(namespace, k, kind, self.key_tag) for k in bad])  # tampered with
        return [None if isinstance(v, DecryptError) else v for v in opened]


def _wrong_for_all(v: Any, kind: Kind, limit: int | None) -> bool:
    """What one read of ``fetch`` found is wrong whoever reads it: a key of another type (a read of it is refused,
    and every push finds the key taken: found in review, a list under a block's key blocked the prefix for the
    whole fleet), an empty value (read as absent, and the key taken all the same: found in the same review), or a
    root or a reference (of a fixed size) longer than one."""
    if v is _EMPTY:
        return True
    if isinstance(v, rx.ResponseError):
        return str(v).startswith(WRONG_TYPE)
    return kind in (Kind.ROOT, Kind.REF) and isinstance(v, bytes) and limit is not None and len(v) > limit


def _read_failure(v: Any, limit: int | None) -> Reason | None:
    """Why one read of ``fetch`` gave no value (None: it gave one)."""
    if isinstance(v, _Failed):  # its whole pipeline failed, or its value was empty (``_EMPTY``)
        return v.reason
    if isinstance(v, Exception):
        return _reason_of(v)
    if not v:  # (GETRANGE reads a missing key as empty: no value is)
        return Reason.ABSENT
    if limit is not None and isinstance(v, bytes) and len(v) > limit:
        return Reason.BAD_BYTES
    return None


async def _maybe_thread(fn: Callable[[], T], nbytes: int) -> T:
    return await off_loop(fn, background=True) if nbytes > OFFLOAD_BYTES else fn()


def _nothing() -> None:
    pass


async def _ping(c: Client) -> Any:
    return await c.ping()


_Cmd = tuple[str, tuple[Any, ...], dict[str, Any]]


def _cmd(name: str, *args: Any, **kwargs: Any) -> _Cmd:
    return name, args, kwargs


def _pipeline(cmds: Sequence[_Cmd]) -> Callable[[Client], Awaitable[list[Any]]]:
    """One round trip (per node, in a cluster) of ``cmds``; a command's own error is returned in its place."""

    async def run(c: Client) -> list[Any]:
        pipe = c.pipeline(transaction=False)
        for name, args, kwargs in cmds:
            getattr(pipe, name)(*args, **kwargs)
        return await pipe.execute(raise_on_error=False)

    return run


async def _close_quietly(client: Client) -> None:
    with contextlib.suppress(Exception):
        await close_client(client)


def _leading_ones(results: Sequence[Any]) -> int:
    n = 0
    for r in results:
        if r != 1:  # 0, or an exception in its place
            break
        n += 1
    return n


def _reason_of(e: BaseException) -> Reason:
    if isinstance(e, rx.OutOfMemoryError) or str(e).startswith("OOM"):
        return Reason.OOM
    if isinstance(e, (rx.ConnectionError, rx.ClusterError, *NOT_PRIMARY)):
        return Reason.DOWN
    if isinstance(e, (TimeoutError, rx.TimeoutError)):
        return Reason.TIMEOUT
    return Reason.REFUSED
