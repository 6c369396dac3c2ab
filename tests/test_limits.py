"""Named limits hit at their boundary: the largest value each one takes is taken, one past it is refused with the
error the docs name ("every limit a named constant, with a test that hits it"). An audit found these limits with
no test that reached them; each test below was checked to fail with its check loosened or taken out.

Real code paths only: a daemon subprocess spoken to frame by frame (``tests/wire.py``), an in-process ``Daemon``
where a constant is patched smaller (only where the code reads it at call time), real stores and files, the real
command line, and real redis-server processes (``tests/redis_servers.py``). Sections:

- the wire protocol: ``MAX_INFLIGHT_REQUESTS``, ``MAX_ERROR_MESSAGE`` (``spilld/protocol.py``)
- a header: ``MIN_BLOCK_TOKENS`` / ``MAX_BLOCK_TOKENS``, ``KEY_LEN``, ``MAX_FIELD_DEPTH`` (``spilld/format.py``)
- a lookup's reply: ``MAX_LOOKUP_BLOCK_PATHS`` (``spilld/daemon/server.py``)
- settings: block tokens, ``MAX_ADMIT_AFTER`` (``spilld/admission.py``), ``MAX_DURATION_S`` (``spilld/config.py``)
- the remote tier: ``MAX_SECRET_FILE_BYTES``, ``MAX_MANIFEST_VALUE_BYTES``, ``MAX_EVENT_KEYS`` (``spilld/remote``)
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import math
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spilld import errors
from spilld import format as fmt
from spilld import protocol as P
from spilld.admission import MAX_ADMIT_AFTER
from spilld.config import MAX_DURATION_S, Config, check_duration, parse_duration
from spilld.daemon import server as server_module
from spilld.entries import Hit
from spilld.remote import EventKind, RemoteConfig, RemoteConfigError, RemoteTier, keys
from spilld.remote import link as link_module
from spilld.remote import tier as tier_module
from spilld.remote.credentials import MAX_SECRET_FILE_BYTES
from spilld.remote.link import RemoteLink
from spilld.store import Store
from tests.daemons import Daemon, cleanup, new_root, serving
from tests.hostile_memory import AsyncWire, in_process, kv_header
from tests.redis_servers import RedisServer, redis_server
from tests.test_remote import FILL_IDENT, NS, chain, pushed_store, relaxed, secret_file, started
from tests.wire import Wire

ROWS = 8  # a KV entry of [1, 8, 8, 128] float16: two 16 KiB tensors
CENTURY = f"{MAX_DURATION_S // 86400}d"  # MAX_DURATION_S written as the command line takes it: "36500d"
SEEDS = itertools.count(20_000, 100)  # first tokens of spills that must be new to the store (each one written)


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    with serving("--cap", "64MiB") as d:
        yield d


def connect(daemon: Daemon, **hello: Any) -> Wire:
    w = Wire(daemon.socket)
    w.hello(**hello)
    return w


def open_spill(w: Wire, header: dict[str, Any]) -> int:
    """Open a spill of ``header`` (two tensors) and send every byte of it; its id."""
    r = w.call("spill", {"header": header})
    assert r.error is None, r.error
    sid = int(r.result["spill"])
    for i in range(2):
        w.send(P.notification("put", {"spill": sid, "index": i, "offset": 0}, os.urandom(8 * ROWS * 128 * 2)))
    return sid


def refused(w: Wire, header: dict[str, Any]) -> dict[str, str]:
    """The error a ``spill`` of ``header`` is answered with (the connection goes on)."""
    r = w.call("spill", {"header": header})
    assert r.error is not None, r.result
    return dict(r.error)


def read_until(w: Wire, done: Any, what: str) -> None:
    """Read from the daemon until ``done()``; the connection closing first fails the test."""
    while not done():
        assert w._read(), f"connection closed before {what}; notes: {w.notes}"


# --- the wire protocol ------------------------------------------------------------------------------------------


@contextlib.contextmanager
def queue_held(daemon: Daemon) -> Iterator[None]:
    """The daemon's queue cannot empty meanwhile, so that every ``drain`` stays in flight (and says so with a
    ``drain_progress`` note every DRAIN_PROGRESS_S): a lease grantor's spill is committed, and its write waits for
    the grant the daemon asks for, which is never given. When the grantor goes the write goes on unheld."""
    grantor = connect(daemon, lease_grantor=True)
    try:
        sid = open_spill(grantor, kv_header(ROWS, seed=next(SEEDS)))
        grantor.send(P.request(1_000, "commit", {"spill": sid}))
        read_until(grantor, lambda: any(m.kind == P.REQUEST and m.method == "lease" for m in grantor.inbox), "a lease")
        yield
    finally:
        grantor.close()


def drains(w: Wire, ids: range) -> None:
    """Send a drain for each of ``ids``, and wait until each says it is waiting: all of them in flight."""
    w.send(*[P.request(i, "drain", {"timeout": 120.0}) for i in ids])
    read_until(w, lambda: {m.params["msgid"] for m in w.notes if m.method == "drain_progress"} >= set(ids), "drains")


def test_max_inflight_requests_in_flight_on_one_connection_are_each_served(daemon: Daemon) -> None:
    n = P.MAX_INFLIGHT_REQUESTS
    w = connect(daemon)
    with queue_held(daemon):
        drains(w, range(1, n + 1))
    for i in range(1, n + 1):
        r = w.response(i)
        assert r.error is None and r.result["done"] is True, (i, r.error, r.result)
    assert not [m for m in w.notes if m.method == "error"]
    assert w.call("status", {}).error is None  # the connection goes on
    w.close()


def test_one_request_past_max_inflight_requests_is_protocol_error_then_close(daemon: Daemon) -> None:
    """docs/format.md §10: more than MAX_INFLIGHT_REQUESTS requests in flight on one connection is no response but
    an ``error`` notification (``protocol_error``), then the close."""
    n = P.MAX_INFLIGHT_REQUESTS
    w = connect(daemon)
    with queue_held(daemon):
        w.send(*[P.request(i, "drain", {"timeout": 120.0}) for i in range(1, n + 1)], P.request(n + 1, "status", {}))
        result, error = w.answer(n + 1)
        assert result is None and error is not None, result
        assert error["code"] == "protocol_error" and error["message"] == f"more than {n} requests in flight"
        assert [m for m in w.until_closed() if m.kind == P.RESPONSE] == []  # none of the n + 1 is answered
        assert w.sock.recv(1) == b""  # closed by the daemon
    w.close()


def test_a_client_that_got_every_answer_is_not_cut_off_for_requests_in_flight(daemon: Daemon) -> None:
    """A client keeps to the limit by counting requests sent and answers received. Here it has n in flight, gets
    all n answers, and sends one more at once, while other connections' requests end in the same loop turn. Found
    while writing these tests: the daemon counted a request until its task's done callback ran, a loop turn after
    its answer, so it refused that request as the (n+1)th and closed (every run of 10; 2 tries here)."""
    n = P.MAX_INFLIGHT_REQUESTS
    for _ in range(2):
        w, others = connect(daemon), [connect(daemon) for _ in range(3)]
        with queue_held(daemon):
            drains(w, range(1, n + 1))
            for other in others:
                drains(other, range(1, n + 1))  # answered after w's, in the same loop turn
        for i in range(1, n + 1):
            assert w.response(i).error is None
        w.send(P.request(n + 1, "status", {}))
        result, error = w.answer(n + 1)
        for c in (w, *others):
            c.close()
        assert error is None and result is not None, error


def test_an_error_message_is_cut_to_max_error_message_characters(daemon: Daemon) -> None:
    """An error may echo what the client sent (here an unknown dtype name); its message crosses the socket cut to
    MAX_ERROR_MESSAGE characters. The message's own text around the name is measured first, so the name can be
    sized to make a message of exactly the limit (sent whole) and of one more (cut)."""
    w = connect(daemon)

    def message_for(dtype: str) -> str:
        h = kv_header(ROWS)
        h["caches"][0]["tensors"][0]["dtype"] = dtype
        error = refused(w, h)
        assert error["code"] == "header_malformed", error
        return error["message"]

    head, tail = message_for("Z").split("Z")  # "header field invalid: unknown dtype '" and "'"
    k = P.MAX_ERROR_MESSAGE - len(head) - len(tail)
    at = message_for("Z" * k)
    assert at == head + "Z" * k + tail and len(at) == P.MAX_ERROR_MESSAGE  # the largest message: whole
    past = message_for("Z" * (k + 1))
    assert past == (head + "Z" * (k + 1) + tail)[: P.MAX_ERROR_MESSAGE]  # one more character: cut
    assert len(past) == P.MAX_ERROR_MESSAGE and not past.endswith(tail)
    assert w.call("status", {}).error is None
    w.close()


# --- a header's blocks (docs/format.md §3, "Blocks" and "Block") -------------------------------------------------
#
# A spill's header goes through the file format's parser (``fmt.header_from_wire``) before anything else. One that
# parses and names blocks is then refused `block_invalid` ("a spill sends every row": the daemon cuts blocks
# itself), which is how a value the parser accepted shows on the wire.

PARSED = "block_invalid"


def with_blocks(blocks: Any = None, block: Any = None) -> dict[str, Any]:
    h = kv_header(ROWS)
    h["format"] = fmt.FORMAT_VERSION  # blocks are read from v2 on
    h["blocks"], h["block"] = blocks, block
    return h


@pytest.fixture(scope="module")
def w(daemon: Daemon) -> Iterator[Wire]:
    wire = connect(daemon)
    yield wire
    wire.close()


@pytest.mark.parametrize(
    ("size", "code"),
    [
        (fmt.MIN_BLOCK_TOKENS - 1, "header_malformed"),  # below: header_malformed
        (fmt.MIN_BLOCK_TOKENS, PARSED),
        (fmt.MAX_BLOCK_TOKENS, PARSED),
        (fmt.MAX_BLOCK_TOKENS + 1, "field_invalid"),  # above: field_invalid
    ],
)
def test_a_manifest_block_size_from_min_to_max_block_tokens_parses(w: Wire, size: int, code: str) -> None:
    error = refused(w, with_blocks({"size": size, "keys": [bytes(fmt.KEY_LEN)]}))
    assert error["code"] == code, error
    if code == PARSED:
        assert "sends every row" in error["message"], error


@pytest.mark.parametrize("length", [fmt.KEY_LEN - 1, fmt.KEY_LEN, fmt.KEY_LEN + 1])
@pytest.mark.parametrize("where", ["blocks.keys[]", "block.key", "block.parent"])
def test_a_block_key_of_key_len_bytes_parses_another_length_is_header_malformed(
    w: Wire, where: str, length: int
) -> None:
    key, good = b"k" * length, bytes(fmt.KEY_LEN)
    header = {
        "blocks.keys[]": with_blocks({"size": fmt.MIN_BLOCK_TOKENS, "keys": [good, key]}),
        "block.key": with_blocks(block={"key": key, "parent": good, "index": 0}),
        "block.parent": with_blocks(block={"key": good, "parent": key, "index": 0}),
    }[where]
    error = refused(w, header)
    if length == fmt.KEY_LEN:
        assert error["code"] == PARSED and "sends every row" in error["message"], error
    else:
        assert error["code"] == "header_malformed" and f"must be {fmt.KEY_LEN} bytes" in error["message"], error


@pytest.mark.parametrize("depth", [fmt.MAX_FIELD_DEPTH, fmt.MAX_FIELD_DEPTH + 1])
def test_a_cache_field_nested_max_field_depth_deep_parses_one_more_is_nesting_too_deep(w: Wire, depth: int) -> None:
    value: Any = 0
    for _ in range(depth):
        value = [value]
    header = kv_header(ROWS)
    header["caches"][0]["fields"] = {**header["caches"][0]["fields"], "x": value}
    error = refused(w, header)  # parsed, it is then refused by the kind's rule: no field "x"
    assert (error["code"] == "nesting_too_deep") == (depth > fmt.MAX_FIELD_DEPTH), error


# --- a lookup's reply -------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_lookup_names_at_most_max_lookup_block_paths_block_files(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hit's ``blocks`` lists the files of the manifest's first MAX_LOOKUP_BLOCK_PATHS blocks. The limit (4096)
    is patched to 2 in an in-process daemon (``_lookup`` reads it at call time): an entry of 2 blocks is named
    whole, one of 3 by its first 2, in chain order."""
    monkeypatch.setattr(server_module, "MAX_LOOKUP_BLOCK_PATHS", 2)
    async with in_process("limits", block_tokens=fmt.MIN_BLOCK_TOKENS) as (daemon, wire):
        for nblocks in (2, 3):
            rows = fmt.MIN_BLOCK_TOKENS * nblocks
            tokens = [*await wire.store_kv(rows, seed=1_000 * nblocks), 7]
            params = {"identity": {"model_id": "hostile"}, "tokens": fmt.encode_tokens(tokens)}
            hit, err = await wire.call("lookup", params | {"codec_provider": "spilld/mlx-lm/1"})
            assert err is None and hit["hit"] is True and hit["matched"] == rows, (hit, err)
            entry = daemon.store.entry_at(hit["path"])
            assert entry is not None and len(entry.blocks) == nblocks
            assert hit["blocks"] == [daemon.store.block_path(k) for k in entry.blocks[:2]]


