"""Spills coming in: accepting a ``spill``, its ``commit`` and ``abort``, and the bytes they hold meanwhile.

Bytes declared by spills still being received are counted (``receiving``), and those of spills that may not be
dropped hold queue room from their first frame (``reserved``), so the commit of their last byte is never refused.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from .. import errors
from .. import format as fmt
from .. import protocol as P
from ..config import Config, format_size
from ..queue import Outcome, SpillItem, SpillQueue
from ..store import checkpoint_namespace
from ..validate import validate_header
from .connection import Connection, Incoming, Received

MAX_OPEN_SPILLS = 16  # spills being received on one connection


class Ingest:
    """The ``spill``, ``commit`` and ``abort`` methods and the byte accounting of spills being received."""

    def __init__(self, cfg: Config, queue: SpillQueue, stopping: asyncio.Event) -> None:
        self.cfg, self.queue, self.stopping = cfg, queue, stopping
        self.receiving = 0  # bytes declared by spills being received (not yet in the queue)
        self.reserved = 0  # of those, the non-droppable ones: queue room held for their commit

    async def spill(self, conn: Connection, p: dict[str, Any], msgid: int) -> dict[str, Any]:
        if self.stopping.is_set():
            raise P.Busy("the daemon is stopping")
        header = fmt.header_from_wire(p["header"])
        header.created_at_ms = time.time_ns() // 1_000_000
        for s in header.slots():
            s.hash = fmt.PLACEHOLDER_HASH  # computed here, never trusted
        validate_header(header)  # the readers' own checks: a spill a loader would refuse is never stored
        slots = header.slots()
        fmt.plan_offsets(slots)  # the daemon decides the layout
        if header.checkpoint is not None:
            header.identity.namespace = checkpoint_namespace(header.checkpoint.key)
        droppable = bool(p.get("droppable", True))
        sp = Incoming(header, droppable, str(p.get("key", "")))
        if len(conn.spills) >= MAX_OPEN_SPILLS:
            raise P.Busy(f"more than {MAX_OPEN_SPILLS} spills open on one connection")
        if self.receiving and self.receiving + self.queue.pending_bytes + sp.nbytes > 2 * self.cfg.cap:
            raise P.Busy("too many bytes in flight to the daemon; retry later")  # memory stays bounded
        if not droppable and not self.fits(sp.nbytes):
            raise P.Busy(
                f"queue full ({format_size(self.queue.pending_bytes)} of {format_size(self.cfg.cap)}); retry later"
            )
        sid = next(conn.spill_ids)
        conn.spills[sid] = sp
        self.receiving += sp.nbytes
        if not droppable:  # its room is held from now, so the commit of its last byte is never refused
            self.reserved += sp.nbytes
        return {"spill": sid, "tensors": len(slots), "bytes": sp.nbytes}

    def fits(self, nbytes: int) -> bool:
        """Whether the queue has room for ``nbytes`` more on top of what is reserved."""
        # An empty queue takes any one item (a soft cap), so an item larger than the cap still goes out.
        if self.queue.pending_items == 0 and self.reserved == 0:
            return True
        return self.queue.would_fit(self.reserved + nbytes)

    def forget(self, sp: Incoming) -> None:
        """A spill being received ends (committed, aborted, or its client gone): release what it held."""
        self.receiving -= sp.nbytes
        if not sp.droppable:
            self.reserved -= sp.nbytes

    async def commit(self, conn: Connection, p: dict[str, Any], msgid: int) -> dict[str, Any]:
        sp = conn.spills.pop(int(p["spill"]), None)
        if sp is None:
            raise P.BadParams("no such spill")
        self.forget(sp)  # from here the queue counts it
        if sp.error is not None or not sp.complete():
            conn.free_shm(sp.shm_names)
            raise sp.error or P.BadParams("commit before every tensor byte arrived")
        item = SpillItem(
            tokens=sp.header.tokens,
            namespace=sp.header.identity.namespace,
            key=sp.key,
            droppable=sp.droppable,
            payload=Received(sp.header, sp.chunks, sp.nbytes, conn if conn.lease_grantor else None, conn, sp.shm_names),
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

    async def abort(self, conn: Connection, p: dict[str, Any], msgid: int) -> None:
        sp = conn.spills.pop(int(p["spill"]), None)
        if sp is not None:
            self.forget(sp)
            conn.free_shm(sp.shm_names)
