"""The daemon as a real subprocess on a real socket: engines, restarts, drain, stop, bad clients."""

from __future__ import annotations

import asyncio
import json
import math
import os
import signal
import socket
import stat
import time
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import pytest

import spilld
from spilld import mlxthreads
from spilld import protocol as P
from spilld.client import AsyncClient
from spilld.lockfile import LOCK_NAME
from tests.daemons import Daemon, cleanup, new_root, quiet_config, serving
from tests.models import MODELS, next_logits, prefill, random_tokens, tiny_llama


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    with serving("--cap", "256MiB", "--drain-deadline", "30") as d:
        yield d


async def connect(d: Daemon, model: Any, name: str) -> AsyncClient:
    return await AsyncClient.open(d.socket, identity=spilld.model_identity(model, model_id=name), name=name)


@pytest.mark.asyncio
async def test_two_engines_spill_lookup_load_identical_logits(daemon: Daemon) -> None:
    llama, gemma = tiny_llama(), MODELS["gemma3"]()
    engines = [(llama, await connect(daemon, llama, "llama")), (gemma, await connect(daemon, gemma, "gemma"))]
    expected = []
    for model, client in engines:
        prompt = random_tokens(40, seed=len(expected))
        cache, _ = prefill(model, prompt)
        fut = client.spill(prompt, cache)
        expected.append((prompt, next_logits(model, cache, 5)))
        assert (await fut).stored
    for (model, client), (prompt, logits) in zip(engines, expected, strict=True):
        got = await client.load([*prompt, 5, 6])
        assert got is not None and got.tokens == prompt
        assert mx.array_equal(next_logits(model, got.caches, 5), logits).item()
        # each engine sees only its own model's entries
        other = engines[1][1] if client is engines[0][1] else engines[0][1]
        assert isinstance(await other.lookup([*prompt, 5]), spilld.Miss)
    st = await engines[0][1].status()
    assert st["store"]["entries"] == 2 and st["queue"]["stored"] == 2 and st["clients"] == 1  # the other engine
    for _, c in engines:
        await c.close()


@pytest.mark.asyncio
async def test_daemon_restart_in_between(daemon: Daemon) -> None:
    model = tiny_llama()
    prompt = random_tokens(30, seed=4)
    cache, _ = prefill(model, prompt)
    client = await connect(daemon, model, "m")
    assert (await client.spill(prompt, cache)).stored
    want = next_logits(model, cache, 9)
    assert daemon.stop() == 0
    with pytest.raises(P.ConnectionLost):
        await client.lookup(prompt)  # the old connection is gone: a typed error, never a hang
    daemon.start()
    got = await client.load([*prompt, 9])  # reconnects by itself
    assert got is not None and mx.array_equal(next_logits(model, got.caches, 9), want).item()
    await client.close()


def test_cli_drain_status_ls_evict(daemon: Daemon) -> None:
    async def fill() -> None:
        model = tiny_llama()
        client = await connect(daemon, model, "cli")
        for seed in range(3):
            prompt = random_tokens(20, seed=seed)
            client.spill(prompt, prefill(model, prompt)[0])
        await client.close()  # ships everything first

    asyncio.run(fill())
    r = daemon.cli("drain", "--socket", daemon.socket, "--timeout", "60")
    assert r.returncode == 0 and "durable" in r.stdout
    st = json.loads(daemon.cli("status", "--socket", daemon.socket, "--json").stdout)
    assert st["queue"]["stored"] == 3 and st["store"]["entries"] == 3
    text = daemon.cli("status", "--socket", daemon.socket)
    assert text.returncode == 0 and "3 entries" in text.stdout
    ls = daemon.cli("ls", "--dir", daemon.dir, "--json")
    rows = json.loads(ls.stdout)
    assert len(rows) == 3 and all(r["model_id"] == "cli" for r in rows)
    r = daemon.cli("evict", "--socket", daemon.socket, "--older-than", "1h")
    assert r.returncode == 0 and "evicted 0" in r.stdout
    r = daemon.cli("evict", "--socket", daemon.socket, "--fingerprint", rows[0]["fingerprint"])
    assert r.returncode == 0 and "evicted 3" in r.stdout
    assert set(os.listdir(daemon.dir)) <= {".quarantine", LOCK_NAME}  # model folder cleared
    assert daemon.cli("drain", "--socket", "/tmp/no-such-spilld.sock").returncode == 4


