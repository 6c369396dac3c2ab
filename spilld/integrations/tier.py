"""A synchronous cold tier for engines that decode in a thread: embedded, or through the daemon.

Both kinds answer the same three calls from the engine's thread: ``spill`` (clone
now, write behind; a future of the outcome), ``load`` (the longest usable prefix,
or None) and ``close``. ``spill`` and ``load`` never raise into the engine: a
failure is logged, and the engine goes on as if the tier missed. Token ids
outside u32 (e.g. image placeholders) are never stored or looked up.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import numpy as np

from .. import errors
from .. import format as fmt
from ..client import Client
from ..config import default_socket
from ..daemon.listen import is_served
from ..lease import RunStep
from ..loader import Loaded
from ..loopthread import LoopThread
from ..queue import DrainReport, Outcome, Settled
from ..saver import token_ids_now
from ..snapshot import Handoffs
from ..spiller import Spiller

log = logging.getLogger("spilld.tier")

RECONNECT_INTERVAL_S = 5.0  # how often an engine retries an unreachable daemon, or asks again after a hung one
PROBE_S = 0.5  # after a lost connection, how long the check that the daemon is still away may wait (a connect)


class ColdTier(Protocol):
    def spill(
        self,
        tokens: Sequence[int],
        caches: Sequence[Any],
        *,
        droppable: bool = True,
        behind: concurrent.futures.Future[Settled] | None = None,
    ) -> concurrent.futures.Future[Settled]:
        """``behind``: the future of this tier's droppable spill of the same entry (a write-behind). A tier that can
        keeps that one while it is queued (embedded, or not shipped yet to the daemon), instead of queueing this
        spill too; one being written or shipped stands for this spill once stored (this one is written only if that
        one ends otherwise)."""
        ...

    def load(self, tokens: Sequence[int], *, longer_than: int = 0) -> Loaded | None: ...

    def close(self, timeout: float | None = None) -> DrainReport | None: ...  # None: nothing to report


def storable(tokens: Sequence[int]) -> bool:
    """Token ids a file can hold (u32), at least one (a file of none serves no prompt); engines use negative ids for
    image placeholders. Read as an array, on the engine's thread (found in review: an mlx int32 array's ids compared
    with 2**32 raised ValueError into the engine); a lazy mlx array is evaluated here, where the loop's thread that
    loads it later could not."""
    ids = np.asarray(token_ids_now(tokens))
    return ids.size > 0 and ids.dtype.kind in "iu" and int(ids.min()) >= 0 and int(ids.max()) < 1 << 32


def settled_now(outcome: Outcome, error: BaseException | None = None) -> concurrent.futures.Future[Settled]:
    """A future already settled, for spills that never reached a queue."""
    f: concurrent.futures.Future[Settled] = concurrent.futures.Future()
    f.set_result(Settled(outcome, error=error))
    return f


def guarded_spill(spill: Callable[[], Any], tokens: Sequence[int]) -> concurrent.futures.Future[Settled]:
    if not storable(tokens):
        return settled_now(Outcome.CANCELLED)
    try:
        f = spill()
    except Exception as exc:  # e.g. a cache class no codec knows: the engine must go on
        log.warning("spill refused: %s", exc)
        return settled_now(Outcome.FAILED, exc)
    assert isinstance(f, concurrent.futures.Future)  # called from the engine's thread
    return f


def guarded_load(load: Callable[[], Loaded | None], tokens: Sequence[int]) -> Loaded | None:
    if not storable(tokens):
        return None
    try:
        return load()
    except Exception as exc:  # a restore is an optimization: any failure is a miss
        log.warning("cold-tier load failed: %s", exc)
        return None


MAX_QUIET_S = 300.0  # the longest a tier that keeps timing out goes unasked


class Backoff:
    """After a load that timed out (a lookup a hung daemon did not answer, a read a hung disk did not finish): no
    load for ``RECONNECT_INTERVAL_S``, doubled at each timeout in a row up to ``MAX_QUIET_S``, since each would
    block the engine's thread as long again; a load that answers in time ends it."""

    def __init__(self) -> None:
        self._quiet_until = 0.0
        self._quiet_s = RECONNECT_INTERVAL_S

    def load(self, load: Callable[[], Loaded | None], tokens: Sequence[int]) -> Loaded | None:
        if time.monotonic() < self._quiet_until:
            return None

        def timed() -> Loaded | None:
            try:
                got = load()
            except (errors.Timeout, errors.StorageTimeout) as exc:
                self._quiet_until = time.monotonic() + self._quiet_s
                self._quiet_s = min(2 * self._quiet_s, MAX_QUIET_S)
                log.warning(
                    "the cold tier did not answer in time (%s); lookups skipped for %.0f s",
                    exc,
                    self._quiet_until - time.monotonic(),
                )
                raise
            self._quiet_s = RECONNECT_INTERVAL_S
            return got

        return guarded_load(timed, tokens)