# --- settings: the constructors and the command line --------------------------------------------------------------


def config(**kw: Any) -> Config:
    return Config(dir="/tmp/spilld-limits-unused", socket="/tmp/spilld-limits-unused.sock", **kw)


@pytest.mark.parametrize("tokens", [fmt.MIN_BLOCK_TOKENS, fmt.MAX_BLOCK_TOKENS])
def test_block_tokens_at_its_limits_are_taken_by_config_and_store(tmp_path: Path, tokens: int) -> None:
    assert config(block_tokens=tokens).block_tokens == tokens
    assert Store(str(tmp_path), block_tokens=tokens).block_tokens == tokens


@pytest.mark.parametrize("tokens", [fmt.MIN_BLOCK_TOKENS - 1, fmt.MAX_BLOCK_TOKENS + 1])
def test_block_tokens_past_its_limits_are_refused_by_config_and_store(tmp_path: Path, tokens: int) -> None:
    with pytest.raises(ValueError, match="block tokens must be 0"):
        config(block_tokens=tokens)
    with pytest.raises(ValueError, match="block tokens must be 0"):  # (one check, one wording)
        Store(str(tmp_path), block_tokens=tokens)


def test_admit_after_up_to_max_admit_after_is_taken_one_more_is_refused() -> None:
    assert config(admit_after=MAX_ADMIT_AFTER).admit_after == MAX_ADMIT_AFTER
    with pytest.raises(ValueError, match=f"admit after must be from 0 \\(off\\) to {MAX_ADMIT_AFTER}"):
        config(admit_after=MAX_ADMIT_AFTER + 1)