def test_socket_permissions_and_single_instance(daemon: Daemon) -> None:
    assert stat.S_IMODE(os.stat(daemon.socket).st_mode) == 0o600
    assert stat.S_IMODE(os.stat(os.path.dirname(daemon.socket)).st_mode) == 0o700
    second = Daemon(daemon.root).start(wait=False)
    assert second.proc is not None and second.proc.wait(30) == 5  # refuses to start over a live daemon


def test_a_stale_socket_is_replaced() -> None:
    d = Daemon(new_root())
    try:
        os.makedirs(os.path.dirname(d.socket), mode=0o700)
        s = socket.socket(socket.AF_UNIX)
        s.bind(d.socket)  # bound, never listening, then abandoned: what a crash leaves
        s.close()
        d.start()
        assert d.stop() == 0 and not os.path.exists(d.socket)
    finally:
        d.kill()
        cleanup(d.root)


class Raw:
    """A client speaking the wire protocol by hand, so it can stop anywhere in a spill."""

    def __init__(self, path: str) -> None:
        self.s = socket.socket(socket.AF_UNIX)
        self.s.settimeout(30)
        self.s.connect(path)
        self.dec = P.FrameDecoder()
        self.ids = iter(range(1, 1 << 30))
        assert self.call("hello", {"version": 1, "client": "raw"}).error is None

    def call(self, method: str, params: dict[str, Any]) -> P.Message:
        msgid = next(self.ids)
        self.s.sendall(b"".join(bytes(b) for b in P.request(msgid, method, params)))
        while True:
            for m in self.dec.feed(self.s.recv(65536)):
                if m.kind == P.RESPONSE and m.msgid == msgid:
                    return m


def test_clients_dying_mid_spill_leave_no_file_and_hold_no_room() -> None:
    from mlx_lm.models import cache as C

    from tests.caches import fill

    d = Daemon(new_root(), ["--cap", "1MiB"]).start()
    try:
        cache = fill(C.KVCache(), 300, heads=4, dim=64)  # 600 KiB of tensors: two fit the cap only one at a time
        header, _ = spilld.saver.plan(list(range(300)), [cache], identity=spilld.Identity("m"))
        probe = Raw(d.socket)

        def settled() -> dict[str, Any]:  # the daemon has seen every dying client go
            deadline = time.monotonic() + 30
            while (st := probe.call("status", {}).result)["clients"] > 0 and time.monotonic() < deadline:
                time.sleep(0.05)
            return st

        for droppable in (False, True, False, True):  # each dies with its spill's room held and bytes declared
            dying = Raw(d.socket)
            r = dying.call("spill", {"header": header.to_wire(), "droppable": droppable})
            assert r.error is None, r.error
            part = P.notification("put", {"spill": r.result["spill"], "index": 0, "offset": 0}, b"\0" * 64)
            dying.s.sendall(b"".join(bytes(b) for b in part))
            dying.s.close()  # gone before its commit
            st = settled()
        assert st["clients"] == 0 and st["queue"]["pending_items"] == 0 and st["store"]["entries"] == 0
        held = {k: st["ingest"][k] for k in ("open_spills", "receiving", "reserved")}
        assert held == {"open_spills": 0, "receiving": 0, "reserved": 0}  # what they held, released
        # What they held is released: had it leaked, these would be refused as busy (the room of two
        # non-droppable spills is more than the cap; the bytes of four declared spills more than twice the cap).
        for droppable in (False, True):
            r = probe.call("spill", {"header": header.to_wire(), "droppable": droppable})
            assert r.error is None, (droppable, r.error)
            assert probe.call("abort", {"spill": r.result["spill"]}).error is None
        probe.s.close()
        from spilld.fileio import is_temp_name

        files = [f for _, _, fs in os.walk(d.dir) for f in fs if f.endswith(".spilld") or is_temp_name(f)]
        assert files == []  # and no file, partial or temp
    finally:
        d.kill()
        cleanup(d.root)


