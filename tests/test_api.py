"""The public surface: what ``spilld`` exports, the error classes and their codes, what a process imports."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import os
import subprocess
import sys
import tempfile
import types
from typing import Any

import pytest

import spilld
from spilld import errors
from spilld.client import AsyncClient
from spilld.config import Config
from spilld.daemon import Daemon
from spilld.entries import checkpoint_namespace
from spilld.format import Identity

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _python(code: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, env=env)


def test_all_is_sorted_small_and_every_name_resolves() -> None:
    assert spilld.__all__ == sorted(spilld.__all__)
    assert len(spilld.__all__) <= 24
    for name in spilld.__all__:
        assert getattr(spilld, name) is not None
    for internal in ("SpillQueue", "SpillItem", "Store", "save_steps", "Header", "identity"):
        assert internal not in spilld.__all__
    with pytest.raises(AttributeError):
        spilld.SpillQueue  # noqa: B018  (reachable from spilld.queue, not from the package)


def test_import_spilld_identity_as_m_gives_the_module() -> None:
    import spilld.identity as m

    assert isinstance(m, types.ModuleType) and callable(m.model_identity)


def test_errors_subclass_the_builtins_they_resemble() -> None:
    assert issubclass(errors.Timeout, TimeoutError)
    assert issubclass(errors.ConnectionLost, ConnectionError)
    assert issubclass(errors.PeerRefused, PermissionError)
    assert issubclass(errors.BadParams, ValueError)
    assert not issubclass(errors.Busy, ConnectionError)  # the daemon is there and said "later"
    for cls in (errors.Timeout, errors.ConnectionLost, errors.PeerRefused):
        rebuilt = errors.error_from_code(cls.code, "why")
        assert type(rebuilt) is cls and str(rebuilt) == "why" and rebuilt.code == cls.code


def test_every_code_is_mapped_by_errors_alone() -> None:
    """A process that imports only ``spilld.errors`` rebuilds every code any module can send, as its own class."""
    code = """
import json, spilld.errors as e
print(json.dumps({c: k.__name__ for c, k in e.ERRORS_BY_CODE.items()}))
"""
    alone = json.loads(_python(code).stdout)
    for want in ("peer_refused", "already_running", "activation_error", "busy", "shm_refused", "timeout"):
        assert want in alone, want
    # importing every module adds no code, and no module defines an error class outside errors.py
    import spilld.cli
    import spilld.client
    import spilld.daemon
    import spilld.service.activation
    import spilld.shm  # noqa: F401

    assert {c: k.__name__ for c, k in errors.ERRORS_BY_CODE.items()} == alone
    every = errors._all_subclasses(errors.SpillError)
    assert {k.__module__ for k in every} == {"spilld.errors"}
    assert len({k.code for k in every}) == len(every)  # one class per code, counted over classes


@pytest.mark.asyncio
async def test_a_busy_daemon_is_busy_not_a_lost_connection() -> None:
    root = tempfile.mkdtemp(prefix="spilld-api-")
    cfg = Config(dir=os.path.join(root, "store"), socket=os.path.join(root, "run", "s.sock"), max_clients=1)
    daemon = Daemon(cfg)
    await daemon.start()
    first = await AsyncClient.open(cfg.socket, identity=Identity(model_id="m"))
    try:
        with pytest.raises(errors.Busy):
            await AsyncClient.open(cfg.socket, identity=Identity(model_id="m"), timeout=10)
    finally:
        await first.close(timeout=10)
        await daemon.stop()


MLX_MODULES = ("mlx", "mlx_lm", "transformers", "torch")


def _heavy(modules: list[str]) -> list[str]:
    return sorted(m for m in modules if m.split(".")[0] in MLX_MODULES)


def test_the_protocol_the_package_and_the_daemon_never_import_mlx() -> None:
    code = """
import json, sys
import spilld, spilld.protocol, spilld.errors, spilld.format, spilld.daemon, spilld.cli, spilld.store
print(json.dumps(sorted(sys.modules)))
"""
    out = _python(code)
    assert out.returncode == 0, out.stderr
    assert _heavy(json.loads(out.stdout)) == []


@pytest.mark.asyncio
async def test_a_daemon_process_serves_stores_and_drains_without_mlx(monkeypatch: pytest.MonkeyPatch) -> None:
    """The daemon's whole life (start, scan, spills received and written, lookups, drain, stop) imports no mlx."""
    from mlx_lm.models.cache import KVCache

    from tests.caches import fill, live, same
    from tests.daemons import Daemon as DaemonProcess
    from tests.daemons import cleanup, new_root

    monkeypatch.setenv("PYTHONPROFILEIMPORTTIME", "1")  # every import the daemon makes goes to its log
    d = DaemonProcess(new_root(), ["--cap", "64MiB"]).start()
    monkeypatch.delenv("PYTHONPROFILEIMPORTTIME")
    try:
        client = await AsyncClient.open(d.socket, identity=Identity(model_id="m"))
        tokens, cache = list(range(1, 41)), fill(KVCache(), 40)
        assert (await client.spill(tokens, [cache])).stored
        loaded = await client.load([*tokens, 1])
        assert loaded is not None and same(live(loaded.caches[0]), live(cache))
        assert (await client.drain(timeout=30)).done
        await client.close(timeout=30)
        assert d.stop() == 0
    finally:
        d.kill()
        log = d.read_log()
        cleanup(d.root)
    imported = [line.rsplit("|", 1)[-1].strip() for line in log.splitlines() if line.startswith("import time:")]
    assert "spilld.daemon.server" in imported and "spilld.saver" in imported  # the check sees the daemon's imports
    assert _heavy(imported) == []