@pytest.mark.parametrize(
    ("kw", "said"),
    [
        ({"admit_after": MAX_ADMIT_AFTER + 1}, f"admit after must be from 0 \\(off\\) to {MAX_ADMIT_AFTER}"),
        ({"admit_after": -1}, "admit after must be from 0"),
        ({"write_budget": 0}, "write budget: a size must be at least 1 byte"),
        ({"write_budget": -5}, "write budget: a size must be at least 1 byte"),
    ],
)
def test_a_spillers_write_gate_and_budget_are_refused_as_the_daemons_config_refuses_them(
    tmp_path: Path, kw: dict[str, int], said: str
) -> None:
    """The embedded tier's ``admit_after`` and ``write_budget`` are checked by the daemon's own checks, with its
    words, before the folder is made (a budget of 0 bytes would shed every droppable spill)."""
    import spilld

    with pytest.raises(ValueError, match=said):
        config(**kw)
    folder = tmp_path / "never-made"
    with pytest.raises(ValueError, match=said):
        spilld.Spiller(folder, identity=spilld.Identity("limits"), **kw)
    assert not folder.exists()
    ok = spilld.Spiller(folder, identity=spilld.Identity("limits"), admit_after=MAX_ADMIT_AFTER, write_budget=1)
    assert ok.store.admission is not None and ok.store.admission.after == MAX_ADMIT_AFTER
    assert ok.store.write_budget == 1