def test_bad_clients_get_typed_errors_and_others_are_served(daemon: Daemon) -> None:
    def raw(data: bytes) -> bytes:
        s = socket.socket(socket.AF_UNIX)
        s.settimeout(10)
        s.connect(daemon.socket)
        s.sendall(data)
        s.shutdown(socket.SHUT_WR)  # half-close: the daemon answers, then closes
        out = b""
        try:
            while chunk := s.recv(65536):
                out += chunk
        except TimeoutError:
            pass
        s.close()
        return out

    def error_code(reply: bytes) -> str:
        msgs = P.FrameDecoder().feed(reply)
        return str(msgs[-1].params["code"] if msgs[-1].kind == P.NOTIFICATION else msgs[-1].error["code"])  # type: ignore[index]

    assert error_code(raw(b"\xff\xff\xff\xff\0\0\0\0")) == "frame_too_large"
    body = b"\xc1"
    assert error_code(raw(len(body).to_bytes(4, "little") + b"\0\0\0\0" + body)) == "protocol_error"
    status = b"".join(bytes(b) for b in P.request(1, "status", {}))
    assert error_code(raw(status)) == "protocol_error"  # no hello first
    hello = b"".join(bytes(b) for b in P.request(1, "hello", {"version": 99}))
    assert error_code(raw(hello)) == "unsupported_protocol"
    ok = b"".join(bytes(b) for b in P.request(1, "hello", {"version": 1})) + b"".join(
        bytes(b) for b in P.request(2, "nope", {})
    )
    wrong_shape = {"identity": [1], "namespace": "", "tokens": b"", "codec_provider": "x"}  # a list, not a map
    more = P.request(3, "lookup", {"bad": 1}) + P.request(4, "lookup", wrong_shape)
    msgs = P.FrameDecoder().feed(raw(ok + b"".join(bytes(b) for b in more)))
    codes = {m.msgid: (m.error or {}).get("code") for m in msgs if m.kind == P.RESPONSE}
    assert codes == {1: None, 2: "unknown_method", 3: "bad_params", 4: "bad_params"}
    assert "Traceback" not in daemon.read_log()  # a client's mistake is not logged as the daemon's bug
    # the daemon still serves a well-behaved client
    assert daemon.cli("status", "--socket", daemon.socket).returncode == 0


def test_sigterm_with_a_full_queue_finishes_the_work() -> None:
    d = Daemon(new_root(), ["--cap", "64MiB", "--durability", "fsync"]).start()
    items = 12  # 16 MiB each, droppable: the 64 MiB queue sheds the oldest while the disk falls behind
    try:

        async def go() -> tuple[list[Any], dict[str, int]]:
            hold = asyncio.Event()

            async def lease(fn: Any) -> Any:  # the daemon's writes wait for this engine until the signal is sent
                await hold.wait()
                return await asyncio.to_thread(fn)  # a grant is held off the loop until the step is done

            client = await AsyncClient.open(d.socket, identity=spilld.Identity("big"), grant_lease=True, lease=lease)
            client.lease = spilld.NoLease()  # shipping takes no turn of ours; only the daemon's writes wait
            from mlx_lm.models import cache as C

            from tests.caches import fill

            futs = [
                client.spill([i, *range(1999)], [fill(C.KVCache(), 2000, heads=8, dim=128, seed=i) for _ in range(2)])
                for i in range(items)
            ]
            await client.queue.drain()  # every item shipped; wait until the daemon has queued every commit
            client.lease = lease
            while True:
                q = (await client.status())["queue"]
                if q["pending_items"] + q["stored"] + q["dropped"] == items:
                    break
                await asyncio.sleep(0.01)
            assert d.proc is not None
            d.proc.send_signal(signal.SIGTERM)  # nothing arrives after this: no item can be shed by a newer one
            await asyncio.sleep(0.5)
            hold.set()  # the drain writes what is queued
            return [await f for f in futs], q

        results, at_term = asyncio.run(go())
        assert d.proc is not None and d.proc.wait(60) == 0
        assert at_term["pending_items"] >= 1  # the queue was not empty at SIGTERM (else this tests nothing)
        outcomes = [r.outcome for r in results]
        assert set(outcomes) <= {spilld.Outcome.STORED, spilld.Outcome.DROPPED}  # each owner was told
        # Everything queued at SIGTERM was written: the only drops are the ones made before it, by the cap.
        assert outcomes.count(spilld.Outcome.DROPPED) == at_term["dropped"]
        assert outcomes.count(spilld.Outcome.STORED) == at_term["stored"] + at_term["pending_items"]
        files = [f for _, _, fs in os.walk(d.dir) for f in fs if f.endswith(".spilld")]
        assert len(files) == outcomes.count(spilld.Outcome.STORED)  # stored means on disk
    finally:
        d.kill()
        cleanup(d.root)


