"""Spills coming in: accepting a ``spill``, its ``commit`` and ``abort``, and the bytes they hold meanwhile.

Bytes declared by spills still being received are counted (``receiving``), and those of spills that may not be
dropped hold queue room from their first frame (``reserved``), so the commit of their last byte is never refused.
"""

from __future__ import annotations

import asyncio
import functools
import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

from .. import errors
from .. import format as fmt
from .. import protocol as P
from ..config import Config, format_size
from ..entries import CHECKPOINT_NS_PREFIX, checkpoint_namespace
from ..lease import off_loop
from ..queue import Outcome, SpillItem, SpillQueue
from ..unpack import MAX_EXPANSION, MAX_UNCOUNTED_EXPANSION
from ..validate import validate_header
from .connection import MIN_SPILL_BYTES_PER_S, Connection, Incoming, Received
from .params import check_text

MAX_OPEN_SPILLS = 16  # spills being received on one connection
MAX_OPEN_TOKENS = 2 * 1024 * 1024  # tokens declared by the spills open on one connection, together
MAX_OPEN_TENSORS = 16_384  # tensors (slots) declared by the spills open on one connection, together
# Open spills and big messages together hold at most --cap / RECEIVING_SHARE (one of them alone may be up to --cap);
# the queue holds its own --cap (plus the one item over it that an empty queue takes).
RECEIVING_SHARE = 2
MAX_SPILL_CAPS = 2  # one spill may be up to this x --cap (taken alone, when nothing else is received); larger: never
# The parsed form of a header, as measured (tracemalloc, CPython 3.11): ~40 bytes a token (a list of ints),
# ~1 KiB a tensor (its slot, shape and entry objects); a message being received or decoded, at most
# unpack.MAX_EXPANSION x its size (the decoder refuses more maps and arrays than that allows).
PARSED_BYTES_PER_TOKEN = 48
PARSED_BYTES_PER_TENSOR = 1024
# a cache entry (children too) or an attachment, with or without tensors: its objects (~330 B measured for an empty
# kv entry); found in review: 50,000 empty entries held 15.7 MiB counted as nothing
PARSED_BYTES_PER_ENTRY = 512
# the header's own objects (its dataclass, identity, lists) and what its decode leaves behind: a few hundred bytes
# measured (tracemalloc, a header decoded in slices)
PARSED_BYTES_PER_HEADER = 4096
DECODED_BYTES_PER_MSG_BYTE = MAX_EXPANSION
OBJECT_ALIGN = 16  # CPython's allocator gives each object a multiple of this (an int of 28 bytes takes 32)
BIG_MSG_BYTES = 64 * 1024  # messages this large are counted against the cap while received and decoded


def text_bytes(header: fmt.Header, key: str) -> int:
    """What a spill's free-form values hold in memory once parsed, each object at its size (``sys.getsizeof``): its
    key, identity, codec provider, meta, checkpoint's names, attachments' schemas and metadata, and every cache
    entry's kind and fields (children included). CPython stores every character of a str at the width of its
    widest one (found in review: one emoji made 3 MB of ASCII meta hold 12 MB counted as 3 MB), and the fields of
    a provider without rules here are taken as sent (a list of 4 M small ints in a 4 MiB spill held 160 MB,
    counted as 512 bytes)."""
    texts: list[Any] = [key, header.codec_provider, *vars(header.identity).values(), header.meta]
    if header.checkpoint is not None:
        texts += [header.checkpoint.key, header.checkpoint.cache_ns]
    texts += [x for a in header.attachments for x in (a.schema, a.metadata)]
    entries = list(header.caches)
    while entries:
        e = entries.pop()
        texts += [e.kind, e.fields]
        entries += e.children
    return sum(object_bytes(t) for t in texts)