def test_the_three_ways_in_share_names_and_parameters() -> None:
    import inspect

    from spilld.client import Client
    from spilld.spiller import Spiller

    names = (
        "spill",
        "lookup",
        "load",
        "barrier",
        "checkpoint",
        "resume",
        "finish",
        "cancel",
        "status",
        "drain",
        "close",
    )
    for name in names:
        sigs = [inspect.signature(getattr(cls, name)) for cls in (Spiller, AsyncClient, Client)]
        params = [[p for p in s.parameters if p != "action"] for s in sigs]  # in process, a barrier may run code
        assert params[0] == params[1] == params[2], name
        defaults = [[p.default for p in s.parameters.values() if p.name != "action"] for s in sigs]
        assert defaults[0] == defaults[1] == defaults[2], name
    for name in ("lookup", "load", "resume", "cancel", "status"):  # awaited on both asyncio ways in; the rest not
        assert inspect.iscoroutinefunction(getattr(Spiller, name)) and inspect.iscoroutinefunction(
            getattr(AsyncClient, name)
        ), name
    for name in ("spill", "barrier", "checkpoint", "finish"):  # queued at once: a future of the outcome
        assert not any(inspect.iscoroutinefunction(getattr(cls, name)) for cls in (Spiller, AsyncClient)), name
    assert not any(inspect.iscoroutinefunction(getattr(Client, name)) for name in names)
    for cls in (Spiller, AsyncClient):
        assert inspect.iscoroutinefunction(cls.lookup) and inspect.iscoroutinefunction(cls.load)
        assert hasattr(cls, "open") and hasattr(cls, "__aenter__") and hasattr(cls, "spill_threadsafe")
    assert not inspect.iscoroutinefunction(Client.lookup) and hasattr(Client, "__enter__")
    assert not hasattr(Spiller, "restore") and not hasattr(AsyncClient, "connect")
    # ``behind``, the one parameter a spill may name an earlier spill with, means the same on each (one paragraph)
    said = {(inspect.getdoc(cls.spill) or "").partition("``behind``")[2] for cls in (Spiller, AsyncClient, Client)}
    assert len(said) == 1 and "" not in said
    # found in review: a Spiller queued 2 GiB before shedding, a client 1 GiB
    caps = {inspect.signature(cls.__init__).parameters["queue_cap"].default for cls in (Spiller, AsyncClient)}
    assert len(caps) == 1


@pytest.mark.asyncio
async def test_a_spill_before_open_is_not_started_on_every_way_in(tmp_path: Any) -> None:
    """Found in review: a Spiller used before ``open`` raised a bare RuntimeError, an AsyncClient ConnectionLost
    (as if a daemon had gone). Both raise ``NotStarted`` now, a RuntimeError and a SpillError."""
    from mlx_lm.models.cache import KVCache

    from tests.caches import fill

    assert issubclass(errors.NotStarted, RuntimeError)
    ident = Identity(model_id="m")
    for way in (spilld.Spiller(tmp_path, identity=ident), AsyncClient(str(tmp_path / "s.sock"), identity=ident)):
        with pytest.raises(errors.NotStarted, match="not started"):
            way.spill([1, 2], [fill(KVCache(), 2)])
        with pytest.raises(errors.NotStarted, match="not started"):
            way.barrier()