def test_sync_client_from_an_engine_thread(daemon: Daemon) -> None:

    from spilld.client import Client

    model = tiny_llama()
    prompt = random_tokens(24, seed=8)
    client = Client(daemon.socket, identity=spilld.model_identity(model, model_id="sync"), name="sync")
    try:
        out: list[Any] = []

        def engine() -> None:  # decodes in its own thread, as mlx-lm's server does
            cache, _ = prefill(model, prompt)
            out.append((client.spill(prompt, cache).result(timeout=60), next_logits(model, cache, 3)))

        th = mlxthreads.start_thread(engine, "engine")  # an engine thread frees its mlx streams as it ends
        th.join()
        settled, want = out[0]
        assert settled.stored
        got = client.load([*prompt, 3])
        assert got is not None and mx.array_equal(next_logits(model, got.caches, 3), want).item()
        assert client.drain(timeout=10).done
        assert client.barrier("k").result(timeout=30).stored
        assert client.cancel(key="nothing") == 0
    finally:
        client.close()


def test_busy_for_non_droppable_items_over_the_cap() -> None:
    from mlx_lm.models import cache as C

    from tests.caches import fill

    d = Daemon(new_root(), ["--cap", "1MiB"]).start()
    try:
        big = [fill(C.KVCache(), 1024, heads=4, dim=64)]  # 2 MiB of f32 tensors: over the 1 MiB cap, within 2 x cap
        header, sources = spilld.saver.plan(list(range(1024)), big, identity=spilld.Identity("b"))
        tensors = [
            b"".join(bytes(r) for r in spilld.saver.TensorBytes(i, s, src, None).runs_now())
            for i, (s, src) in enumerate(zip(header.slots(), sources, strict=True))
        ]
        s = socket.socket(socket.AF_UNIX)
        s.connect(d.socket)
        dec = P.FrameDecoder()
        out: list[P.Message] = []

        def send(bufs: list[Any]) -> None:
            s.sendall(b"".join(bytes(b) for b in bufs))

        def wait(msgid: int) -> P.Message:
            while not any(m.kind == P.RESPONSE and m.msgid == msgid for m in out):
                out.extend(dec.feed(s.recv(1 << 20)))
            return next(m for m in out if m.kind == P.RESPONSE and m.msgid == msgid)

        send(P.request(1, "hello", {"version": 1}))
        wait(1)
        send(P.request(2, "spill", {"header": header.to_wire(), "droppable": False}))
        sid = wait(2).result["spill"]
        send(P.request(10, "spill", {"header": header.to_wire(), "droppable": False}))
        err = wait(10).error  # the first one's room is held: a second is refused before it sends a byte,
        assert err is not None and err["code"] == "busy"  # never at its commit, after all of them
        for i, data in enumerate(tensors):
            send(P.notification("put", {"spill": sid, "index": i, "offset": 0}, data))
        # commit the first and ask for a second in one write: the queue holds 2 MiB when the second is weighed
        send(
            P.request(3, "commit", {"spill": sid})
            + P.request(4, "spill", {"header": header.to_wire(), "droppable": False})
        )
        assert wait(4).error == {"code": "busy", "message": wait(4).error["message"]}  # type: ignore[index]
        assert wait(3).result["outcome"] == "stored"  # an empty queue takes one item larger than the cap
        send(P.request(5, "spill", {"header": header.to_wire(), "droppable": False}))
        assert wait(5).error is None  # once it drained, the next is accepted
        s.close()
    finally:
        d.kill()
        cleanup(d.root)


