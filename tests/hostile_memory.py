"""Clients that try to make the daemon hold memory: a giant declared spill, a slow-loris spill, many huge headers.

Raw protocol over asyncio streams (no spilld client code), shared by the overload soak and the hostile-clients
benchmark. Each runs until cancelled and counts what the daemon answered in ``counts``.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

from spilld import format as fmt
from spilld import protocol as P

GIANT_ROWS = 4500  # x 64 heads x 256 dims x 2 tensors, float16: 281 MiB declared
# a 0.5 MB message (counted at unpack.MAX_EXPANSION = 48x while received: 24 MB, within --cap 64MiB / 2 beside
# other spills) that parses into ~6 MB; at 250,000 tokens its 48 MB count no longer fit beside anything
HUGE_HEADER_TOKENS = 125_000
LORIS_ROWS = 2048  # x 8 heads x 128 dims x 2 tensors, float16: 8 MiB declared, 4 KiB sent


def kv_header(
    rows: int, heads: int = 8, dim: int = 128, tokens: int | None = None, seed: int = 0, entries: int = 1
) -> dict[str, Any]:
    """A wire header of ``entries`` float16 KV entries of [1, heads, rows, dim], consistent in every field."""
    shape = [1, heads, rows, dim]
    tensor = {"off": 0, "bytes": heads * rows * dim * 2, "shape": shape, "dtype": "float16", "hash": bytes(8)}
    ntok = tokens if tokens is not None else rows
    return {
        "format": 1,
        "created_at_ms": 0,
        "codec_provider": "spilld/mlx-lm/1",
        "identity": {"model_id": "hostile", "config_fingerprint": "", "tokenizer_hash": "", "namespace": ""},
        "tokens": fmt.encode_tokens([(seed + i) % 50_000 for i in range(ntok)]),
        "caches": [
            {
                "kind": "kv",
                "v": 1,
                "offset": rows,
                "min_reusable": 0,
                "trimmable": True,
                "fields": {},
                "tensors": [tensor, dict(tensor)],
                "children": [],
            }
        ]
        * entries,
        "attachments": [],
        "checkpoint": None,
        "meta": {},
    }


class AsyncWire:
    """One raw connection on asyncio streams: requests with their answers; notifications are counted."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.r, self.w = reader, writer
        self.dec = P.FrameDecoder()
        self.answers: dict[int, P.Message] = {}
        self.notes: list[P.Message] = []
        self._ids = 0

    @classmethod
    async def open(cls, sock: str, name: str) -> AsyncWire:
        wire = cls(*await asyncio.open_unix_connection(sock))
        _, err = await wire.call("hello", {"version": P.PROTOCOL_VERSION, "client": name})
        if err is not None:
            raise ConnectionError(str(err))
        return wire

    def send(self, parts: list[bytes | memoryview]) -> None:
        self.w.write(b"".join(bytes(b) for b in parts))

    async def call(self, method: str, params: dict[str, Any]) -> tuple[Any, dict[str, Any] | None]:
        """(result, error); raises ConnectionError when the daemon closes first."""
        self._ids += 1
        msgid = self._ids
        self.send(P.request(msgid, method, params))
        await self.w.drain()
        while msgid not in self.answers:
            data = await self.r.read(1 << 20)
            if not data:
                raise ConnectionError(f"closed: {[n.params for n in self.notes if n.method == 'error']}")
            for m in self.dec.feed(data):
                if m.kind == P.RESPONSE:
                    self.answers[m.msgid] = m
                else:
                    self.notes.append(m)
        m = self.answers.pop(msgid)
        return m.result, m.error

    async def store_kv(self, rows: int, seed: int, heads: int = 2, dim: int = 8) -> list[int]:
        """Spill ``kv_header(rows, heads, dim, seed)`` whole (zero bytes) and check it is stored: its tokens."""
        r, err = await self.call("spill", {"header": kv_header(rows, heads=heads, dim=dim, seed=seed)})
        assert err is None, err
        for i in range(2):
            self.send(
                P.notification("put", {"spill": r["spill"], "index": i, "offset": 0}, bytes(heads * rows * dim * 2))
            )
        r, err = await self.call("commit", {"spill": r["spill"]})
        assert err is None and r["outcome"] == "stored", (r, err)
        return [(seed + i) % 50_000 for i in range(rows)]

    def close(self) -> None:
        self.w.close()