@pytest.mark.asyncio
async def test_bad_arguments_are_bad_params_on_every_way_in(tmp_path: Any) -> None:
    """Found in review: a Spiller's lookup cut 1.5 to 1 and answered a hit for a token never stored; the clients
    raised a bare struct.error. Then (found in review too): token ids that are not u32 ints, a ``cancel`` that names
    nothing and a namespace of the checkpoints' reserved prefix were a bare ValueError on every way in (a spill's
    ``Settled.error`` too): ``BadParams``, a SpillError, now (still a ValueError)."""
    from mlx_lm.models.cache import KVCache

    from spilld.client import Client
    from tests.caches import fill
    from tests.daemons import serving

    bad = ([1.5, 2.0, 3.0], [1, -2, 3], [1, 2**32, 3], [[1, 2], [3]], [1, 2**70, 3], [1, None, 3])
    reserved = checkpoint_namespace("x")  # (a checkpoint's namespace: an engine's may not pose as one)

    async def refused(way: Any, sync: bool = False) -> None:
        async def call(fn: Any, *args: Any, **kw: Any) -> Any:
            return await asyncio.to_thread(fn, *args, **kw) if sync else await fn(*args, **kw)

        async def settled(fut: Any) -> Any:
            return await asyncio.to_thread(fut.result, 30) if sync else await fut

        for tokens in bad:
            for fn in (way.lookup, way.load):
                with pytest.raises(errors.BadParams):
                    await call(fn, tokens)
            failed = await settled(way.spill(tokens, [fill(KVCache(), 3)]))
            assert isinstance(failed.error, errors.BadParams), failed
        for fn in (way.lookup, way.load):
            with pytest.raises(errors.BadParams, match="reserved"):
                await call(fn, [1, 2, 3], reserved)
        with pytest.raises(errors.BadParams, match="reserved"):
            way.spill([1, 2, 3], [fill(KVCache(), 3)], namespace=reserved)
        with pytest.raises(errors.BadParams, match="namespace or a key"):
            await call(way.cancel)

    async with spilld.Spiller(tmp_path, identity=Identity(model_id="m"), block_tokens=0) as sp:
        assert (await sp.spill([1, 2, 3, 4], [fill(KVCache(), 4)])).stored
        await refused(sp)
    with serving("--cap", "64MiB") as d:
        async with AsyncClient(d.socket, identity=Identity(model_id="m")) as c:
            await refused(c)
        with Client(d.socket, identity=Identity(model_id="m")) as sync:
            await refused(sync, sync=True)


@pytest.mark.asyncio
async def test_a_generation_checkpoint_resumes_through_each_way_in_alike(tmp_path: Any) -> None:
    """Found in review: a client could store a checkpoint but never resume it (only a Spiller had ``resume`` and
    ``finish``), and ``barrier`` took other arguments and gave another result on each way in."""
    import mlx.core as mx

    from spilld.client import Client
    from tests.daemons import serving
    from tests.models import next_logits, prefill, random_tokens, tiny_llama

    model = tiny_llama()
    ident = spilld.model_identity(model, model_id="tiny-llama")
    prompt = random_tokens(40, seed=5)
    cache, _ = prefill(model, prompt)
    live = next_logits(model, prefill(model, prompt)[0], 7)  # the engine's next step (its own cache: this one stays)
    ck = spilld.GenerationCheckpoint("req-1", "", 40, 0, 7, 11, True)
    older = spilld.GenerationCheckpoint("req-1", "", 40, 0, 3, 11, True)

    async def generation(way: Any) -> list[Any]:
        """What one way in answers; every await is the daemon's or the store's, the rest is queued at once."""
        first = way.checkpoint(prompt, cache, older)  # still queued when the newer one comes: cancelled
        second = way.checkpoint(prompt, cache, ck)
        plain = await way.barrier("req-1")
        seen = [(await first).outcome, (await second).outcome, plain.outcome, plain.value]
        assert isinstance(await way.lookup([*prompt, 1]), spilld.Miss)  # a checkpoint is no prefix for lookups
        got = await way.resume("req-1")
        assert got is not None and got.checkpoint == ck and got.tokens == prompt
        assert mx.array_equal(next_logits(model, got.caches, 7), live).item()
        seen += [await way.resume("another") is None, (await way.finish("req-1")).value]
        seen += [await way.resume("req-1") is None]
        queued = way.checkpoint(prompt, cache, ck)  # queued, then its generation is finished at once
        ended = way.finish("req-1")
        seen += [(await queued).outcome, (await ended).value, await way.cancel(key="nothing")]
        return seen

    async with spilld.Spiller(tmp_path / "own", identity=ident) as sp:
        want = await generation(sp)
        assert set(await sp.status()) == {"queue", "store"}
    C = spilld.Outcome
    assert want == [C.CANCELLED, C.STORED, C.STORED, None, True, 1, True, C.CANCELLED, 0, 0]
    with serving("--cap", "64MiB") as d:
        async with AsyncClient(d.socket, identity=ident) as c:
            assert await generation(c) == want
            assert {"queue", "store"} <= set(await c.status())
        with Client(d.socket, identity=ident) as sync:
            assert sync.checkpoint(prompt, cache, ck).result(timeout=30).stored
            got = sync.resume("req-1")
            assert got is not None and mx.array_equal(next_logits(model, got.caches, 7), live).item()
            assert sync.barrier().result(timeout=30).stored
            assert sync.finish("req-1").result(timeout=30).value == 1 and sync.resume("req-1") is None