@pytest.mark.asyncio
async def test_a_lease_grantor_is_asked_before_each_write_step(daemon: Daemon) -> None:
    """How many grants are asked for; that a grant keeps the daemon's writes out of the engine's steps (and that
    without one they overlap) is tests/test_lease_grant.py's."""
    asked = 0
    engine_busy = asyncio.Lock()

    async def lease(fn: Any) -> Any:  # the engine's lease: a turn between its decode steps
        nonlocal asked
        async with engine_busy:
            asked += 1
            return await asyncio.to_thread(fn)  # a grant holds the lease until the daemon's step is done

    model = tiny_llama()
    prompt = random_tokens(12)
    cache, _ = prefill(model, prompt)
    client = await AsyncClient.open(daemon.socket, identity=spilld.Identity("g"), lease=lease, grant_lease=True)
    res = await client.spill(prompt, cache)
    assert res.stored
    n_tensors = 2 * len(cache)
    # once per tensor to take its bytes here, once per write step of the daemon's (each tensor, the publish)
    assert asked == 2 * n_tensors + 1
    plain = await AsyncClient.open(daemon.socket, identity=spilld.Identity("p"), lease=lease)
    before = asked
    assert (await plain.spill(prompt, cache)).stored
    assert asked - before == n_tensors  # no grantor: the daemon's lease is free
    await client.close()
    await plain.close()


@pytest.mark.asyncio
@pytest.mark.parametrize("shm", [True, False], ids=["shm", "inline"])
async def test_both_ingest_paths_store_exact_data(daemon: Daemon, shm: bool) -> None:
    from mlx_lm.models import cache as C

    from tests.caches import fill, live, same

    cache = [fill(C.KVCache(), 3000, heads=8, dim=128, seed=3)]  # 2 x 5.9 MiB: several segments
    want = live(fill(C.KVCache(), 3000, heads=8, dim=128, seed=3))
    client = await AsyncClient.open(daemon.socket, identity=spilld.Identity("x"), shm=shm)
    for i in range(3):
        assert (await client.spill([i, *range(2999)], cache)).stored
    got = await client.load([0, *range(2999), 5])
    assert got is not None and same(live(got.caches[0]), want)
    if shm:
        pool = client._pool
        assert (
            pool is not None and pool._free is not None and pool._free.qsize() == pool._count
        )  # every segment came back
    await client.close()