def test_a_duration_of_max_duration_s_is_taken_one_more_is_refused() -> None:
    assert parse_duration(str(MAX_DURATION_S)) == MAX_DURATION_S
    assert parse_duration(CENTURY) == MAX_DURATION_S
    assert check_duration(float(MAX_DURATION_S)) == MAX_DURATION_S
    assert config(idle_timeout=MAX_DURATION_S).idle_timeout == MAX_DURATION_S
    over = f"a finite number of seconds from 0 to {MAX_DURATION_S}"
    for text in (str(MAX_DURATION_S + 1), f"{MAX_DURATION_S // 86400 + 1}d"):
        with pytest.raises(ValueError, match=over):
            parse_duration(text)
    for seconds in (MAX_DURATION_S + 1, math.nextafter(MAX_DURATION_S, math.inf)):
        with pytest.raises(ValueError, match=over):
            check_duration(seconds)
    with pytest.raises(ValueError, match=over):
        config(idle_timeout=MAX_DURATION_S + 1)


def run_cli(*args: str) -> subprocess.CompletedProcess[str]:
    # a subprocess, so that a refusal that stopped working (a daemon serving) fails on the timeout, not hangs here
    return subprocess.run([sys.executable, "-m", "spilld", *args], capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize(
    "option",
    [
        ["--block-tokens", "8"],
        ["--block-tokens", str(fmt.MIN_BLOCK_TOKENS - 1)],
        ["--block-tokens", str(fmt.MAX_BLOCK_TOKENS + 1)],
        ["--admit-after", str(MAX_ADMIT_AFTER + 1)],
        ["--idle-timeout", str(MAX_DURATION_S + 1)],
        ["--drain-deadline", f"{MAX_DURATION_S // 86400 + 1}d"],
    ],
    ids=" ".join,
)
def test_the_command_line_refuses_each_limit_plus_one_with_exit_2(tmp_path: Path, option: list[str]) -> None:
    r = run_cli("--dir", str(tmp_path / "store"), "--socket", str(tmp_path / "s.sock"), *option)
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("spilld"), r.stderr
    assert not (tmp_path / "store").exists()  # refused before anything was made


@pytest.mark.parametrize("tokens", [fmt.MIN_BLOCK_TOKENS, fmt.MAX_BLOCK_TOKENS])
def test_the_command_line_serves_with_every_limit_at_its_largest(tokens: int) -> None:
    """The largest of each: B at either end, the write gate at MAX_ADMIT_AFTER, and every duration a century (its
    timers armed: a client connected, a spill written, a stop that drains)."""
    durations = [f"--{name}" for name in ("idle-timeout", "request-timeout", "drain-deadline", "io-timeout")]
    d = Daemon(new_root(), ["--cap", "64MiB", "--block-tokens", str(tokens), "--admit-after", str(MAX_ADMIT_AFTER)])
    d.args += [arg for name in durations for arg in (name, CENTURY)]
    try:
        d.start()
        w = connect(d)
        r = w.call("commit", {"spill": open_spill(w, kv_header(ROWS))})
        assert r.error is None and r.result["outcome"] == "stored", r  # (under one block: never gated)
        status = w.call("status", {}).result
        assert status["store"]["admit_after"] == MAX_ADMIT_AFTER and status["store"]["entries"] == 1
        w.close()
        assert d.stop() == 0, d.read_log()
    finally:
        d.kill()
        cleanup(d.root)


# --- the remote tier ----------------------------------------------------------------------------------------------


def test_a_secret_file_of_max_secret_file_bytes_is_read_one_more_byte_is_refused(tmp_path: Path) -> None:
    """A password or key file larger than MAX_SECRET_FILE_BYTES is the wrong file: RemoteConfigError at start."""
    url, n = "redis://127.0.0.1:1/0", MAX_SECRET_FILE_BYTES
    password = secret_file(tmp_path, "pw", b"hunter2\n" + b"x" * (n - 8))
    assert os.path.getsize(password) == n
    assert RemoteTier(RemoteConfig(url, password_file=password), environ={})._password == "hunter2"
    key = secret_file(tmp_path, "key", os.urandom(n))
    assert RemoteTier(RemoteConfig(url, key_file=key), environ={}).key_tag is not None
    too_long = f"is larger than {n} bytes"
    with pytest.raises(RemoteConfigError, match=too_long):
        RemoteTier(
            RemoteConfig(url, password_file=secret_file(tmp_path, "pw+1", b"hunter2\n" + b"x" * (n - 7))), environ={}
        )
    with pytest.raises(RemoteConfigError, match=too_long):
        RemoteTier(RemoteConfig(url, key_file=secret_file(tmp_path, "key+1", os.urandom(n + 1))), environ={})


@pytest.fixture(scope="module")
def redis() -> Iterator[RedisServer]:
    with redis_server() as s:
        yield s


@pytest.mark.asyncio
async def test_a_manifest_value_up_to_the_bound_is_adopted_one_byte_more_is_bad_bytes(
    redis: RedisServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A fill reads a manifest value through GETRANGE bounded by MAX_MANIFEST_VALUE_BYTES (256 MiB, read by
    ``_manifest_for`` at call time): patched to the pushed manifest's own size, the fill adopts it; patched one
    byte under it (the value one byte over the bound), the value is a `bad_bytes` miss and nothing is adopted.
    (Whether such a value is then removed from the server is the tier's policy, tested in test_remote.py.)"""
    with redis.client() as c:
        c.flushall()
    store_a, tier_a, _ = await pushed_store(tmp_path / "a", redis.url, 16 * 3 + 3)
    prompt = [*range(16 * 3 + 3), 999]
    (entry,) = store_a.entries
    name = keys.manifest_key("", entry.blocks[-1])  # the manifest, under the key of its last block
    with redis.client() as c:
        size = int(c.strlen(name))
    assert size > 0
    tiers: list[RemoteTier] = [tier_a]
    try:

        async def fill(host: str) -> tuple[bool, Store, RemoteLink]:
            store = Store(str(tmp_path / host), disk_cap=2**30, block_tokens=16)
            tiers.append(tier := await started(relaxed(redis.url)))
            link = RemoteLink(tier, store, push="none")  # a host that only fetches
            return await link.fill(FILL_IDENT, "", prompt, store.provider_id), store, link

        monkeypatch.setattr(link_module, "MAX_MANIFEST_VALUE_BYTES", size)
        ok, store, _ = await fill("b")
        assert ok and isinstance(store.lookup(FILL_IDENT, "", prompt), Hit)

        monkeypatch.setattr(link_module, "MAX_MANIFEST_VALUE_BYTES", size - 1)
        ok, store, link = await fill("c")
        tier = tiers[-1]
        assert not ok and store.count == 0 and store.blocks == []
        # the tier counts each refused read (the last block's reference names the same manifest: read again); the
        # fill, whose manifest was there and refused, says so
        assert tier.counters()["misses"]["bad_bytes"] >= 1 and link.fill_misses == {"bad_bytes": 1}
    finally:
        for t in tiers:
            await t.close()


@pytest.mark.asyncio
async def test_max_event_keys_fit_one_stream_entry_one_more_takes_two(redis: RedisServer) -> None:
    n = tier_module.MAX_EVENT_KEYS
    ks = chain(n + 1)
    tier = await started(relaxed(redis.url))
    try:
        with redis.client() as c:
            c.flushall()
        assert await tier.publish_event(EventKind.STORED, NS, ks[:n], "host-a")
        assert await tier.publish_event(EventKind.STORED, "tenant-b", ks, "host-a")
        with redis.client() as c:
            at = c.xrange(keys.events_key(NS))
            past = c.xrange(keys.events_key("tenant-b"))

        def listed(entry: Any) -> list[str]:
            return str(entry[1][b"keys"].decode()).split(",")

        assert [listed(e) for e in at] == [[k.hex() for k in ks[:n]]]
        assert [listed(e) for e in past] == [[k.hex() for k in ks[:n]], [ks[n].hex()]]
        assert tier.counters()["events_published"] == 3
    finally:
        await tier.close()


def test_a_lookups_tokens_are_held_as_4_bytes_each() -> None:
    """Found in review: a lookup decoded its tokens into a list (28 + 8 bytes a token: 39 MiB for a 4 MiB message)
    and held it while it waited for the comparison threads or a fill."""
    import numpy as np

    from spilld.entries import token_array

    raw = fmt.encode_tokens(list(range(1_000_000)))
    got = token_array(raw)
    assert isinstance(got, np.ndarray) and got.dtype == np.dtype("<u4") and got.nbytes == len(raw)
    assert got.tolist() == fmt.decode_tokens(raw)
    with pytest.raises(errors.HeaderMalformed):
        token_array(raw[:-1])


@pytest.mark.asyncio
async def test_a_lookup_waiting_on_the_shared_tier_holds_its_tokens_as_4_bytes_each() -> None:
    """Found in review: with ``--remote`` the daemon handed a lookup's tokens to the fill as a list, held across
    every wait on the shared tier (root, probe, manifest: each up to its timeout): 38 MiB a 4 MiB lookup, uncounted,
    up to 64 in flight a connection. Here the shared tier's first answer is held back."""
    import tracemalloc

    lookups, release = 4, asyncio.Event()
    async with in_process("filler", cap=4 * 2**30) as (daemon, _):  # room for 4 MiB messages (48 x each)
        tier = RemoteTier(RemoteConfig("redis://127.0.0.1:1"), environ={})  # never started: nothing is reached
        asked: list[int] = []

        async def slow_fetch(*a: Any, **kw: Any) -> list[bytes | None]:
            asked.append(1)
            await release.wait()
            return [None]

        tier.fetch = slow_fetch  # type: ignore[method-assign]
        daemon.remote = RemoteLink(tier, daemon.store)
        raws = [fmt.encode_tokens([(7 * n + i) % 50_000 + 300 for i in range(1_000_000)]) for n in range(lookups)]
        ident = {"model_id": "m", "config_fingerprint": "", "tokenizer_hash": ""}
        wires = [await AsyncWire.open(daemon.cfg.socket, f"filler-{i}") for i in range(lookups)]  # one call each
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            calls = [
                asyncio.ensure_future(w.call("lookup", {"identity": ident, "tokens": raw}))
                for w, raw in zip(wires, raws, strict=True)
            ]
            for _ in range(200):
                if len(asked) == lookups:
                    break
                await asyncio.sleep(0.05)
            held = (tracemalloc.get_traced_memory()[0] - base) / lookups
        finally:
            tracemalloc.stop()
            release.set()
        got = [(await c)[0] for c in calls]
        for w in wires:
            w.close()
        assert len(asked) == lookups and all(r["hit"] is False for r in got), got
        assert held < 3 * len(raws[0]), f"{held / 2**20:.1f} MiB held a lookup of {len(raws[0]) / 2**20:.1f} MiB"


@pytest.mark.asyncio
async def test_a_drain_waits_for_what_was_queued_before_it_not_for_what_comes_after(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found in review: the daemon's drain waited in slices of ``DRAIN_PROGRESS_S`` and took the queue anew in each,
    so under a steady stream of spills it never answered done (``spilld drain`` then exited 3)."""
    monkeypatch.setattr(server_module, "DRAIN_PROGRESS_S", 0.05)
    async with in_process("drainer") as (daemon, drainer):
        real_put = daemon.store.put

        async def slow_put(*a: Any, **kw: Any) -> Any:  # each write takes a while: the queue is never empty
            await asyncio.sleep(0.15)
            return await real_put(*a, **kw)

        daemon.store.put = slow_put  # type: ignore[method-assign]

        async def one_spill(seed: int) -> None:  # a connection each: a wire answers one call at a time
            w = await AsyncWire.open(daemon.cfg.socket, f"producer-{seed}")
            try:
                r, err = await w.call("spill", {"header": kv_header(ROWS, seed=seed)})
                assert err is None, err
                for i in range(2):
                    payload = bytes(2 * 8 * ROWS * 128)
                    w.send(P.notification("put", {"spill": r["spill"], "index": i, "offset": 0}, payload))
                await w.call("commit", {"spill": r["spill"]})
            finally:
                w.close()

        first = asyncio.ensure_future(one_spill(next(SEEDS)))
        await asyncio.sleep(0.05)  # queued or being written
        stop = asyncio.Event()

        async def steady() -> None:  # a new spill every 0.1 s while the drain runs
            tasks = []
            while not stop.is_set():
                tasks.append(asyncio.ensure_future(one_spill(next(SEEDS))))
                await asyncio.sleep(0.1)
            await asyncio.gather(*tasks)

        load = asyncio.ensure_future(steady())
        t0 = asyncio.get_running_loop().time()
        r, err = await drainer.call("drain", {"timeout": 10.0})
        took = asyncio.get_running_loop().time() - t0
        stop.set()
        await asyncio.gather(first, load)
        assert err is None and r["done"] is True and took < 3.0, (r, took)


@pytest.mark.asyncio
async def test_a_lookup_in_the_checkpoint_namespace_is_refused() -> None:
    """Found in review: a spill into the reserved checkpoint namespace was refused, a lookup there was not, and a
    raw client got generation checkpoints back as prefix hits (they are found by resume only)."""
    from spilld.entries import CHECKPOINT_NS_PREFIX

    async with in_process("ckpt") as (_, wire):
        params = {"identity": {"model_id": "hostile"}, "tokens": fmt.encode_tokens([1, 2, 3])}
        _, err = await wire.call("lookup", params | {"namespace": CHECKPOINT_NS_PREFIX + "gen-1"})
        assert err is not None and err["code"] == "bad_params", err
        _, err = await wire.call("lookup", params | {"namespace": "ok"})
        assert err is None


@pytest.mark.asyncio
async def test_a_name_of_max_text_chars_is_taken_one_more_is_refused() -> None:
    """Found in review: no name had a bound: with ``--remote`` each lookup's namespace (4 MiB each) was kept by the
    shared tier's tag cache (1,024 of them) for the daemon's life. Lookups, identity fields and a spill's header."""
    from spilld.daemon.params import MAX_TEXT_CHARS

    async with in_process("names") as (_, wire):
        lookup = {"identity": {"model_id": "m"}, "tokens": fmt.encode_tokens([1, 2, 3])}
        for at, over in (
            ({"namespace": "n" * MAX_TEXT_CHARS}, {"namespace": "n" * (MAX_TEXT_CHARS + 1)}),
            ({"identity": {"model_id": "m" * MAX_TEXT_CHARS}}, {"identity": {"model_id": "m" * (MAX_TEXT_CHARS + 1)}}),
        ):
            _, err = await wire.call("lookup", lookup | at)
            assert err is None, err
            _, err = await wire.call("lookup", lookup | over)
            assert err is not None and err["code"] == "bad_params" and str(MAX_TEXT_CHARS) in err["message"], err
        _, err = await wire.call("cancel", {"key": "k" * (MAX_TEXT_CHARS + 1)})
        assert err is not None and err["code"] == "bad_params", err
        for chars, code in ((MAX_TEXT_CHARS, None), (MAX_TEXT_CHARS + 1, "bad_params")):
            header = kv_header(16)
            header["identity"]["namespace"] = "n" * chars
            r, err = await wire.call("spill", {"header": header})
            assert (err and err["code"]) == code, (chars, err)
            if r is not None:
                await wire.call("abort", {"spill": r["spill"]})


@pytest.mark.asyncio
async def test_a_spill_of_a_newer_format_is_parsed_first_then_refused_before_its_blocks() -> None:
    """The order docs/format.md ("Spill checks") gives, the file readers' too (tests/test_hostile_headers.py holds
    every reader to the same code): a malformed field is a parse error whatever the format; a well-formed header of
    a newer format is ``version_mismatch``, before its ``blocks`` are refused."""
    async with in_process("newer") as (_, wire):
        newer = {"format": max(fmt.SUPPORTED_VERSIONS) + 1}
        for extra, code in (
            ({"blocks": 5}, "header_malformed"),
            ({"blocks": {"size": 16, "keys": [bytes(32)]}}, "version_mismatch"),
        ):
            _, err = await wire.call("spill", {"header": kv_header(16) | newer | extra})
            assert err is not None and err["code"] == code, (extra, err)


@pytest.mark.asyncio
async def test_a_spills_align_is_checked_as_a_files_is() -> None:
    """docs/format.md ("Spill checks"): a format-3 spill's given ``align`` is checked as §3 says (another integer
    ``field_invalid``, nil, a bool or another type ``header_malformed``); a format-2 spill's is ignored (found in
    review: the doc said ``field_invalid`` for every value)."""
    async with in_process("align") as (_, wire):
        for fmt_, align, code in (
            (3, 64, None), (3, 16384, None), (3, 4096, "field_invalid"), (3, 0, "field_invalid"),
            (3, "x", "header_malformed"), (3, None, "header_malformed"), (3, True, "header_malformed"),
            (2, "x", None),
        ):  # fmt: skip
            r, err = await wire.call("spill", {"header": kv_header(16) | {"format": fmt_, "align": align}})
            assert (err and err["code"]) == code, (fmt_, align, err)
            if r is not None:
                await wire.call("abort", {"spill": r["spill"]})


# --- each limit at its value and one over (found in review: several were tested only far past the limit) ----------


def slots_of(*shapes: tuple[int, ...], dtype: str = "uint8") -> list[fmt.Slot]:
    return [fmt.Slot(0, 0, shape, dtype) for shape in shapes]


@pytest.mark.parametrize(
    ("at", "over", "error"),
    [
        (slots_of(*[(1,)] * fmt.MAX_TENSORS), slots_of(*[(1,)] * (fmt.MAX_TENSORS + 1)), errors.TooManyTensors),
        (slots_of((1,) * fmt.MAX_RANK), slots_of((1,) * (fmt.MAX_RANK + 1)), errors.RankTooLarge),
        (slots_of((fmt.MAX_DIM,)), slots_of((fmt.MAX_DIM + 1,)), errors.DimensionTooLarge),
        (slots_of((2**20, 2**20)), slots_of((2**20, 2**20), (1,)), errors.TotalSizeTooLarge),  # 2**40 bytes, + 1
    ],
    ids=["MAX_TENSORS", "MAX_RANK", "MAX_DIM", "MAX_TOTAL_BYTES"],
)
def test_a_files_tensor_limits_at_and_one_over(at: list[fmt.Slot], over: list[fmt.Slot], error: type) -> None:
    fmt.check_limits(at)
    with pytest.raises(error):
        fmt.check_limits(over)


def test_a_caches_offset_is_bounded_by_max_dim_at_and_one_over() -> None:
    """Found in review: in a file without tokens (the mlx-lm drop-in writes such), a ``rotating`` entry's offset
    was bounded by nothing (2**63 loaded, and mlx's rope then failed on it)."""
    wire = kv_header(1) | {"tokens": b""}
    for offset, refused in ((fmt.MAX_DIM, False), (fmt.MAX_DIM + 1, True)):
        entry = wire["caches"][0] | {"offset": offset}
        try:
            fmt.header_from_wire(wire | {"caches": [entry]})
            said = None
        except errors.SpillError as exc:
            said = exc
        assert isinstance(said, errors.DimensionTooLarge) is refused, said


def test_max_tokens_at_and_one_over() -> None:
    wire = kv_header(1)
    for n, refused in ((fmt.MAX_TOKENS, False), (fmt.MAX_TOKENS + 1, True)):
        try:
            fmt.header_from_wire(wire | {"tokens": bytes(4 * n)})
            said = None
        except errors.SpillError as exc:
            said = exc
        assert isinstance(said, errors.TooManyTokens) is refused, said


def test_message_limits_at_and_one_over() -> None:
    """``MAX_NESTING`` (a value inside that many containers, the message's own array and params map included),
    ``MAX_METHOD_LEN`` and ``MAX_PENDING_FRAMES``."""

    def nested(containers: int) -> Any:
        value: Any = 1
        for _ in range(containers - 2):  # the message array and its params map are two
            value = [value]
        return P.request(1, "m", {"a": value})

    def fed(*parts: list[bytes | memoryview]) -> int:
        return len(P.FrameDecoder().feed(b"".join(bytes(b) for p in parts for b in p)))

    assert fed(nested(P.MAX_NESTING)) == 1
    with pytest.raises(P.ProtocolError, match="nested"):
        fed(nested(P.MAX_NESTING + 1))
    assert fed(P.request(1, "m" * P.MAX_METHOD_LEN, {})) == 1
    with pytest.raises(P.ProtocolError):
        fed(P.request(1, "m" * (P.MAX_METHOD_LEN + 1), {}))
    one = P.notification("put", {})
    assert fed(*[one] * P.MAX_PENDING_FRAMES) == P.MAX_PENDING_FRAMES
    with pytest.raises(P.ProtocolError, match="unread"):
        fed(*[one] * (P.MAX_PENDING_FRAMES + 1))


@pytest.mark.asyncio
async def test_max_expired_kept_at_and_one_over() -> None:
    """The commit of one of the last ``MAX_EXPIRED_KEPT`` spills the daemon aborted says why (``timeout``); of one
    before them, that there is no such spill (``bad_params``): what a connection keeps of them is bounded."""
    from spilld.daemon.connection import MAX_EXPIRED_KEPT

    async with in_process("expired") as (daemon, wire):
        (conn,) = daemon.connections
        sids = []
        for seed in range(MAX_EXPIRED_KEPT + 1):
            r, err = await wire.call("spill", {"header": kv_header(4, seed=seed)})
            assert err is None, err
            conn.expire(r["spill"], P.Timeout("aborted by the test"))
            sids.append(r["spill"])
        _, err = await wire.call("commit", {"spill": sids[1]})  # the oldest of the last MAX_EXPIRED_KEPT
        assert err is not None and err["code"] == "timeout", err
        _, err = await wire.call("commit", {"spill": sids[0]})  # one over: forgotten
        assert err is not None and err["code"] == "bad_params", err


@pytest.mark.asyncio
async def test_a_checkpoint_key_of_max_text_chars_is_taken_by_a_spill_as_by_resume() -> None:
    """Found in review: a checkpoint's namespace is the reserved prefix + its key, and was held to
    ``MAX_TEXT_CHARS`` too, so a key of up to 12 characters less than the limit that ``resume`` takes was refused
    on spill. The key is held to the limit; the namespace made from it is not checked again."""
    from mlx_lm.models import cache as C

    import spilld
    from spilld.client import AsyncClient
    from spilld.daemon.params import MAX_TEXT_CHARS
    from tests.caches import fill

    async with (
        in_process("ckpt-key") as (daemon, _),
        AsyncClient(daemon.cfg.socket, identity=spilld.Identity("m")) as c,
    ):
        cache = fill(C.KVCache(), 8)
        for chars, stored in ((MAX_TEXT_CHARS, True), (MAX_TEXT_CHARS + 1, False)):
            ck = spilld.GenerationCheckpoint("k" * chars, "", 8, 0, 1, 0, False)
            settled = await c.checkpoint(list(range(8)), [cache], ck)
            assert settled.stored is stored, (chars, settled)
        assert await c.resume("k" * MAX_TEXT_CHARS) is not None
