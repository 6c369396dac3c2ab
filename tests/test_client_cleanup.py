"""An ``AsyncClient`` that fails to open, or whose ``close`` is cancelled, leaves nothing behind: no socket, no
reader task, no shared-memory segment (found in review: each failed open kept its socket and reader until the
process ended, holding one of the daemon's client slots; a cancelled close kept the pool's segments too)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.models import cache as C

import spilld
from spilld import errors
from spilld import protocol as P
from spilld.client import CLOSE_FLUSH_S, AsyncClient
from tests.caches import fill

IDENT = spilld.Identity("cleanup")


@asynccontextmanager
async def daemon_that(
    answers: Callable[[P.Message], dict[str, Any] | None], path: str
) -> AsyncIterator[list[asyncio.Event]]:
    """A socket that answers requests with ``answers(msg)`` (None: never) and records each connection's end."""
    ended: list[asyncio.Event] = []

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        ended.append(done := asyncio.Event())
        dec = P.FrameDecoder()
        try:
            while data := await r.read(1 << 20):
                for m in dec.feed(data):
                    if m.kind == P.REQUEST and (result := answers(m)) is not None:
                        w.writelines(P.response(m.msgid, result))
        finally:
            done.set()
            w.close()

    server = await asyncio.start_unix_server(serve, path)
    try:
        yield ended
    finally:
        server.close()


def client_tasks() -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if "_read_loop" in repr(t.get_coro())]


@pytest.mark.asyncio
async def test_an_open_whose_hello_fails_or_is_cancelled_leaves_nothing_open(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")
    async with daemon_that(lambda m: None, path) as ended:  # never answers, not even the hello
        with pytest.raises(errors.Timeout):
            await AsyncClient.open(path, identity=IDENT, timeout=0.2)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(AsyncClient.open(path, identity=IDENT, timeout=30), 0.2)
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in ended)), 5)  # both sockets closed by the client
        assert len(ended) == 2 and client_tasks() == []


@pytest.mark.asyncio
async def test_a_cancelled_close_still_closes_the_socket_and_drops_the_pool(tmp_path: Path) -> None:
    path = str(tmp_path / "s.sock")
    hello = {"version": P.PROTOCOL_VERSION, "server": "silent", "pid": 1, "dir": "", "shm": True, "limits": {}}
    if not os.path.isdir("/dev/shm"):
        pytest.skip("counts the pool's segments in /dev/shm (Linux)")
    shm_before = set(os.listdir("/dev/shm"))

    def answers(m: P.Message) -> dict[str, Any] | None:
        # takes the spill and its segments, and never answers its commit
        replies: dict[str, dict[str, Any]] = {"hello": hello, "spill": {"spill": 1, "held_rows": 0}}
        return replies.get(m.method)

    async with daemon_that(answers, path) as ended:
        c = await AsyncClient.open(path, identity=IDENT)
        c.spill(list(range(16)), [fill(C.KVCache(), 16, seed=1)], droppable=False)

        async def pool_made() -> None:  # (found flaky: under load 0.5 s did not make it, and the thread still making
            while c._pool is None:  # it dropped its segments after the last check below)
                await asyncio.sleep(0.01)

        await asyncio.wait_for(pool_made(), 30)  # the pool is made and the spill sent
        assert [n for n in set(os.listdir("/dev/shm")) - shm_before if n.startswith("spilld-")]
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(c.close(), 0.3)  # a shutdown bounded by its own timeout
        await asyncio.wait_for(ended[0].wait(), 5)
        assert client_tasks() == []
        assert set(os.listdir("/dev/shm")) - shm_before == set()


@pytest.mark.asyncio
async def test_a_close_cancelled_while_unsent_bytes_wait_still_drops_the_socket(tmp_path: Path) -> None:
    """Found in review: a close cancelled in its flush wait (a caller's own bound, shorter than ``CLOSE_FLUSH_S``)
    skipped the transport's abort: against a daemon that stopped reading, the socket and its unsent bytes stayed
    for as long as the daemon hung."""
    path = str(tmp_path / "s.sock")
    hung, done = asyncio.Event(), asyncio.Event()

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:  # answers hello, then reads no more
        dec = P.FrameDecoder()
        while not hung.is_set() and (data := await r.read(1 << 16)):
            for m in dec.feed(data):
                if m.method == "hello":
                    w.writelines(P.response(m.msgid, {"version": P.PROTOCOL_VERSION, "shm": False}))
                    hung.set()
        await done.wait()
        w.close()

    server = await asyncio.start_unix_server(serve, path)
    try:
        c = await AsyncClient.open(path, identity=IDENT)
        assert c._writer is not None
        sock = c._writer.get_extra_info("socket")
        c._writer.write(bytes(64 << 20))  # a ship's frames the daemon never reads
        with pytest.raises(TimeoutError):  # (no timeout of its own: its flush may wait CLOSE_FLUSH_S)
            await asyncio.wait_for(c.close(), CLOSE_FLUSH_S / 4)
        await asyncio.sleep(0.1)
        assert sock.fileno() == -1, "the socket is still open"
    finally:
        done.set()
        server.close()