@pytest.mark.asyncio
async def test_inline_payloads_reach_the_socket_as_the_engines_views(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A frame's parts are written one by one, each payload as a view of the snapshot's bytes: ``writelines``
    joins them into a new bytes object first on Python 3.11's own loop (every byte copied once more, on the
    engine's loop) and queues them without the pause ``drain`` waits on under 3.13.0."""
    from mlx_lm.models import cache as C

    from tests.caches import fill

    cache = [fill(C.KVCache(), 3000, heads=8, dim=128, seed=3)]  # 2 x 5.9 MiB
    client = await AsyncClient.open(daemon.socket, identity=spilld.Identity("x"), shm=False)
    writer = client._writer
    assert writer is not None
    written: list[tuple[type, int]] = []
    real_write = writer.write

    def write(data: bytes | memoryview) -> None:
        written.append((type(data), memoryview(data).nbytes))
        real_write(data)

    def writelines(_: Any) -> None:
        raise AssertionError("writelines: every payload joined into a copy (Python 3.11)")

    monkeypatch.setattr(writer, "write", write)
    monkeypatch.setattr(writer, "writelines", writelines)
    assert (await client.spill(list(range(3000)), cache)).stored
    big = [(kind, n) for kind, n in written if n >= 1 << 20]
    assert sum(n for _, n in big) >= 2 * 3000 * 8 * 128 * 2  # both tensors went through write, inline
    assert all(kind is memoryview for kind, _ in big), big  # never a joined copy
    await client.close()


@pytest.mark.asyncio
async def test_an_item_larger_than_the_segment_pool_still_ships(daemon: Daemon) -> None:
    from mlx_lm.models import cache as C

    from spilld import shm
    from tests.caches import fill, live, same

    cache = [fill(C.KVCache(), 2048, heads=8, dim=128, seed=i) for i in range(3)]  # 6 tensors of 4 MiB
    client = await AsyncClient.open(daemon.socket, identity=spilld.Identity("x"))
    client._pool = shm.ShmPool(segments=2, size=4 * 1024 * 1024)  # fewer segments than tensors
    assert (await asyncio.wait_for(client.spill(list(range(2048)), cache), 60)).stored
    got = await client.load([*range(2048), 1])
    assert got is not None and all(same(live(a), live(b)) for a, b in zip(got.caches, cache, strict=True))
    await client.close()


@pytest.mark.asyncio
async def test_drain_timeout_exits_3(daemon: Daemon) -> None:
    hold = asyncio.Event()

    async def lease(fn: Any) -> Any:  # an engine that never has a free moment
        await hold.wait()
        return await asyncio.to_thread(fn)  # a grant is held off the loop until the daemon's step is done

    from mlx_lm.models import cache as C

    from tests.caches import fill

    granting = await AsyncClient.open(daemon.socket, identity=spilld.Identity("busy"), grant_lease=True, lease=lease)
    # ship with a free lease of our own, so only the daemon's write waits on the grantor
    granting.lease = spilld.NoLease()
    fut = granting.spill(list(range(8)), [fill(C.KVCache(), 8)])
    await granting.queue.drain()
    granting.lease = lease
    r = await asyncio.get_running_loop().run_in_executor(
        None, lambda: daemon.cli("drain", "--socket", daemon.socket, "--timeout", "1")
    )
    assert r.returncode == 3 and "still queued" in r.stdout
    hold.set()
    assert (await fut).stored
    await granting.close()


@pytest.mark.asyncio
async def test_drain_exits_3_when_what_it_waited_for_ended_not_stored(daemon: Daemon) -> None:
    """Found in review: a drain whose items were cancelled or failed printed "everything acknowledged is durable"
    and exited 0. Here the engine whose lease a write waits on refuses it: that write fails."""
    from mlx_lm.models import cache as C

    from tests.caches import fill

    hold = asyncio.Event()

    async def lease(fn: Any) -> Any:
        await hold.wait()
        raise RuntimeError("the engine refuses")

    granting = await AsyncClient.open(daemon.socket, identity=spilld.Identity("no"), grant_lease=True, lease=lease)
    granting.lease = spilld.NoLease()
    fut = granting.spill(list(range(8)), [fill(C.KVCache(), 8)])
    await granting.queue.drain()
    granting.lease = lease
    loop = asyncio.get_running_loop()
    drained = loop.run_in_executor(None, lambda: daemon.cli("drain", "--socket", daemon.socket, "--timeout", "60"))
    await asyncio.sleep(1.0)
    hold.set()
    r = await drained
    assert r.returncode == 3 and "1 item ended not stored" in r.stdout, r
    assert not (await fut).stored
    await granting.close()


@pytest.mark.asyncio
async def test_a_write_waiting_on_a_grantor_that_left_goes_on_unheld_at_once(daemon: Daemon) -> None:
    """A granting engine that closes its connection can keep nothing out: found in review, its EOF went unseen
    while the connection waited for the write's commit, so the write waited for a grant until --request-timeout
    (30 s) and failed."""
    import time

    from mlx_lm.models import cache as C

    from tests.caches import fill

    never, asked = asyncio.Event(), asyncio.Event()

    async def lease(fn: Any) -> Any:
        asked.set()
        await never.wait()

    granting = await AsyncClient.open(daemon.socket, identity=spilld.Identity("left"), grant_lease=True, lease=lease)
    granting.lease = spilld.NoLease()
    tokens = list(range(8))
    granting.spill(tokens, [fill(C.KVCache(), 8)])
    await granting.queue.drain()
    granting.lease = lease  # shipped with a free lease: only the daemon's write waits on the grant
    await asyncio.wait_for(asked.wait(), 20)  # the daemon's write now waits for a grant
    t0 = time.monotonic()
    await granting.close(timeout=0)
    async with AsyncClient(daemon.socket, identity=spilld.Identity("left")) as other:
        assert (await other.drain(timeout=20)).done
        assert (await other.drain(timeout=math.inf)).done  # found in review: inf was sent, and refused (bad_params)
        assert time.monotonic() - t0 < 10  # not the request timeout (30 s)
        got = await other.load([*tokens, 1])
        assert got is not None and got.tokens == tokens


def test_open_spills_per_connection_are_bounded(daemon: Daemon) -> None:
    from spilld.daemon import MAX_OPEN_SPILLS

    header, _ = spilld.saver.plan([1, 2], [], identity=spilld.Identity("m"))
    s = socket.socket(socket.AF_UNIX)
    s.connect(daemon.socket)
    data = b"".join(bytes(b) for b in P.request(1, "hello", {"version": 1}))
    for i in range(MAX_OPEN_SPILLS + 1):
        data += b"".join(bytes(b) for b in P.request(2 + i, "spill", {"header": header.to_wire()}))
    data += b"".join(bytes(b) for b in P.notification("put", {"spill": 1, "index": 0, "offset": 0}, b""))
    s.sendall(data)
    s.shutdown(socket.SHUT_WR)
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    s.close()
    errs = [m.error for m in P.FrameDecoder().feed(out) if m.kind == P.RESPONSE and m.error]
    assert [e["code"] for e in errs] == ["busy"]  # only the one over the limit


@pytest.mark.asyncio
async def test_received_bytes_are_written_in_batches_not_a_lease_call_a_tensor() -> None:
    """With no engine granting, the daemon writes what it received in batches (``WRITE_BATCH_BYTES``): far fewer
    lease calls than tensors, and the entry loads exactly."""
    from mlx_lm.models import cache as C

    from spilld.daemon import Daemon as InProcess
    from tests.caches import fill, live, same

    root = new_root()
    cfg = quiet_config(root, block_tokens=16)
    daemon = InProcess(cfg)
    inner, calls = daemon.lease, 0

    def counting(fn: Any) -> Any:
        nonlocal calls
        calls += 1
        return inner(fn)

    daemon.lease = counting
    await daemon.start()
    client = None
    try:
        client = await AsyncClient.open(cfg.socket, identity=spilld.Identity("batches"))
        cs = [fill(C.KVCache(), 64, seed=i) for i in range(4)]  # 4 blocks of 8 tensors, and a manifest
        assert (await client.spill(list(range(64)), cs, droppable=False)).stored
        assert calls <= 5, calls  # one batch a file; a lease call a tensor would be 4 * 9 + 1
        got = await client.load([*range(64), 1])
        assert got is not None and same([live(c) for c in got.caches], [live(c) for c in cs])
    finally:
        if client is not None:
            await client.close()
        await daemon.stop()
        cleanup(root)


def test_spilld_drain_keeps_to_its_timeout_when_the_daemon_stops_answering() -> None:
    """Found in review: `spilld drain --timeout 2` sent the timeout to the daemon and then waited for its answer
    without a bound: a daemon that stopped answering (hung, SIGSTOP) held a shutdown script for ever."""
    import subprocess
    import sys

    from spilld.cli.running import ANSWER_GRACE_S
    from tests.test_limits import queue_held

    with serving("--cap", "64MiB") as d, queue_held(d):  # the drain is answered only at its timeout
        assert d.proc is not None
        cmd = [sys.executable, "-m", "spilld", "drain", "--socket", d.socket, "--timeout", "2"]
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 30
        while "spilld drain" not in d.read_log() and time.monotonic() < deadline:
            time.sleep(0.01)  # its hello answered
        time.sleep(0.5)  # its drain is waiting
        os.kill(d.proc.pid, signal.SIGSTOP)
        try:
            out, _ = proc.communicate(timeout=2 + ANSWER_GRACE_S + 20)
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        assert proc.returncode == 3 and "timeout" in out, out
        assert time.monotonic() - t0 < 2 + ANSWER_GRACE_S + 10


def test_drain_keeps_to_its_timeout_when_the_daemon_hangs_before_its_hello() -> None:
    """Found in review: the connection's hello waited CONNECT_TIMEOUT_S (10 s) whatever ``--timeout`` said, and
    the message named a time that was not waited (``did not answer within 6 s`` after 10.2 s). Then (found in
    review again) the answer's grace bounded the hello too. The hello is bounded by ``--timeout`` alone (at least
    1 s), the message says how long it waited, and a daemon that never answers it is unreachable: exit 4."""
    import subprocess
    import sys

    from spilld.control import CONNECT_TIMEOUT_S

    with serving("--cap", "64MiB") as d:
        assert d.proc is not None
        os.kill(d.proc.pid, signal.SIGSTOP)  # it accepts (the kernel does), and answers nothing
        try:
            t0 = time.monotonic()
            cmd = [sys.executable, "-m", "spilld", "drain", "--socket", d.socket, "--timeout", "0.5"]
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
            took = time.monotonic() - t0
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
    assert r.returncode == 4 and "no answer from spilld" in r.stderr, r.stdout + r.stderr
    said = float(r.stderr.split("within ")[1].split(" s")[0])
    assert said == 1 and said <= took < CONNECT_TIMEOUT_S, (said, took)


def test_a_long_call_gives_up_when_the_daemon_says_nothing_for_its_silence_bound() -> None:
    """Found in review: `spilld evict` through the daemon waited for its answer without a bound; it now gives up
    when the daemon says nothing (no answer, no progress) for EVICT_SILENCE_S (here the same bound, 1 s)."""
    from spilld import errors
    from spilld.control import Control

    with serving("--cap", "64MiB") as d:
        assert d.proc is not None
        c = Control(d.socket, "silence")
        os.kill(d.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            with pytest.raises(errors.Timeout):
                c.call("status", {}, timeout=None, silence=1.0)
            assert time.monotonic() - t0 < 5
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
            c.close()


@pytest.mark.asyncio
async def test_a_lookup_whose_entry_went_while_the_shared_tier_was_asked_looks_again() -> None:
    """Found in review: the entry a lookup found was answered after the fill from the shared tier failed, though a
    put had superseded (and unlinked) it meanwhile: the client read a file that was gone, and prefilled everything."""
    from mlx_lm.models import cache as C

    from spilld import format as fmt
    from tests.caches import fill
    from tests.hostile_memory import in_process

    ident = spilld.Identity("stale", "cfg", "tok", "")
    tokens = list(range(1000, 1100))

    class HeldFill:  # the shared tier, slow to answer, then nothing
        def __init__(self) -> None:
            self.entered, self.go = asyncio.Event(), asyncio.Event()

        async def fill(self, *a: Any) -> bool:
            self.entered.set()
            await self.go.wait()
            return False

        def counters(self) -> dict[str, Any]:
            return {}

        async def close(self, timeout_s: float) -> None:
            pass

    async with in_process("stale", block_tokens=16) as (daemon, wire):
        store = daemon.store
        await store.put(tokens[:40], [fill(C.KVCache(), 40, seed=s) for s in range(2)], ident)
        daemon.remote = remote = HeldFill()
        params = {"identity": ident.to_wire(), "tokens": fmt.encode_tokens(tokens)}
        asked = asyncio.ensure_future(wire.call("lookup", params))
        await asyncio.wait_for(remote.entered.wait(), 10)
        await store.put(tokens[:60], [fill(C.KVCache(), 60, seed=s) for s in range(2)], ident)  # the next turn
        remote.go.set()
        answer, err = await asyncio.wait_for(asked, 10)
        daemon.remote = None
    assert err is None and answer["hit"] and answer["matched"] == 60, answer
