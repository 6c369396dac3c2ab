"""The shared tier end to end (issue 15): real daemons as hosts (each its own folder and socket), a real
``redis-server`` between them, a tiny random-weight model, exact restores checked by next-step logits with a
negative control. Faults: wrong bytes under a key, Redis gone or stopped (a miss, never an error), another host's
key file (a miss, never plaintext)."""

from __future__ import annotations

import asyncio
import shutil
import signal
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
import pytest_asyncio
from mlx_lm.models.cache import make_prompt_cache

import spilld
import spilld.client
from spilld.client import AsyncClient
from tests.blocks_corpus import blocks_on_disk, manifests_on_disk, prefill
from tests.daemons import Daemon, cleanup, new_root
from tests.models import next_logits, random_tokens, tiny_llama
from tests.redis_servers import RedisServer, redis_server, tls_redis_server

B = 16
SETTLE_S = 30.0
pytestmark = pytest.mark.one_loop  # the tiers run in the daemons (uvloop); the test's loop drives their clients


@pytest.fixture(scope="module")
def shared_redis() -> Iterator[RedisServer]:
    with redis_server() as s:
        yield s


@pytest.fixture
def server(shared_redis: RedisServer) -> RedisServer:
    if shared_redis.proc is None or shared_redis.proc.poll() is not None:
        shared_redis.start()  # a test killed it
    with shared_redis.client() as c:
        c.flushall()
    return shared_redis


def host(url: str, *extra: str) -> Daemon:
    args = ["--cap", "256MiB", "--block-tokens", str(B), "--durability", "none", "--remote", url, *extra]
    return Daemon(new_root(), args).start()


@pytest_asyncio.fixture
async def model() -> AsyncIterator[Any]:
    yield tiny_llama()


async def client_of(d: Daemon, model: Any) -> AsyncClient:
    return await AsyncClient.open(d.socket, identity=spilld.model_identity(model, model_id="m"), name="host")


@asynccontextmanager
async def hosts(model: Any, *flags: list[str]) -> AsyncIterator[list[tuple[Daemon, AsyncClient]]]:
    """One daemon per list of flags (each its own folder and socket) and a client of each; all gone after."""
    daemons: list[Daemon] = []
    clients: list[AsyncClient] = []
    try:
        for f in flags:
            daemons.append(host(*f))
        for d in daemons:
            clients.append(await client_of(d, model))
        yield list(zip(daemons, clients, strict=True))
    finally:
        for c in clients:
            await c.close()
        for d in daemons:
            d.kill()
            cleanup(d.root)


async def connected(*clients: AsyncClient) -> None:
    """Until each host's tier has answered (a push offered before that is refused, as the tier is down)."""
    deadline = time.monotonic() + SETTLE_S
    for c in clients:
        while (r := (await c.status())["remote"])["state"] != "closed":
            assert time.monotonic() < deadline, repr(r)
            await asyncio.sleep(0.05)


async def pushed(c: AsyncClient, at_least: int) -> dict[str, Any]:
    """The host's remote counters once ``at_least`` values were written and nothing is left to push."""
    deadline = time.monotonic() + SETTLE_S
    while True:
        r = (await c.status())["remote"]
        if r["pushed"] + r["push_present"] >= at_least and r["queue"]["len"] == 0 and r["pushing"] == 0:
            return dict(r)
        assert time.monotonic() < deadline, repr(r)
        await asyncio.sleep(0.05)


def equal(a: mx.array, b: mx.array) -> bool:
    return bool(mx.array_equal(a, b).item())