@pytest.mark.asyncio
async def test_a_checkpoint_is_stored_as_it_was_at_the_call(tmp_path: Any) -> None:
    """Found in review: the checkpoint object was kept by reference until the write, so an engine that moved its
    next token on after the call had the new values stored (or the spill failed as inconsistent)."""
    from mlx_lm.models import cache as C

    from tests.caches import fill
    from tests.daemons import serving

    async def stored_as_called(way: Any) -> None:
        ck = spilld.GenerationCheckpoint("gen-1", "", 10, 2, 111, 7, True)
        fut = way.checkpoint(list(range(12)), [fill(C.KVCache(), 12)], ck)
        ck.pending_token, ck.seed, ck.generated_tokens = 222, 8, 3  # the engine goes on before the write
        assert (await fut).stored
        got = await way.resume("gen-1")
        assert got is not None and got.checkpoint == spilld.GenerationCheckpoint("gen-1", "", 10, 2, 111, 7, True)

    async with spilld.Spiller(tmp_path, identity=spilld.Identity("m")) as sp:
        await stored_as_called(sp)
    with serving("--cap", "64MiB") as d:
        async with AsyncClient(d.socket, identity=spilld.Identity("m")) as c:
            await stored_as_called(c)


@pytest.mark.asyncio
async def test_resume_finds_the_latest_checkpoint_this_codec_provider_can_read(tmp_path: Any) -> None:
    """Found in review: resume took the longest checkpoint of the key whatever its codec provider, so another
    provider's hid the one this engine could read (a miss)."""
    from mlx_lm.models.cache import KVCache

    from spilld.codecs import default_provider
    from tests.caches import fill

    ident = Identity(model_id="m")
    other = default_provider().extended("engine-x/1", [])
    ck = spilld.GenerationCheckpoint("g", "", 24, 8, 1, 0, False)
    async with spilld.Spiller(tmp_path, identity=ident, provider=other) as sp:
        assert (await sp.checkpoint(list(range(32)), [fill(KVCache(), 32)], ck)).stored
    async with spilld.Spiller(tmp_path, identity=ident) as sp:
        ours = dataclasses.replace(ck, original_prompt_tokens=16)
        assert (await sp.checkpoint(list(range(24)), [fill(KVCache(), 24)], ours)).stored
        got = await sp.resume("g")
        assert got is not None and got.tokens == list(range(24))
        assert [len(e.tokens) for e in sp.store.index.checkpoints[checkpoint_namespace("g")].values()] == [32, 24]
        assert (await sp.finish("g")).value == 2 and sp.store.index.checkpoints == {}  # both go, whoever wrote them


@pytest.mark.asyncio
async def test_spiller_typed_results(tmp_path: Any) -> None:
    from mlx_lm.models.cache import KVCache

    from spilld.saver import SaveResult
    from tests.caches import fill

    tokens = list(range(1, 30))
    async with spilld.Spiller(tmp_path, identity=Identity(model_id="m")) as sp:
        settled = await sp.spill(tokens, [fill(KVCache(), 29)])
        assert settled.outcome is spilld.Outcome.STORED and isinstance(settled.value, SaveResult)
        hit = await sp.lookup([*tokens, 5])
        assert hit == spilld.Hit(settled.value.path, 29, 29, True)
        assert isinstance(await sp.lookup([99, 98]), spilld.Miss)
        loaded = await sp.load([*tokens, 5])
        assert loaded is not None and loaded.tokens == tokens
        assert await sp.drain(1) == spilld.DrainReport(True, 0, 0)
        with pytest.raises(RuntimeError, match="spill_threadsafe"):
            await asyncio.to_thread(sp.spill, tokens, [fill(KVCache(), 29)])  # another thread: the other method


@pytest.mark.asyncio
async def test_a_client_call_waits_its_timeout_once_and_says_shipped_only_locally() -> None:
    """Against a daemon frozen with SIGSTOP: drain and close each return within their one timeout."""
    import signal
    import time

    from mlx_lm.models.cache import KVCache

    from spilld.saver import SaveResult
    from tests.caches import fill
    from tests.daemons import Daemon as DaemonProcess
    from tests.daemons import cleanup, new_root

    d = DaemonProcess(new_root(), ["--cap", "64MiB"]).start()
    try:
        async with spilld.AsyncClient(d.socket, identity=Identity(model_id="m"), timeout=5) as client:
            local = []
            client.queue.enqueue = _recording(client.queue.enqueue, local)  # type: ignore[method-assign]
            settled = await client.spill(list(range(1, 30)), [fill(KVCache(), 29)])
            assert settled.stored and isinstance(settled.value, SaveResult) and settled.value.path
            assert [s.outcome for s in local] == [spilld.Outcome.SHIPPED]  # the local queue never says "stored"
            hit = await client.lookup([*range(1, 30), 5])
            assert isinstance(hit, spilld.Hit) and hit.path == settled.value.path and hit.matched == 29
            assert client.server["remote"] is False  # no shared tier: a lookup is a probe, bounded short
            assert d.proc is not None
            os.kill(d.proc.pid, signal.SIGSTOP)
            try:
                client.spill(list(range(1, 40)), [fill(KVCache(), 39)])
                t0 = time.monotonic()
                rep = await client.drain(timeout=1.0)
                took = time.monotonic() - t0
                assert not rep.done and took < 1.0 + 1.5  # one deadline (plus the answer's grace), not 2x or 3x
                t0 = time.monotonic()
                rep = await client.close(timeout=1.0)
                assert not rep.done and time.monotonic() - t0 < 1.0 + 1.0
            finally:
                os.kill(d.proc.pid, signal.SIGCONT)
    finally:
        d.kill()
        cleanup(d.root)