class EmbeddedTier:
    """A ``Spiller`` on a private event-loop thread: no daemon, the engine's process writes the files.

    Made with ``identity`` None, the folder is opened (scanned) now and the identity is given later by ``bind``:
    until then every spill is refused and every lookup misses (mlx-lm's server opens its folder at start, before
    the model it serves is loaded)."""

    def __init__(
        self, folder: str, identity: fmt.Identity | None, *, lease: RunStep | None = None, **kwargs: Any
    ) -> None:
        self._bound = identity is not None
        ident = identity if identity is not None else fmt.Identity()
        self._lt, self.spiller = LoopThread.start_with(
            "spilld-embedded", lambda lt: lt.run(Spiller.open(folder, identity=ident, lease=lease, **kwargs))
        )
        self._backoff = Backoff()
        # spills handed to the loop: settled cancelled if it stops before it runs them
        self._handoffs = Handoffs.closed_by(self._lt.on_close)

    def _run(self, coro: Any) -> Any:
        return self._lt.run(coro)

    def bind(self, identity: fmt.Identity) -> None:
        """Give a tier made without one its identity, before its first spill or lookup (on the engine's thread)."""
        if self._bound:
            raise errors.BadParams("this tier has its identity already")
        self.spiller.identity = identity
        self._bound = True

    def spill(
        self,
        tokens: Sequence[int],
        caches: Sequence[Any],
        *,
        droppable: bool = True,
        behind: concurrent.futures.Future[Settled] | None = None,
    ) -> concurrent.futures.Future[Settled]:
        """``behind`` still queued (or being written, or stored) stands for this spill; one queued or being written
        whose write fails has this spill written in its place (``Spiller.spill_threadsafe``)."""
        if not self._bound:
            return settled_now(Outcome.CANCELLED)
        return guarded_spill(
            lambda: self._handoffs.track(
                self.spiller.spill_threadsafe(tokens, caches, droppable=droppable, behind=behind)
            ),
            tokens,
        )

    def load(self, tokens: Sequence[int], *, longer_than: int = 0) -> Loaded | None:
        if not self._bound:
            return None
        return self._backoff.load(lambda: self._run(self.spiller.load(tokens, longer_than=longer_than)), tokens)

    def stats(self) -> dict[str, Any]:
        return self.spiller.stats()

    def status(self, timeout: float) -> dict[str, Any] | None:
        """``stats`` from another thread (the metrics file's): read on the tier's loop, where they change (a read
        beside it may find a map changing size), waited for ``timeout`` at most; None if the loop did not answer by
        then (busy, or stopping). Once the tier is closed they are read here: nothing changes them any more."""
        if self._lt.loop.is_closed():
            return self.stats()
        try:
            return self._lt.run(self.spiller.status(), timeout)
        except (TimeoutError, concurrent.futures.CancelledError, errors.Closed):
            return None

    def close(self, timeout: float | None = None) -> DrainReport | None:
        """Drain (up to ``timeout``) and close; the drain's report, None when it cannot be waited for here."""
        if self._lt.on_own_thread:  # a spill future's callback: the close runs once it returns (none can be waited)
            self._lt.stop(first=self.spiller.close(timeout))
            return None
        try:
            return self._run(self.spiller.close(timeout))
        except concurrent.futures.CancelledError:  # a close from the loop's own thread runs it: stop waits for it
            return None
        finally:
            self._lt.stop(wait=timeout)  # (as long as this close may take: the caller may hold the engine's lock)


