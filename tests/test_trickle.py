"""A trickle of bytes holds nothing past its deadline (found in review): a connection that never says hello, a big
message that never arrives whole, a spill that never completes. A byte now and then reset each silence timer, and
the receiving budget they held left every other client's spills refused ``busy``. In-process daemon, real socket."""

from __future__ import annotations

import asyncio

import pytest

from spilld import protocol as P
from spilld.daemon import ingest
from tests.hostile_memory import AsyncWire, in_process, kv_header

MiB = 1024 * 1024
TICK_S = 0.25  # between the trickle's bytes: far under every silence bound here


async def _trickle_until_closed(r: asyncio.StreamReader, w: asyncio.StreamWriter, limit_s: float) -> float:
    """Send one byte a TICK_S until the daemon closes the connection: the seconds that took (``limit_s`` if not)."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    closed = asyncio.ensure_future(r.read(-1))  # the daemon's error notification, then EOF
    while not closed.done() and loop.time() - t0 < limit_s:
        try:
            w.write(b"\x90")
            await w.drain()
        except (ConnectionError, OSError):
            break
        await asyncio.wait([closed], timeout=TICK_S)
    took = loop.time() - t0
    closed.cancel()
    w.close()
    return took


@pytest.mark.asyncio
async def test_a_connection_without_a_hello_is_closed_at_its_deadline_whatever_it_trickles() -> None:
    async with in_process("trickle", hello_timeout=1.0, request_timeout=3.0, idle_timeout=3.0) as (daemon, _):
        r, w = await asyncio.open_unix_connection(daemon.cfg.socket)
        w.write(P.FRAME_HEAD.pack(1000, 0))  # a small message, never finished
        took = await _trickle_until_closed(r, w, limit_s=10)
        assert 0.8 <= took < 2.5, took


@pytest.mark.asyncio
async def test_a_big_message_before_the_hello_holds_nothing() -> None:
    async with in_process("trickle", cap=256 * MiB) as (daemon, wire):
        r, w = await asyncio.open_unix_connection(daemon.cfg.socket)
        w.write(P.FRAME_HEAD.pack(P.MAX_MSG_BYTES, 0))
        await w.drain()
        data = await asyncio.wait_for(r.read(-1), 5)  # refused at its frame head, closed
        assert b"before the hello" in data and daemon.ingest.buffers == 0
        w.close()
        _, err = await wire.call("spill", {"header": kv_header(8)})
        assert err is None


@pytest.mark.asyncio
async def test_a_big_message_that_never_arrives_whole_gives_its_room_back_at_the_request_timeout() -> None:
    async with in_process("trickle", cap=256 * MiB, request_timeout=1.5, idle_timeout=3.0) as (daemon, _):
        other = await AsyncWire.open(daemon.cfg.socket, "trickle")
        w = other.w
        w.write(P.FRAME_HEAD.pack(P.MAX_MSG_BYTES, 0))  # counted against the budget from here
        await w.drain()
        await asyncio.sleep(0.1)
        assert daemon.ingest.buffers == P.MAX_MSG_BYTES * ingest.DECODED_BYTES_PER_MSG_BYTE
        took = await _trickle_until_closed(other.r, w, limit_s=10)
        assert 1.2 <= took < 3.0, took
        assert daemon.ingest.buffers == 0


@pytest.mark.asyncio
async def test_a_spill_that_arrives_slower_than_the_floor_is_aborted() -> None:
    """``--idle-timeout`` plus its bytes at ``MIN_SPILL_BYTES_PER_S``: here 1.5 s + 1 s for 8 MiB."""
    async with in_process("trickle", cap=256 * MiB, idle_timeout=1.5) as (daemon, wire):
        rows = 8 * MiB // (2 * 8 * 128 * 2)  # two tensors of [1, 8, rows, 128] float16: 8 MiB
        r, err = await wire.call("spill", {"header": kv_header(rows)})
        assert err is None and daemon.ingest.receiving > 0
        loop = asyncio.get_running_loop()
        t0, off = loop.time(), 0
        while daemon.ingest.expired == 0 and loop.time() - t0 < 10:
            wire.send(P.notification("put", {"spill": r["spill"], "index": 0, "offset": off}, b"x"))
            off += 1
            await asyncio.sleep(TICK_S)
        took = loop.time() - t0
        assert daemon.ingest.expired == 1 and 2.4 <= took < 4.5, took
        assert daemon.ingest.receiving == 0
        res, err = await wire.call("commit", {"spill": r["spill"]})
        assert err is not None and err["code"] == "timeout" and "not whole within" in err["message"], (res, err)


@pytest.mark.asyncio
async def test_a_payload_fed_a_byte_at_a_time_gives_its_spills_room_back() -> None:
    """Found in review: a put's payload fed one byte a second kept its spill's whole count in the receiving budget
    for as long as it dribbled in, after the spill itself had expired too (every byte reset the request timer), and
    other clients' spills were refused busy. A payload must be whole within --request-timeout plus its bytes at
    ``MIN_SPILL_BYTES_PER_S``: past that the connection closes and the room goes back."""
    async with in_process("trickle", cap=256 * MiB, request_timeout=1.5, idle_timeout=1.5) as (daemon, wire):
        rows = 8 * MiB // (2 * 8 * 128 * 2)
        r, err = await wire.call("spill", {"header": kv_header(rows)})
        assert err is None and daemon.ingest.receiving > 0
        head, _ = P.notification("put", {"spill": r["spill"], "index": 0, "offset": 0}, b"x" * MiB)
        wire.w.write(bytes(head))  # the frame's head and message: its payload announced, then fed slowly
        took = await _trickle_until_closed(wire.r, wire.w, limit_s=10)
        assert took < 1.5 + MiB / ingest.MIN_SPILL_BYTES_PER_S + 1.5, took
        await asyncio.sleep(0.1)
        assert daemon.ingest.receiving == 0