@pytest.mark.asyncio
async def test_close_keeps_its_timeout_when_the_daemon_stops_reading_mid_spill() -> None:
    """A daemon that stops reading while a spill is sent inline: the socket fills and the ship waits for room.
    Found in review: close's timeout cancelled the ship, whose abort message then waited for room forever, and so
    did close (the mlx-lm server's exit hung until the daemon was killed)."""
    import signal
    import time

    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from tests.daemons import Daemon as DaemonProcess
    from tests.daemons import cleanup, new_root

    def layer() -> KVCache:
        c = KVCache()
        k = mx.ones((1, 8, 8192, 128), dtype=mx.float16)
        c.update_and_fetch(k, k + 1)
        mx.eval(c.keys, c.values)
        return c

    d = DaemonProcess(new_root(), ["--cap", "512MiB"]).start()
    assert d.proc is not None
    pid = d.proc.pid
    try:
        client = await spilld.AsyncClient.open(d.socket, identity=Identity(model_id="m"), shm=False)
        real = client._send_tensor

        async def stopping_at_the_first_tensor(*args: Any) -> None:
            os.kill(pid, signal.SIGSTOP)  # the spill was accepted: its tensors fill the socket
            await real(*args)

        client._send_tensor = stopping_at_the_first_tensor  # type: ignore[method-assign]
        try:
            pending = client.spill(list(range(8192)), [layer(), layer()], droppable=False)  # 64 MiB, inline
            await asyncio.sleep(1.0)  # it fills the socket, then waits for room
            t0 = time.monotonic()
            rep = await asyncio.wait_for(client.close(timeout=1.0), 30)  # fails, rather than hangs, if broken
            assert not rep.done and time.monotonic() - t0 < 1.0 + 3.0
            assert not (await pending).stored
        finally:
            os.kill(pid, signal.SIGCONT)
    finally:
        d.kill()
        cleanup(d.root)


@pytest.mark.asyncio
async def test_a_restore_read_in_full_is_returned_even_if_its_touch_fails() -> None:
    """The file was read and checked: a `touch` (the daemon's LRU and histogram) that is not answered must not turn
    it into a miss (found in review)."""
    from mlx_lm.models.cache import KVCache

    from spilld import protocol as P
    from tests.caches import fill
    from tests.daemons import Daemon as DaemonProcess
    from tests.daemons import cleanup, new_root

    d = DaemonProcess(new_root(), ["--cap", "64MiB"]).start()
    try:
        async with spilld.AsyncClient(d.socket, identity=Identity(model_id="m")) as client:
            assert (await client.spill(list(range(1, 30)), [fill(KVCache(), 29)])).stored
            real = client.call

            async def call(method: str, *args: Any, **kw: Any) -> Any:
                if method == "touch":
                    raise P.ConnectionLost("the daemon went away")
                return await real(method, *args, **kw)

            client.call = call  # type: ignore[method-assign]
            got = await client.load([*range(1, 30), 5])
            assert got is not None and got.tokens == list(range(1, 30))
    finally:
        d.kill()
        cleanup(d.root)


@pytest.mark.asyncio
async def test_drain_and_close_count_this_clients_items_the_daemon_did_not_store() -> None:
    """Found in review: the daemon's drain counted only items still queued when it ran, and this client's had been
    answered by then: drain and close said not_stored=0 for spills the daemon dropped."""
    from mlx_lm.models.cache import KVCache

    from tests.caches import fill
    from tests.daemons import Daemon as DaemonProcess
    from tests.daemons import cleanup, new_root

    d = DaemonProcess(new_root(), ["--cap", "64MiB", "--write-budget", "1"]).start()  # a day's budget of 1 byte
    try:
        async with spilld.AsyncClient(d.socket, identity=Identity(model_id="m")) as client:
            assert (await client.spill(list(range(1, 9)), [fill(KVCache(), 8)])).stored  # spends the budget
            shed = client.spill(list(range(100, 108)), [fill(KVCache(), 8)])  # droppable: shed for the budget
            rep = await client.drain(timeout=20)
            assert (await shed).outcome is spilld.Outcome.DROPPED and rep.done and rep.not_stored == 1, rep
            also = client.spill(list(range(200, 208)), [fill(KVCache(), 8)])
            rep = await client.close(timeout=20)
            assert (await also).outcome is spilld.Outcome.DROPPED and rep.not_stored == 1, rep
        # an item that settled before the call is not the call's (found in review: close counted it, drain not)
        async with spilld.AsyncClient(d.socket, identity=Identity(model_id="m")) as client:
            assert (await client.spill(list(range(300, 308)), [fill(KVCache(), 8)])).outcome is spilld.Outcome.DROPPED
            assert (await client.drain(timeout=20)).not_stored == 0
            assert (await client.spill(list(range(400, 408)), [fill(KVCache(), 8)])).outcome is spilld.Outcome.DROPPED
            assert (await client.close(timeout=20)).not_stored == 0
        # a caller that gave up waiting (its future cancelled) gives up the answer, not the count (found in review:
        # the drain said done with nothing lost while the daemon had dropped it)
        async with spilld.AsyncClient(d.socket, identity=Identity(model_id="m")) as client:
            client.spill(list(range(500, 508)), [fill(KVCache(), 8)]).cancel()
            rep = await client.drain(timeout=20)
            assert rep.done and rep.not_stored == 1, rep
    finally:
        d.kill()
        cleanup(d.root)