async def _forever(counts: Counter[str], kind: str, body: Any) -> None:
    """Run ``body`` again and again; a connection the daemon closes is counted and made again."""
    while True:
        try:
            await body()
        except (ConnectionError, OSError) as exc:
            counts[f"{kind}_closed"] += 1
            if "busy" not in str(exc):
                await asyncio.sleep(0.2)
        await asyncio.sleep(0.05)


async def giant_spill(sock: str, counts: Counter[str]) -> None:
    """Declares a spill far larger than any cap, again and again: each must be refused ``busy`` at once."""

    async def body() -> None:
        w = await AsyncWire.open(sock, "giant")
        try:
            while True:
                _, err = await w.call("spill", {"header": kv_header(GIANT_ROWS, 64, 256), "droppable": False})
                counts["giant_refused" if err and err["code"] == "busy" else "giant_admitted"] += 1
                await asyncio.sleep(0.1)
        finally:
            w.close()

    await _forever(counts, "giant", body)


async def slow_loris(sock: str, counts: Counter[str], idle_timeout: float) -> None:
    """Opens a non-droppable spill, sends 4 KiB of it, then only keeps the connection alive: the spill must be
    aborted after the idle timeout; then it opens another."""

    async def body() -> None:
        w = await AsyncWire.open(sock, "loris")
        try:
            seed = 0
            while True:
                seed += 1
                res, err = await w.call("spill", {"header": kv_header(LORIS_ROWS, seed=seed), "droppable": False})
                if err is not None:
                    counts["loris_refused"] += 1
                    await asyncio.sleep(0.5)
                    continue
                counts["loris_opened"] += 1
                w.send(P.notification("put", {"spill": res["spill"], "index": 0, "offset": 0}, b"\0" * 4096))
                deadline = asyncio.get_running_loop().time() + idle_timeout + 1.5
                while asyncio.get_running_loop().time() < deadline:
                    await w.call("status", {})  # the connection is busy; only its spill is silent
                    await asyncio.sleep(0.5)
                _, err = await w.call("commit", {"spill": res["spill"]})
                counts["loris_expired" if err and err["code"] == "timeout" else "loris_not_expired"] += 1
        finally:
            w.close()

    await _forever(counts, "loris", body)


async def huge_headers(sock: str, counts: Counter[str], idle_timeout: float) -> None:
    """Opens spills whose headers hold a quarter of a million tokens each, as many as the daemon takes, and sends
    nothing for them: each is held against the cap until the idle timeout aborts it."""

    async def body() -> None:
        w = await AsyncWire.open(sock, "headers")
        try:
            seed = 0
            while True:
                seed += 1
                header = kv_header(8, tokens=HUGE_HEADER_TOKENS, seed=seed)
                _, err = await w.call("spill", {"header": header, "droppable": True})
                counts["header_refused" if err else "header_opened"] += 1
                await asyncio.sleep(idle_timeout / 4 if err else 0.1)
        finally:
            w.close()

    await _forever(counts, "headers", body)


async def run_all(sock: str, counts: Counter[str], idle_timeout: float, stop: asyncio.Event, copies: int = 1) -> None:
    """Every hostile client above (``copies`` of each) until ``stop`` is set."""
    tasks = [
        asyncio.get_running_loop().create_task(c)
        for _ in range(copies)
        for c in (
            giant_spill(sock, counts),
            slow_loris(sock, counts, idle_timeout),
            huge_headers(sock, counts, idle_timeout),
        )
    ]
    await stop.wait()
    for t in tasks:
        t.cancel()
    for t in tasks:
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await t


@contextlib.asynccontextmanager
async def in_process(name: str, **over: Any) -> AsyncIterator[tuple[Any, AsyncWire]]:
    """A daemon on the test's loop (``quiet_config`` in a fresh root, ``over`` its settings) and a connection named
    ``name`` to it; both gone afterwards, the root removed."""
    from spilld.daemon import Daemon
    from tests.daemons import cleanup, new_root, quiet_config

    root = new_root()
    daemon = Daemon(quiet_config(root, **over))
    await daemon.start()
    wire = None
    try:
        wire = await AsyncWire.open(daemon.cfg.socket, name)
        yield daemon, wire
    finally:
        if wire is not None:
            wire.close()
        await daemon.stop()
        cleanup(root)