class DaemonTier:
    """The daemon's client, connected lazily: an unreachable daemon is a miss, retried now and then."""

    def __init__(self, socket_path: str | None, identity: fmt.Identity, **kwargs: Any) -> None:
        self.socket_path = socket_path
        self.identity = identity
        self.kwargs = kwargs
        self._client: Client | None = None
        self._next_try = 0.0
        self._retry_s = RECONNECT_INTERVAL_S  # doubled at each failed try in a row, up to MAX_QUIET_S
        self._check: BaseException | None = None  # why a call failed for the lost connection: the next call asks
        # whether the daemon is away
        self._backoff = Backoff()
        self._connect()

    def retry_now(self) -> None:
        """The next call tries the daemon again, whatever the wait since the last failed try (the exit's spills)."""
        self._next_try, self._check = 0.0, None

    def _connect(self) -> Client | None:
        if (lost := self._check) is not None:
            self._check = None
            self._away(lost)
        if time.monotonic() < self._next_try:  # unreachable at the last try, or lost since: not asked yet
            return None
        if self._client is not None:
            return self._client
        try:  # on the engine's thread: a daemon that accepts and never answers holds it CONNECT_TIMEOUT_S a try
            self._client = Client(self.socket_path, identity=self.identity, **self.kwargs)
        except errors.SpillError as exc:
            self._wait_out(exc, self._retry_s)
            # a daemon that answered nothing in time costs each try a wait: tried less and less often; one that
            # is not there (not started yet, restarting) costs nothing: tried every RECONNECT_INTERVAL_S
            hung = isinstance(exc, errors.Timeout)
            self._retry_s = min(2 * self._retry_s, MAX_QUIET_S) if hung else RECONNECT_INTERVAL_S
        else:
            self._retry_s = RECONNECT_INTERVAL_S
        return self._client

    def _lost(self, exc: BaseException | None) -> None:
        """A call failed for the connection (the daemon stopped, crashed, restarted): the next call first asks
        whether the daemon is away (``_away``). Not here: a spill's outcome arrives on the client's loop thread."""
        if isinstance(exc, errors.ConnectionLost) and not isinstance(exc, errors.Closed):  # (closed: our exit)
            self._check = exc

    def _away(self, lost: BaseException) -> None:
        """A daemon that accepts no connection now is not asked again for ``RECONNECT_INTERVAL_S``, as one
        unreachable at the first try (found in review: every request's lookup and spills reconnected in vain, each
        failure a warning line). One that is back already (restarted by its service manager, or held by socket
        activation) is asked at once: found in review, a blanket wait after any loss had a daemon restarted within
        0.3 s miss every lookup, and refuse every evicted cache's spill, for 5 s."""
        if time.monotonic() >= self._next_try and not is_served(self.socket_path or default_socket(), PROBE_S):
            self._wait_out(lost, RECONNECT_INTERVAL_S)

    def _wait_out(self, why: BaseException, wait_s: float) -> None:
        """The daemon is not asked again for ``wait_s`` seconds; said at warning."""
        self._next_try = time.monotonic() + wait_s
        log.warning("spilld daemon unreachable (%s); retrying in %.0f s", why, wait_s)

    def _settled(self, f: concurrent.futures.Future[Settled]) -> None:
        """A spill's outcome, on the client's thread: one the daemon's going away failed stops the asking."""
        if not f.cancelled():
            self._lost(f.result().error)

    def spill(
        self,
        tokens: Sequence[int],
        caches: Sequence[Any],
        *,
        droppable: bool = True,
        behind: concurrent.futures.Future[Settled] | None = None,
    ) -> concurrent.futures.Future[Settled]:
        """``behind`` still in the client's own queue, not shipped yet, stands for this spill, which is sent in its
        place if it fails after all; one the client is shipping or shipped is the daemon's, which may still shed it:
        this one is sent only if the daemon's answer to that one is not stored (``AsyncClient.spill_threadsafe``)."""
        client = self._connect()
        if client is None:
            return settled_now(Outcome.FAILED, errors.SpillError("the daemon is unreachable"))
        future = guarded_spill(lambda: client.spill(tokens, caches, droppable=droppable, behind=behind), tokens)
        future.add_done_callback(self._settled)
        return future

    def load(self, tokens: Sequence[int], *, longer_than: int = 0) -> Loaded | None:
        client = self._connect()
        if client is None:
            return None

        def asked() -> Loaded | None:
            try:
                return client.load(tokens, longer_than=longer_than)  # (the client reconnects first if it must)
            except errors.ConnectionLost as exc:
                self._lost(exc)
                return None

        return self._backoff.load(asked, tokens)

    def stats(self) -> dict[str, Any]:
        client = self._connect()
        return client.status() if client is not None else {}

    def close(self, timeout: float | None = None) -> DrainReport | None:
        """Ship what is queued and hear the daemon's answers (up to ``timeout``); the report, None if never connected
        (every spill was refused on the spot, and said so)."""
        if self._client is None:
            return None
        report = self._client.close(timeout)
        self._client = None
        return report