@pytest.mark.asyncio
async def test_a_second_close_gives_the_first_ones_report_on_every_way_in(tmp_path: Any) -> None:
    """Found in review: the Client's second close gave its first one's report, as design.md says, but a Spiller's and
    an AsyncClient's said done with nothing lost after the first had given up on a spill the engine's lock held."""
    import threading

    from mlx_lm.models.cache import KVCache

    from tests.caches import fill
    from tests.daemons import Daemon as DaemonProcess
    from tests.daemons import cleanup, new_root

    d = DaemonProcess(new_root(), ["--cap", "64MiB"]).start()
    try:
        for name in ("Spiller", "AsyncClient", "Client"):
            lock = threading.Lock()
            lease = spilld.ThreadLockLease(lock)
            ident = Identity(model_id="m")
            if name == "Spiller":
                way: Any = await spilld.Spiller.open(tmp_path, identity=ident, lease=lease)
            elif name == "AsyncClient":
                way = await AsyncClient.open(d.socket, identity=ident, lease=lease)
            else:
                way = spilld.Client(d.socket, identity=ident, lease=lease)
            lock.acquire()  # the engine is mid-step: the spill cannot take its bytes before the close gives up
            fut = way.spill(list(range(8)), [fill(KVCache(), 8)], droppable=False)
            first = way.close(0.2) if name == "Client" else await way.close(0.2)
            lock.release()
            second = way.close(1) if name == "Client" else await way.close(1)
            settled = fut.result(5) if name == "Client" else await fut
            assert not first.done and second == first and not settled.stored, (name, first, second)
    finally:
        d.kill()
        cleanup(d.root)


def _recording(enqueue: Any, out: list[Any]) -> Any:
    def wrapped(item: Any) -> Any:
        fut = enqueue(item)
        fut.add_done_callback(lambda f: out.append(f.result()))
        return fut

    return wrapped