def object_bytes(v: Any) -> int:
    """What a decoded msgpack value's objects take: each map, array, str, bin and number at its own size, rounded up
    to the allocator's ``OBJECT_ALIGN``. A cache's fields nest at most ``fmt.MAX_FIELD_DEPTH`` deep, the other values
    one: the recursion is shallow."""
    own = -(-sys.getsizeof(v) // OBJECT_ALIGN) * OBJECT_ALIGN
    if isinstance(v, dict):
        return own + sum(object_bytes(k) + object_bytes(x) for k, x in v.items())
    if isinstance(v, list):
        return own + sum(object_bytes(x) for x in v)
    return own


def parsed_bytes(header: fmt.Header, key: str) -> int:
    """What a spill's parsed header holds in memory, counted against the cap from its ``spill`` on: its tokens, its
    tensors, its entries and attachments, and its text (found in review: a header of 4 MiB of meta held 17 MB)."""
    parsed = PARSED_BYTES_PER_HEADER + PARSED_BYTES_PER_TOKEN * len(header.tokens)
    parsed += PARSED_BYTES_PER_TENSOR * len(header.slots())
    parsed += PARSED_BYTES_PER_ENTRY * (entry_count(header.caches) + len(header.attachments))
    return parsed + text_bytes(header, key)


def entry_count(caches: list[fmt.CacheEntry]) -> int:
    """Cache entries, their children included."""
    return sum(1 + entry_count(c.children) for c in caches)


def _items(v: Any) -> list[Any]:
    """A client's list, or nothing: what is not a list is left for the header parser to refuse."""
    return v if isinstance(v, list) else []


def with_ignored_fields(wire: Any) -> Any:
    """A spill's header may leave out what the daemon computes itself (each tensor's ``off`` and ``hash``, the
    header's ``created_at_ms`` and ``align``): filled with placeholders here, so the file format's parser takes it."""
    if not isinstance(wire, dict):
        return wire
    wire.setdefault("created_at_ms", 0)
    wire.setdefault("align", fmt.ALIGN)
    wire.setdefault("blocks", None)
    wire.setdefault("block", None)
    groups = [e for e in _items(wire.get("caches")) if isinstance(e, dict)]
    groups += [a for a in _items(wire.get("attachments")) if isinstance(a, dict)]
    while groups:
        g = groups.pop()
        groups += [c for c in _items(g.get("children")) if isinstance(c, dict)]
        for t in _items(g.get("tensors")):
            if isinstance(t, dict):
                t.setdefault("off", 0)
                t.setdefault("hash", fmt.PLACEHOLDER_HASH)
    return wire


def _parse(wire: Any, key: str) -> tuple[fmt.Header, int]:
    """``accept_header`` and what the result holds (``parsed_bytes``): both walk the whole header."""
    header = accept_header(wire)
    return header, parsed_bytes(header, key)


def accept_header(wire: Any) -> fmt.Header:
    """A spill's header as the daemon will write it, or a typed error: parsed, hashes and layout the daemon's own,
    then the readers' checks (``validate_header``), so a spill a loader would refuse is never stored. Pure."""
    header = fmt.header_from_wire(with_ignored_fields(wire))
    if header.version not in fmt.SUPPORTED_VERSIONS:
        raise errors.VersionMismatch(f"format {header.version} (this daemon takes {sorted(fmt.SUPPORTED_VERSIONS)})")
    for name, value in vars(header.identity).items():  # names the store and the shared tier keep
        if name != "namespace" or header.checkpoint is None:  # (a checkpoint's is made from its key, checked below)
            check_text("spill", f"header.identity.{name}", value)
    if header.checkpoint is not None:
        check_text("spill", "header.checkpoint.key", header.checkpoint.key)
        check_text("spill", "header.checkpoint.cache_ns", header.checkpoint.cache_ns)
    if header.blocks is not None or header.block is not None:
        raise errors.BlockInvalid("a spill sends every row: the daemon cuts it into blocks itself")
    header.version = fmt.FORMAT_VERSION  # a v1 client's spill is written as this build's format
    header.created_at_ms = time.time_ns() // 1_000_000
    for s in header.slots():
        s.hash = fmt.PLACEHOLDER_HASH  # computed here, never trusted
    validate_header(header)
    fmt.plan_layout(header)  # the daemon decides the layout
    return header


class Ingest:
    """The ``spill``, ``commit`` and ``abort`` methods and the byte accounting of spills being received."""

    def __init__(
        self,
        cfg: Config,
        queue: SpillQueue,
        stopping: asyncio.Event,
        hold: Callable[[fmt.Header], tuple[int, Any]],
        release: Callable[[Any], None],
    ) -> None:
        self.cfg, self.queue, self.stopping = cfg, queue, stopping
        # the store's: the leading tokens it holds as blocks (a client need not send them), those blocks kept until
        # ``release``, once the spill is written or given up
        self.hold, self.release_hold = hold, release
        self.receiving = 0  # what spills being received hold: declared tensor bytes + parsed headers
        self.reserved = 0  # declared bytes of the non-droppable ones: queue room held for their commit
        self.buffers = 0  # big messages being received or decoded (counted from their frame head)
        self.expired = 0  # open spills aborted for silence
        self.held_bytes = 0  # tensor bytes clients did not send: the store held their blocks
        self.committing: set[asyncio.Future[None]] = set()  # commits waiting for their segment copies

    @property
    def budget(self) -> int:
        """The most open spills and big messages hold together (unless one alone, when nothing else is held)."""
        return self.cfg.cap // RECEIVING_SHARE

    @property
    def max_spill(self) -> int:
        """The most tensor bytes one spill may declare."""
        return MAX_SPILL_CAPS * self.cfg.cap

    def held(self) -> int:
        return self.receiving + self.buffers

    def room_for(self, nbytes: int) -> bool:
        # Nothing held: one spill (up to max_spill) or message goes in, so a large item is never refused forever.
        return self.held() == 0 or self.held() + nbytes <= self.budget

    async def committed(self, timeout: float) -> None:
        """Wait (at most ``timeout``) until every commit received so far has handed its item to the queue."""
        if self.committing:
            await asyncio.wait(list(self.committing), timeout=timeout)

    def hold_message(self, size: int) -> int:
        """Count a message of ``size`` bytes about to be received (before its buffer exists); the bytes held,
        to hand to ``release``. A big message that does not fit the budget is refused with ``busy``."""
        if size < BIG_MSG_BYTES:
            return 0  # small ones: at most one per connection at a time, within the slack of the bound
        return self._count_buffer(size * DECODED_BYTES_PER_MSG_BYTE, f"a message of {format_size(size)} does not fit: ")

    def hold_spill_message(self, size: int) -> int:
        """Count a small ``spill`` message (``size`` bytes, under ``BIG_MSG_BYTES``: not counted while received) from
        its dispatch until its header is parsed: its handler may wait meanwhile for a compute thread, every spill of
        every client behind it (found in review: 20 clients pipelining 64 spills of 64 KiB each held 3 GB with a cap
        of 64 MiB). The bytes held, for ``release``; ``busy`` when they do not fit the budget."""
        return self._count_buffer(size * MAX_UNCOUNTED_EXPANSION)

    def _count_buffer(self, need: int, why: str = "") -> int:
        """``need`` bytes counted among ``buffers`` (returned, for ``release``), or ``busy`` (``why`` opening its
        message) when they do not fit the budget."""
        if not self.room_for(need):
            raise P.Busy(
                f"{why}the daemon holds {format_size(self.held())} of {format_size(self.budget)} for spills being "
                "received; retry later"
            )
        self.buffers += need
        return need

    def release(self, held: int) -> None:
        self.buffers -= held

    async def spill(self, conn: Connection, p: dict[str, Any], msgid: int) -> dict[str, Any]:
        if self.stopping.is_set():
            raise P.Busy("the daemon is stopping")
        # parsed and measured off the loop (a hostile header of 4 MiB: 1.5 s of Python, found in review), its message
        # counted meanwhile (a big one from its frame head, a small one from its dispatch: hold_spill_message)
        header, parsed = await off_loop(functools.partial(_parse, p["header"], p.get("key", "")), compute=True)
        conn.release_message()  # counted as parsed from here (``Incoming``), or dropped if refused below
        if self.stopping.is_set():
            raise P.Busy("the daemon is stopping")
        if conn.closed.done():  # gone while its header was parsed: nobody will send its bytes nor end it
            raise P.ConnectionLost("the client is gone")
        slots = header.slots()
        if header.checkpoint is not None:
            header.identity.namespace = checkpoint_namespace(header.checkpoint.key)
        elif header.identity.namespace.startswith(CHECKPOINT_NS_PREFIX):
            raise P.BadParams("spill: namespaces starting with the checkpoint prefix are reserved")
        droppable = p.get("droppable", True)
        held, hold = self.hold(header) if p.get("held", False) else (0, None)  # the client sends the rows past it
        sp = Incoming(header, droppable, p.get("key", ""), parsed, pin=p.get("pin", False), held_rows=held)
        sp.hold = hold
        try:
            self.admit(conn, sp)
        except BaseException:
            self._let_go(sp)
            raise
        self.held_bytes += sum(s.nbytes for s in slots) - sp.nbytes
        sid = next(conn.spill_ids)
        conn.spills[sid] = sp
        self.receiving += sp.cost
        if not droppable:  # its room is held from now, so the commit of its last byte is never refused
            self.reserved += sp.nbytes
        return {"spill": sid, "tensors": len(slots), "bytes": sp.nbytes, "held_rows": held}

    def admit(self, conn: Connection, sp: Incoming) -> None:
        """Raise ``busy`` unless the connection's limits and the daemon's memory budget have room for ``sp``."""
        if len(conn.spills) >= MAX_OPEN_SPILLS:
            raise P.Busy(f"more than {MAX_OPEN_SPILLS} spills open on one connection")
        tokens = len(sp.header.tokens) + sum(len(o.header.tokens) for o in conn.spills.values())
        if tokens > MAX_OPEN_TOKENS:
            raise P.Busy(f"{tokens} tokens in the spills open on this connection (limit {MAX_OPEN_TOKENS})")
        tensors = len(sp.slots) + sum(len(o.slots) for o in conn.spills.values())
        if tensors > MAX_OPEN_TENSORS:
            raise P.Busy(f"{tensors} tensors in the spills open on this connection (limit {MAX_OPEN_TENSORS})")
        if sp.nbytes > self.max_spill:  # (its parsed header is bounded by the per-connection limits)
            raise P.Busy(
                f"a spill of {format_size(sp.nbytes)} of tensors is larger than the cap allows "
                f"({MAX_SPILL_CAPS} x {format_size(self.cfg.cap)}): this daemon can never take it"
            )
        if not self.room_for(sp.cost):
            raise P.Busy(
                f"the daemon holds {format_size(self.held())} of {format_size(self.budget)} for spills being "
                "received; retry later"
            )  # memory stays bounded
        if not sp.droppable and not self.fits(sp.nbytes):
            raise P.Busy(
                f"queue full ({format_size(self.queue.pending_bytes)} of {format_size(self.cfg.cap)}); retry later"
            )

    def fits(self, nbytes: int) -> bool:
        """Whether the queue has room for ``nbytes`` more on top of what is reserved."""
        # An empty queue takes any one item (a soft cap), so an item larger than the cap still goes out.
        if self.queue.pending_items == 0 and self.reserved == 0:
            return True
        return self.queue.would_fit(self.reserved + nbytes)

    def counters(self, open_spills: int) -> dict[str, int]:
        """For ``status``: spills being received and the bytes they hold (all zero once every client is gone)."""
        return {
            "open_spills": open_spills,
            "receiving": self.receiving,
            "reserved": self.reserved,
            "buffers": self.buffers,
            "expired": self.expired,
            "held_bytes": self.held_bytes,
        }

    def forget(self, sp: Incoming) -> None:
        """A spill being received ends (committed, aborted, expired, or its client gone): release what it held."""
        if sp.released:
            return
        if sp.filling:  # a payload counted as its own is still being read into its buffer: that count stays
            sp.forget_when_filled = True  # until the frame ends (the connection lets it go then)
            return
        if sp.reads:  # segment copies still fill its buffers: their room stays counted until the last one ends
            next(iter(sp.reads)).add_done_callback(lambda _: self.forget(sp))  # (found in review: an abort freed
            return  # it at once, and every spill admitted next held a copy's buffer beyond the bound)
        sp.released = True
        self.receiving -= sp.cost
        if not sp.droppable:
            self.reserved -= sp.nbytes
        self._let_go(sp)

    def _let_go(self, sp: Incoming) -> None:
        """The blocks ``sp`` was told were held are kept no more (it ended before its commit)."""
        if sp.hold is not None:
            hold, sp.hold = sp.hold, None
            self.release_hold(hold)

    def expire(self, connections: Iterable[Connection], now: float) -> None:
        """Abort the open spills that received nothing for ``--idle-timeout``, or that are not whole by
        ``--idle-timeout`` plus their bytes at ``MIN_SPILL_BYTES_PER_S``: their room goes back now."""
        timeout = self.cfg.idle_timeout
        for conn in connections:
            for sid, sp in list(conn.spills.items()):
                if sp.reads:
                    continue
                if now - sp.last >= timeout:
                    why = f"spill {sid} received nothing for {timeout:g} s; aborted"
                elif now - sp.opened >= (allowed := timeout + sp.nbytes / MIN_SPILL_BYTES_PER_S):
                    pace = format_size(MIN_SPILL_BYTES_PER_S)
                    why = f"spill {sid} not whole within {allowed:.0f} s (its bytes at {pace}/s); aborted"
                else:
                    continue
                conn.expire(sid, P.Timeout(why))
                self.forget(sp)
                self.expired += 1

    async def commit(self, conn: Connection, p: dict[str, Any], msgid: int) -> dict[str, Any]:
        sp = conn.take_spill(p["spill"])
        hold, sp.hold = sp.hold, None  # its held blocks stay until its item is written, or ends otherwise
        try:
            return await self._commit(conn, sp)
        finally:
            if hold is not None:
                self.release_hold(hold)

    async def _commit(self, conn: Connection, sp: Incoming) -> dict[str, Any]:
        if sp.reads:  # segment copies under way: a stop waits for them, so this commit still reaches the queue
            marker = asyncio.get_running_loop().create_future()
            self.committing.add(marker)
            try:
                await sp.settled_reads()
            finally:
                self.committing.discard(marker)
                marker.set_result(None)
        self.forget(sp)  # from here the queue counts it
        if sp.error is not None or not sp.complete():
            raise sp.error or P.BadParams("commit before every tensor byte arrived")
        item = SpillItem(
            tokens=sp.header.tokens,
            namespace=sp.header.identity.namespace,
            key=sp.key,
            droppable=sp.droppable,
            pin=sp.pin,
            payload=Received(sp.header, sp.chunks, sp.nbytes, conn if conn.lease_grantor else None, conn, sp.held_rows),
        )
        settled = await self.queue.enqueue(item)  # (enqueue takes the item before its first await)
        out: dict[str, Any] = {"outcome": settled.outcome.value}
        if settled.outcome is Outcome.STORED:
            out |= {"path": settled.value.path, "file_bytes": settled.value.file_bytes}
        elif settled.error is not None:
            err = (
                settled.error
                if isinstance(settled.error, errors.SpillError)
                else errors.StorageError(str(settled.error))
            )
            out |= P.error_map(err)
        return out

    async def abort(self, conn: Connection, p: dict[str, Any], msgid: int) -> dict[str, Any]:
        sp = conn.spills.pop(p["spill"], None)
        if sp is not None:
            self.forget(sp)
            sp.fail(P.BadParams("aborted"))  # segment copies still under way land in nothing
        return {"aborted": sp is not None}