@pytest.mark.asyncio
async def test_a_chat_spilled_on_one_host_is_restored_exactly_on_another(
    server: RedisServer, model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a lookup that fills from the shared tier takes longer than an index probe: its client waits for it (the
    # daemon's hello says it has a shared tier), however short the wait for a probe
    monkeypatch.setattr(spilld.client, "LOOKUP_TIMEOUT_S", 0.001)
    async with hosts(model, [server.url], [server.url]) as ((_a, ca), (b, cb)):
        assert cb.server["remote"] is True
        conv = random_tokens(5 * B + 7, seed=1)  # 5 blocks and a tail
        cache = prefill(model, make_prompt_cache, conv)
        assert (await ca.spill(conv, cache, droppable=False)).stored
        r = await pushed(ca, 5 + 5 + 2)  # blocks, their refs, the manifest and the root
        assert r["pushed"] == 12 and r["bytes_pushed"] > 0
        assert not blocks_on_disk(b.dir)
        got = await cb.load([*conv, 3])  # host B's disk is empty: the remote tier fills it
        assert got is not None and got.tokens == conv
        want = next_logits(model, cache, 3)
        assert equal(next_logits(model, got.caches, 3), want)
        other = prefill(model, make_prompt_cache, random_tokens(5 * B + 7, seed=2))
        assert not equal(next_logits(model, other, 3), want)  # the negative control
        st = await cb.status()
        assert st["remote"]["fills"] == 1 and st["store"]["blocks_fetched"] == 5 and st["store"]["adopted"] == 1
        assert sum(st["store"]["misses"].values()) == 0  # one lookup, served: no miss (found in review: one counted)
        assert len(blocks_on_disk(b.dir)) == 5 and len(manifests_on_disk(b.dir)) == 1
        again = await cb.load([*conv, 3])  # now local: no second fill
        assert again is not None and (await cb.status())["remote"]["fills"] == 1
        prom = b.cli("status", "--format", "prometheus", "--socket", b.socket)
        assert (
            "spilld_remote_fills_total 1.0" in prom.stdout and 'spilld_remote_state{state="closed"} 1.0' in prom.stdout
        )
        text = b.cli("status", "--socket", b.socket)
        assert "remote  closed, push all: fills 1" in text.stdout, text.stdout


@pytest.mark.asyncio
async def test_a_system_prompt_another_host_stored_restores_from_its_blocks(server: RedisServer, model: Any) -> None:
    async with hosts(model, [server.url], [server.url]) as ((_a, ca), (_b, cb)):
        system = random_tokens(3 * B, seed=5)
        first = [*system, *random_tokens(2 * B + 4, seed=6)]
        assert (
            await ca.spill(first, prefill(model, make_prompt_cache, system, first[3 * B :]), droppable=False)
        ).stored
        await pushed(ca, 5 + 5 + 2)
        mine = [*system, *random_tokens(9, seed=7)]  # a new conversation under the same system prompt
        hit = await cb.lookup(mine)
        assert isinstance(hit, spilld.Hit) and hit.matched == 3 * B  # the other conversation's, cut to the prompt
        got = await cb.load(mine)
        assert got is not None and got.tokens == system
        want = next_logits(model, prefill(model, make_prompt_cache, system), mine[3 * B])
        assert equal(next_logits(model, got.caches, mine[3 * B]), want)
        assert not equal(next_logits(model, prefill(model, make_prompt_cache, first), mine[3 * B]), want)


@pytest.mark.asyncio
async def test_wrong_bytes_under_a_key_are_refused_and_nothing_is_kept(server: RedisServer, model: Any) -> None:
    async with hosts(model, [server.url], [server.url]) as ((_a, ca), (b, cb)):
        conv = random_tokens(3 * B + 2, seed=11)
        assert (await ca.spill(conv, prefill(model, make_prompt_cache, conv), droppable=False)).stored
        await pushed(ca, 3 + 3 + 2)
        with server.client() as r:
            names = sorted(k for k in r.keys("spilld:*:b:*"))
            good = r.get(names[1])
            assert good is not None
            bad = bytearray(good)
            bad[-5] ^= 0xFF  # one bit of a tensor
            r.set(names[1], bytes(bad))
        assert await cb.load([*conv, 1]) is None  # a miss, never an error
        st = await cb.status()
        assert st["remote"]["fill_misses"].get("bad_bytes") == 1 and st["remote"]["misses"]["bad_bytes"] == 1
        assert st["store"]["adopted"] == 0 and not blocks_on_disk(b.dir) and not manifests_on_disk(b.dir)
        with server.client() as r:  # the bad value is removed (it blocked a push of the right bytes for ever)
            deadline = time.monotonic() + 10
            while r.exists(names[1]) and time.monotonic() < deadline:
                time.sleep(0.02)
            assert not r.exists(names[1]) and all(r.exists(n) for n in names if n != names[1])
            assert (await cb.status())["remote"]["bad_removed"] == 1
            r.set(names[1], good)  # put right: the next lookup fills
        got = await cb.load([*conv, 1])
        assert got is not None and got.tokens == conv


@pytest.mark.asyncio
async def test_redis_gone_or_stopped_is_a_miss_and_local_work_goes_on(server: RedisServer, model: Any) -> None:
    async with hosts(model, [server.url]) as ((_a, ca),):
        local = random_tokens(2 * B + 3, seed=21)
        assert (await ca.spill(local, prefill(model, make_prompt_cache, local), droppable=False)).stored
        await pushed(ca, 2 + 2 + 2)
        server.signal(signal.SIGSTOP)  # hung: probes must time out within their bound
        try:
            unknown = random_tokens(4 * B, seed=22)
            t0 = time.monotonic()
            assert isinstance(await ca.lookup(unknown), spilld.Miss)
            assert time.monotonic() - t0 < 0.5
            t0 = time.monotonic()
            got = await ca.load([*local, 1])  # a local restore: untouched by the remote tier
            assert got is not None and got.tokens == local and time.monotonic() - t0 < 2.0
            more = random_tokens(2 * B + 1, seed=23)
            assert (await ca.spill(more, prefill(model, make_prompt_cache, more), droppable=False)).stored
        finally:
            server.signal(signal.SIGCONT)
        server.kill()  # gone: misses again, spills still stored
        assert isinstance(await ca.lookup(random_tokens(4 * B, seed=24)), spilld.Miss)
        last = random_tokens(2 * B + 5, seed=25)
        assert (await ca.spill(last, prefill(model, make_prompt_cache, last), droppable=False)).stored
        st = (await ca.status())["remote"]
        assert st["state"] in ("open", "half_open", "closed") and st["misses"]["down"] + st["misses"]["timeout"] > 0


@pytest.mark.asyncio
async def test_a_host_without_the_key_gets_misses_never_plaintext(
    server: RedisServer, model: Any, tmp_path: Path
) -> None:
    keys = []
    for name, seed in (("one", b"\x01"), ("two", b"\x02")):
        p = tmp_path / name
        p.write_bytes(seed * 32)
        p.chmod(0o600)
        keys.append(str(p))
    flags = [[server.url, "--remote-key-file", k] for k in (keys[0], keys[0], keys[1])]
    async with hosts(model, *flags) as ((_, ca), (_, cb), (_, cc)):
        conv = random_tokens(2 * B + 5, seed=31)
        assert (await ca.spill(conv, prefill(model, make_prompt_cache, conv), droppable=False)).stored
        await pushed(ca, 2 + 2 + 2)
        assert await cc.load([*conv, 1]) is None  # another key: a miss (its values are named elsewhere)
        st = (await cc.status())["remote"]
        assert st["fill_misses"].get("no_root") == 1 and st["misses"]["decrypt"] == 0 and st["bad_removed"] == 0
        got = await cb.load([*conv, 1])  # the same key: a hit (nothing of it was taken for bad bytes)
        assert got is not None and got.tokens == conv


def test_a_password_in_the_url_is_refused_at_start(tmp_path: Path) -> None:
    d = Daemon(new_root(), ["--remote", "redis://:secret@127.0.0.1:1/0"])
    try:
        out = d.cli("--dir", d.dir, "--socket", d.socket, "--remote", "redis://:secret@127.0.0.1:1/0", timeout=60)
        assert out.returncode == 2 and "--remote" in out.stderr and "password" in out.stderr
        assert "secret" not in out.stderr
    finally:
        cleanup(d.root)


@pytest.mark.asyncio
async def test_hosts_publish_stored_and_evicted_events_for_routers(server: RedisServer, model: Any) -> None:
    from spilld.remote.keys import events_key

    async with hosts(model, [server.url]) as ((_a, ca),):
        conv = random_tokens(3 * B + 1, seed=41)
        stored = await ca.spill(conv, prefill(model, make_prompt_cache, conv), droppable=False)
        assert stored.stored
        await pushed(ca, 3 + 3 + 2)
        path = stored.value.path
        assert (await ca.call("delete", {"path": path}))["deleted"] == 1  # its blocks go with it
        deadline = time.monotonic() + SETTLE_S
        while True:
            with server.client() as r:
                events = [{k.decode(): v.decode() for k, v in f.items()} for _, f in r.xrange(events_key(""))]
            if len(events) >= 2 or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert [e["kind"] for e in events] == ["stored", "evicted"]
        assert events[0]["keys"] == events[1]["keys"] and len(events[0]["keys"].split(",")) == 3
        assert events[0]["host"] == events[1]["host"] != ""


@pytest.mark.asyncio
async def test_a_host_that_only_fetches_still_tells_routers_what_it_holds(server: RedisServer, model: Any) -> None:
    """Found in review: a host with --remote-push none registered nothing with its store, so it published no events
    and a router never sent it the prompts it held."""
    from spilld.remote.keys import events_key

    async with hosts(model, [server.url, "--remote-push", "none"]) as ((_a, ca),):
        await connected(ca)
        conv = random_tokens(2 * B + 1, seed=43)
        assert (await ca.spill(conv, prefill(model, make_prompt_cache, conv), droppable=False)).stored
        deadline = time.monotonic() + SETTLE_S
        while True:
            with server.client() as r:
                events = [{k.decode(): v.decode() for k, v in f.items()} for _, f in r.xrange(events_key(""))]
                values = list(r.scan_iter(match="spilld:*:b:*"))
            if events or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.05)
        assert [e["kind"] for e in events] == ["stored"] and len(events[0]["keys"].split(",")) == 2
        assert values == [] and (await ca.status())["remote"]["pushed"] == 0  # and nothing pushed


@pytest.mark.asyncio
async def test_two_hosts_share_through_a_three_master_cluster(model: Any) -> None:
    from tests.redis_servers import redis_cluster

    with redis_cluster(3) as cluster:
        async with hosts(model, [cluster.url, "--remote-cluster"], [cluster.url, "--remote-cluster"]) as (
            (_a, ca),
            (_b, cb),
        ):
            conv = random_tokens(8 * B + 3, seed=51)
            cache = prefill(model, make_prompt_cache, conv)
            assert (await ca.spill(conv, cache, droppable=False)).stored
            await pushed(ca, 8 + 8 + 2)
            assert all(n > 0 for n in cluster.dbsizes())  # the keys spread over every master
            got = await cb.load([*conv, 9])
            assert got is not None and got.tokens == conv
            assert equal(next_logits(model, got.caches, 9), next_logits(model, cache, 9))
            cluster.nodes[1].kill()  # a master gone mid-test: misses, never errors
            fresh = random_tokens(4 * B, seed=52)
            assert isinstance(await cb.lookup(fresh), spilld.Miss)
            more = random_tokens(2 * B + 2, seed=53)
            assert (await ca.spill(more, prefill(model, make_prompt_cache, more), droppable=False)).stored
            again = await cb.load([*conv, 9])  # held locally since the fill
            assert again is not None and again.tokens == conv


@pytest.mark.asyncio
async def test_the_example_router_sends_a_prompt_to_the_host_that_holds_it(server: RedisServer, model: Any) -> None:
    import socket as sk

    import msgpack

    from spilld.entries import identity_fingerprint
    from spilld.remote.keys import Kind, value_key
    from spilld.remote.link import root_space
    from spilld.remote.router import PrefixRouter

    async with hosts(model, [server.url]) as ((_a, ca),):
        conv = random_tokens(4 * B + 2, seed=61)
        stored = await ca.spill(conv, prefill(model, make_prompt_cache, conv), droppable=False)
        assert stored.stored
        await pushed(ca, 4 + 4 + 2)
        ident = spilld.model_identity(model, model_id="m")
        space = root_space(identity_fingerprint(ident), "", stored.value.header.codec_provider, B)
        with server.client() as r:
            root, _ = msgpack.unpackb(r.get(value_key("", space, Kind.ROOT)))
            router = PrefixRouter(r, "", root, B)
            me = sk.gethostname()
            names = ["elsewhere-1", me, "elsewhere-2"]
            assert router.route([*conv, 5], names) == me
            assert all(router.route([*conv, 5], [h, me]) == me for h in names if h != me)
            assert (await ca.call("delete", {"path": stored.value.path}))["deleted"] == 1
            deadline = time.monotonic() + SETTLE_S
            while router.holders and any(router.holders.values()) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
                router.poll()
            assert not any(router.holders.values())  # evicted: no host holds it now


@pytest.mark.asyncio
async def test_two_daemons_on_one_machine_are_told_apart_by_their_remote_host_names(
    server: RedisServer, model: Any
) -> None:
    """Found in review: a daemon's events named it by the machine's host name alone, so two daemons on one machine
    (one a GPU, say) were one host to a router, which sent either's prompts to whichever it listed first.
    ``--remote-host-name`` names each: its events carry it, status shows it, and a router tells them apart."""
    import msgpack

    from spilld.entries import identity_fingerprint
    from spilld.remote.keys import Kind, events_key, value_key
    from spilld.remote.link import root_space
    from spilld.remote.router import PrefixRouter

    names = ["gpu-0", "gpu-1"]
    async with hosts(model, *([server.url, "--remote-host-name", n] for n in names)) as pairs:
        convs, header = [], None
        for (_d, c), seed in zip(pairs, (81, 82), strict=True):
            conv = random_tokens(2 * B + 2, seed=seed)
            stored = await c.spill(conv, prefill(model, make_prompt_cache, conv), droppable=False)
            assert stored.stored
            await pushed(c, 2 + 2 + 2)
            convs.append(conv)
            header = stored.value.header
        assert [(await c.status())["remote"]["host"] for _d, c in pairs] == names
        assert header is not None
        space = root_space(
            identity_fingerprint(spilld.model_identity(model, model_id="m")), "", header.codec_provider, B
        )
        with server.client() as r:
            events = [{k.decode(): v.decode() for k, v in f.items()} for _, f in r.xrange(events_key(""))]
            assert sorted(e["host"] for e in events if e["kind"] == "stored") == names
            root, _ = msgpack.unpackb(r.get(value_key("", space, Kind.ROOT)))
            router = PrefixRouter(r, "", root, B)
            for conv, name in zip(convs, names, strict=True):
                assert router.route([*conv, 5], names) == name and router.route([*conv, 5], names[::-1]) == name


@pytest.mark.asyncio
async def test_a_wrong_password_disables_the_tier_with_one_log_line_and_the_daemon_serves(
    model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    with redis_server(password="right-one") as guarded:
        monkeypatch.setenv("SPILLD_REMOTE_PASSWORD", "wrong-one")
        async with hosts(model, [guarded.url]) as ((a, ca),):
            conv = random_tokens(2 * B + 1, seed=71)
            assert (await ca.spill(conv, prefill(model, make_prompt_cache, conv), droppable=False)).stored
            assert isinstance(await ca.lookup(random_tokens(3 * B, seed=72)), spilld.Miss)
            got = await ca.load([*conv, 1])
            assert got is not None and got.tokens == conv
            st = (await ca.status())["remote"]
            assert st["state"] == "disabled" and st["pushed"] == 0
            lines = [ln for ln in a.read_log().splitlines() if "password" in ln.lower() or "auth" in ln.lower()]
            assert len(lines) == 1 and "wrong-one" not in lines[0], lines


@pytest.mark.asyncio
@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test's certificate")
async def test_two_hosts_share_over_tls_and_a_host_that_distrusts_the_server_gets_misses(model: Any) -> None:
    with tls_redis_server() as server:
        trusting, distrusting = server.url(server.cert), server.url(server.other_cert)
        async with hosts(model, [trusting], [trusting], [distrusting]) as ((_, ca), (_, cb), (_, cc)):
            await connected(ca, cb)
            conv = random_tokens(3 * B + 2, seed=81)
            cache = prefill(model, make_prompt_cache, conv)
            assert (await ca.spill(conv, cache, droppable=False)).stored
            await pushed(ca, 3 + 3 + 2)
            for _ in range(10):  # host B trusts the server's certificate: filled over TLS
                got = await cb.load([*conv, 4])
                if got is not None:
                    break
                # a probe past its bound (50 ms) on a loaded machine is a miss, then a retry
                await asyncio.sleep(0.5)
            assert got is not None and got.tokens == conv
            assert equal(next_logits(model, got.caches, 4), next_logits(model, cache, 4))
            assert await cc.load([*conv, 4]) is None  # host C's CA is another: no connection, misses
            st = (await cc.status())["remote"]
            assert st["fills"] == 0 and st["misses"]["down"] + st["misses"]["timeout"] >= 1


@pytest.mark.asyncio
async def test_push_evicted_pushes_only_what_the_disk_evicts_and_another_host_restores_it(
    server: RedisServer, model: Any
) -> None:
    """``--remote-push evicted``: a stored entry is not pushed; once the disk cap evicts it, it is (its blocks,
    their refs, the manifest, the root), its files are unlinked after they were read, and another host restores
    it exactly."""
    # an entry is ~48 KiB on disk (5 packed blocks and a manifest): the cap holds one, not two
    async with hosts(model, [server.url, "--remote-push", "evicted", "--disk-cap", "72KiB"], [server.url]) as (
        (a, ca),
        (_b, cb),
    ):
        first = random_tokens(5 * B + 7, seed=11)
        cache = prefill(model, make_prompt_cache, first)
        assert (await ca.spill(first, cache, droppable=False)).stored
        await asyncio.sleep(0.5)
        r = (await ca.status())["remote"]
        assert r["push"] == "evicted" and r["pushed"] == 0 and r["queue"]["len"] == 0  # stored, kept here: not pushed
        mine = set(blocks_on_disk(a.dir))
        assert len(mine) == 5
        second = random_tokens(5 * B + 7, seed=12)
        assert (await ca.spill(second, prefill(model, make_prompt_cache, second), droppable=False)).stored
        r = await pushed(ca, 5 + 5 + 2)  # the evicted entry's blocks, their refs, its manifest and the root
        assert r["pushed"] == 12 and r["evicted_skipped"] == 0
        st = (await ca.status())["store"]
        assert st["evicted"] == 1 and st["entries"] == 1
        assert not mine & set(blocks_on_disk(a.dir))  # its files went once they were read
        assert len(manifests_on_disk(a.dir)) == 1
        got = await cb.load([*first, 3])
        assert got is not None and got.tokens == first
        want = next_logits(model, cache, 3)
        assert equal(next_logits(model, got.caches, 3), want)
        assert not equal(next_logits(model, prefill(model, make_prompt_cache, second), 3), want)  # negative control


@pytest.mark.asyncio
async def test_a_restarted_host_announces_again_the_blocks_it_holds(server: RedisServer, model: Any) -> None:
    """Found in review: a host told routers of its blocks only as each entry was stored (or filled), so one that
    restarted after the stream lost its events (Redis restarted without persistence, the stream trimmed, a router
    that came later) held blocks no router ever heard of: its prompts went elsewhere, to a prefill. Its start
    announces what its scan found."""
    from spilld.blocks import header_root
    from spilld.remote.keys import events_key
    from spilld.remote.router import PrefixRouter

    async with hosts(model, [server.url, "--remote-host-name", "a"]) as ((a, ca),):
        conv = random_tokens(3 * B + 1, seed=71)
        stored = await ca.spill(conv, prefill(model, make_prompt_cache, conv), droppable=False)
        assert stored.stored
        await pushed(ca, 3 + 3 + 2)
        with server.client() as r:
            (_, before), *_ = r.xrange(events_key(""))
        held = set(before[b"keys"].decode().split(","))
        assert len(held) == 3
        assert a.stop() == 0
        with server.client() as r:
            r.flushall()  # the server restarted without persistence while the host was down
        a.start()
        deadline = time.monotonic() + 5.0
        with server.client() as r:
            router = PrefixRouter(r, "", header_root(stored.value.header, B), B)
            while not (events := r.xrange(events_key(""))) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            # (each order: with no holder the router picks by the prompt's hash, the same place in either)
            routed = [router.route([*conv, 5], names) for names in (["elsewhere", "a"], ["a", "elsewhere"])]
        assert [(f[b"kind"], f[b"host"]) for _, f in events] == [(b"stored", b"a")]
        assert set(events[0][1][b"keys"].decode().split(",")) == held
        assert routed == ["a", "a"]


@pytest.mark.asyncio
async def test_a_host_whose_disk_was_wiped_is_no_longer_said_to_hold_its_old_prompts(
    server: RedisServer, model: Any
) -> None:
    """Found in review: a start announced what its scan found, never what the host no longer held, so a host whose
    disk was wiped while it was down stayed, for every router, the holder of the prompts it had stored, and was
    sent them to miss. Its first lookup of a namespace (a prompt a router still sends it) resets what the stream
    said of it there."""
    from spilld.blocks import header_root
    from spilld.remote.keys import events_key
    from spilld.remote.router import PrefixRouter

    async with hosts(model, [server.url, "--remote-host-name", "a", "--remote-push", "none"]) as ((a, ca),):
        conv = random_tokens(3 * B + 1, seed=73)
        stored = await ca.spill(conv, prefill(model, make_prompt_cache, conv), droppable=False)
        assert stored.stored
        deadline = time.monotonic() + SETTLE_S
        with server.client() as r:
            while not r.xrange(events_key("")):
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
        assert a.stop() == 0
        shutil.rmtree(a.dir)  # the disk wiped (a new one mounted) while the host was down
        Path(a.dir).mkdir()
        a.start()
        with server.client() as r:
            router = PrefixRouter(r, "", header_root(stored.value.header, B), B)
            router.poll()
            assert len(router.holders) == 3 and all(h == {"a"} for h in router.holders.values())
            again = await client_of(a, model)
            try:
                assert isinstance(await again.lookup([*conv, 5]), spilld.Miss)
                deadline = time.monotonic() + SETTLE_S
                while any(router.holders.values()) and time.monotonic() < deadline:
                    await asyncio.sleep(0.05)
                    router.poll()
            finally:
                await again.close()
            # (each order: with no holder the router picks by the prompt's hash, the same place in either)
            routed = [router.route([*conv, 5], names) for names in (["elsewhere", "a"], ["a", "elsewhere"])]
            kinds = [f[b"kind"] for _, f in r.xrange(events_key(""))]
        assert not any(router.holders.values()) and routed[0] != routed[1]  # no holder: picked by the hash
        assert kinds == [b"stored", b"reset"]