@pytest.mark.asyncio
async def test_a_restore_read_past_its_deadline_raises_storage_timeout_on_every_way_in(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hung disk is said, not passed off as a miss: an engine can then stop asking for a while (found in review:
    every prompt that matched a file on a hung disk held the engine for the whole deadline)."""
    import time

    from mlx_lm.models.cache import KVCache

    from spilld import client as client_mod
    from tests.caches import fill
    from tests.daemons import serving

    tokens = list(range(1, 30))
    ident = Identity(model_id="m")
    async with spilld.Spiller(tmp_path, identity=ident) as sp:
        assert (await sp.spill(tokens, [fill(KVCache(), 29)])).stored
        sp.store.io_timeout = 0.2
        read = sp.store.read_hit
        monkeypatch.setattr(sp.store, "read_hit", lambda *a, **k: (time.sleep(0.6), read(*a, **k))[1])
        with pytest.raises(errors.StorageTimeout):
            await sp.load([*tokens, 1])
        await asyncio.sleep(0.6)  # the read left to its thread ends
    load = client_mod.load
    monkeypatch.setattr(client_mod, "load", lambda *a, **k: (time.sleep(0.6), load(*a, **k))[1])
    # the daemon's --io-timeout bounds the client's read too (found in review: always the default's 30 s)
    with serving("--cap", "64MiB", "--io-timeout", "0.2") as d:
        async with AsyncClient(d.socket, identity=ident) as c:
            assert (await c.spill(tokens, [fill(KVCache(), 29)])).stored
            with pytest.raises(errors.StorageTimeout):
                await c.load([*tokens, 1])
            await asyncio.sleep(0.6)


@pytest.mark.asyncio
async def test_a_stored_spills_result_is_alike_on_every_way_in(tmp_path: Any) -> None:
    """Found in review: a Spiller's ``value.header`` was the stored manifest's (its blocks named, its tensors cut to
    the tail), a client's the entry as planned at the call (whole tensors, no blocks). Both give the planned one."""
    from mlx_lm.models.cache import KVCache

    from tests.caches import fill
    from tests.daemons import Daemon as DaemonProcess
    from tests.daemons import cleanup, new_root

    def summary(r: Any) -> dict[str, Any]:
        h = r.header
        shapes = [s.shape for e in h.caches for s in e.tensors]
        return {"tokens": h.tokens, "blocks": h.blocks, "shapes": shapes, "size": h.file_size, "ident": h.identity}

    tokens, ident = list(range(200)), Identity(model_id="m")
    async with spilld.Spiller(tmp_path, identity=ident) as sp:
        mine = (await sp.spill(tokens, [fill(KVCache(), 200)])).value
    d = DaemonProcess(new_root(), ["--cap", "64MiB"]).start()
    try:
        async with AsyncClient(d.socket, identity=ident) as client:
            theirs = (await client.spill(tokens, [fill(KVCache(), 200)])).value
    finally:
        d.kill()
        cleanup(d.root)
    assert summary(mine) == summary(theirs) and mine.header.blocks is None
    assert mine.header.caches[0].tensors[0].shape[-2] == 200 and mine.file_bytes == os.path.getsize(mine.path)


@pytest.mark.asyncio
async def test_a_socket_served_by_something_else_is_not_a_daemon_for_the_clients(tmp_path: Any) -> None:
    """Found in review: the command line said "not a spilld daemon" of a socket whose server answers HTTP (as
    docker.sock does), but the engine's clients raised FrameTooLarge, "message of 1347703880 bytes"."""
    import asyncio

    path = str(tmp_path / "h.sock")

    async def handle(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await r.read(100)
        w.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        await w.drain()
        w.close()

    server = await asyncio.start_unix_server(handle, path)
    try:
        c = AsyncClient(path, identity=Identity(model_id="m"))
        with pytest.raises(errors.NotADaemon, match="not a spilld daemon"):
            await c.lookup([1, 2, 3])
        await c.close(1)
        assert issubclass(errors.NotADaemon, errors.ConnectionLost)  # a daemon that cannot be reached: a miss
    finally:
        server.close()


@pytest.mark.asyncio
async def test_a_spill_without_caches_is_refused_and_such_a_file_serves_no_prompt_on_every_way_in(
    tmp_path: Any,
) -> None:
    """Found in review: ``spill(tokens, [])`` was stored, and the next load of those tokens handed the engine a
    ``Loaded`` of every token and no cache at all (its model then failed, IndexError). Refused at the call on every
    way in (``BadParams``), as is a spill of no token; a file of no caches already in a store restores no token (a
    miss, not a hit)."""
    from mlx_lm.models.cache import KVCache

    from spilld.client import Client
    from spilld.saver import save
    from tests.caches import fill
    from tests.daemons import serving

    tokens, ident = list(range(1, 41)), Identity(model_id="m")

    async def refused(way: Any, sync: bool = False) -> None:
        for call in (lambda: way.spill(tokens, []), lambda: way.checkpoint(tokens, [], _ck())):
            with pytest.raises(errors.BadParams, match="caches"):
                await asyncio.to_thread(call) if sync else call()
        # nor a spill of no token (found in review: stored as a file no lookup can use)
        import numpy as np

        for empty in ([], np.array([], dtype=np.int32)):
            with pytest.raises(errors.BadParams, match="token"):
                spill = functools.partial(way.spill, empty, [fill(KVCache(), 8)])
                await asyncio.to_thread(spill) if sync else spill()

    async with spilld.Spiller(tmp_path / "own", identity=ident) as sp:
        await refused(sp)
        stored = await sp.spill(tokens[:8], [fill(KVCache(), 8)])
        assert stored.stored and (await sp.lookup([*tokens, 1])).matched == 8  # type: ignore[union-attr]
        folder = os.path.dirname(stored.value.path)
    # a file of no caches in the store's folder (an older writer's): never a hit, whoever reads the store
    save(os.path.join(folder, "0" * 24 + ".spilld"), tokens, [], identity=ident)
    async with spilld.Spiller(tmp_path / "own", identity=ident) as sp:
        assert sp.store.stats()["entries"] == 2
        assert (await sp.lookup([*tokens, 1])).matched == 8  # type: ignore[union-attr]  # never the one of none
        loaded = await sp.load([*tokens, 1])
        assert loaded is not None and len(loaded.tokens) == 8 and len(loaded.caches) == 1
    with serving("--cap", "64MiB") as d:
        async with AsyncClient(d.socket, identity=ident) as c:
            await refused(c)
        with Client(d.socket, identity=ident) as sync:
            await refused(sync, sync=True)


def _ck() -> spilld.GenerationCheckpoint:
    return spilld.GenerationCheckpoint("g", "", 40, 0, 1, 0, False)


@pytest.mark.asyncio
async def test_token_ids_as_a_lazy_mlx_array_numpy_or_list_look_up_alike_on_every_way_in(tmp_path: Any) -> None:
    """Found in review: the engine's lazy mlx array of token ids (a concatenation, as a decode loop builds them)
    worked for a Spiller and an AsyncClient, but a Client read it on its loop's thread and raised a bare
    RuntimeError ("There is no Stream(cpu, 0) in current thread"); so did the embedded tier (a silent miss)."""
    import mlx.core as mx
    import numpy as np
    from mlx_lm.models.cache import KVCache

    from spilld.client import Client
    from spilld.integrations.tier import EmbeddedTier
    from tests.caches import fill
    from tests.daemons import serving

    tokens, ident = list(range(1, 41)), Identity(model_id="m")
    asked = [*tokens, 7]

    def forms() -> list[Any]:  # a fresh lazy array each time: one evaluated once would pass anywhere
        return [asked, np.array(asked), mx.concatenate([mx.array(asked[:20]), mx.array(asked[20:])])]

    async with spilld.Spiller(tmp_path / "own", identity=ident) as sp:
        assert (await sp.spill(tokens, [fill(KVCache(), 40)])).stored
        for t in forms():
            assert (await sp.lookup(t)).matched == 40  # type: ignore[union-attr]
        for t in forms():
            assert (await sp.load(t)).tokens == tokens  # type: ignore[union-attr]
    tier = await asyncio.to_thread(EmbeddedTier, str(tmp_path / "own"), ident)
    try:
        got = await asyncio.to_thread(lambda: [tier.load(t) for t in forms()])
        assert [g.tokens if g is not None else None for g in got] == [tokens] * 3
        spilled = await asyncio.to_thread(lambda: tier.spill(forms()[2][:40], [fill(KVCache(), 40)]).result(10))
        assert spilled.stored
    finally:
        await asyncio.to_thread(tier.close, 10)
    with serving("--cap", "64MiB") as d:
        async with AsyncClient(d.socket, identity=ident) as c:
            assert (await c.spill(tokens, [fill(KVCache(), 40)])).stored
            for t in forms():
                assert (await c.lookup(t)).matched == 40  # type: ignore[union-attr]
                assert (await c.load(t)).tokens == tokens  # type: ignore[union-attr]

        def sync() -> None:  # the engine's own thread, as a Client's caller
            with Client(d.socket, identity=ident) as client:
                for t in forms():
                    assert client.lookup(t).matched == 40  # type: ignore[union-attr]
                for t in forms():
                    assert client.load(t).tokens == tokens  # type: ignore[union-attr]

        await asyncio.to_thread(sync)


@pytest.mark.asyncio
async def test_after_close_every_way_in_answers_closed_alike(tmp_path: Any) -> None:
    """Found in review: a closed Spiller went on answering lookups and loads (from a folder whose lock it had let
    go: a daemon may own it by then), said its drains were done and gave its status, where both clients raised
    ConnectionLost; a spill after close settled cancelled with a bare RuntimeError('queue is closed') everywhere.
    Now every way in raises ``Closed`` (a ConnectionLost) for the calls that answer, and settles the queued ones
    cancelled with it; a second close gives the first one's report."""
    from mlx_lm.models.cache import KVCache

    from spilld.client import Client
    from tests.caches import fill
    from tests.daemons import serving

    tokens, ident = list(range(1, 21)), Identity(model_id="m")

    async def after_close(way: Any, sync: bool = False) -> None:
        async def call(fn: Any, *args: Any, **kw: Any) -> Any:
            return await asyncio.to_thread(fn, *args, **kw) if sync else await fn(*args, **kw)

        async def settled(fut: Any) -> Any:
            return await asyncio.to_thread(fut.result, 30) if sync else await fut

        assert (await settled(way.spill(tokens, [fill(KVCache(), 20)]))).stored
        first = await call(way.close, 10)
        assert first.done
        for queued in (way.spill(tokens, [fill(KVCache(), 20)]), way.barrier(), way.finish("g")):
            got = await settled(queued)
            assert got.outcome is spilld.Outcome.CANCELLED and isinstance(got.error, errors.Closed), got
        answering = [(way.lookup, (tokens,)), (way.load, ([*tokens, 1],)), (way.resume, ("g",)), (way.status, ())]
        answering += [(way.drain, (1,))]
        for fn, args in answering:
            with pytest.raises(errors.Closed):
                await call(fn, *args)
        with pytest.raises(errors.Closed):
            await call(way.cancel, key="k")
        assert await call(way.close, 1) == first
        assert issubclass(errors.Closed, errors.ConnectionLost)

    await after_close(await spilld.Spiller.open(tmp_path, identity=ident))
    with serving("--cap", "64MiB") as d:
        await after_close(await AsyncClient.open(d.socket, identity=ident))
        await after_close(await asyncio.to_thread(Client, d.socket, identity=ident), sync=True)
