"""mlx-lm's own HTTP server with spilld as the cold tier of its prompt cache.

A tiny random-weight model in a local folder (nothing downloaded). One request;
the server restarts; the same request again must be served from the cold tier
(``cached_tokens`` > 0) and answer identically, down to the log-probabilities.
The in-process tests cover the eviction path without HTTP.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models.cache import make_prompt_cache

from spilld import errors, fileio
from spilld.admission import MAX_ADMIT_AFTER
from spilld.client import Client
from spilld.identity import model_identity
from spilld.integrations.mlx_lm import ColdTierPromptCache, covered_tokens
from spilld.integrations.tier import EmbeddedTier, settled_now
from spilld.queue import Outcome
from spilld.tinymodel import TinySpec, write_tiny_model
from tests.daemons import Daemon, cleanup, new_root
from tests.loops import on_loop

SPEC = TinySpec(hidden=64, layers=2, intermediate=128)
PROMPT = "The cold tier keeps long prompts warm across restarts. " * 12
CONTROL = "A" + PROMPT[len("The") :]  # the same prompt but its first word


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return write_tiny_model(str(tmp_path_factory.mktemp("tiny")), SPEC)


def _read(path: Any) -> str:
    with open(path) as f:
        return f.read()


def _exits_cleanly(script: str, log: Any) -> str:
    """Run ``script`` in a Python of its own, its output into ``log``: that output, once it exited 0 (in 120 s)."""
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=f, stderr=f)
    try:
        assert proc.wait(120) == 0, _read(log)
    finally:
        if proc.poll() is None:
            proc.kill()
    return _read(log)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


OPENED = "cold tier ready:"  # the embedded tier's line once its folder is open (its requests go without it until then)


class Server:
    """``python -m spilld.integrations.mlx_lm`` as a subprocess on a loopback port. ``prelude``: Python run in the
    server's process first (to slow a part down); ``opened``: with --spilld-dir, wait for the tier too."""

    def __init__(self, model: str, log: str, *spilld_args: str, prelude: str = "", opened: bool = True) -> None:
        self.port = _free_port()
        main = ["-m", "spilld.integrations.mlx_lm"]
        if prelude:
            main = ["-c", f"{prelude}\nfrom spilld.integrations.mlx_lm import main\nmain()\n"]
        cmd = [sys.executable, *main, "--model", model, "--port", str(self.port)]
        self.log = log
        self.log_from = os.path.getsize(log) if os.path.exists(log) else 0  # this server's lines
        with open(log, "ab") as f:
            self.proc = subprocess.Popen([*cmd, *spilld_args], stdout=f, stderr=f)
        self._wait_ready()
        if opened and "--spilld-dir" in spilld_args:
            self.wait_for(OPENED)

    def own_log(self) -> str:
        with open(self.log, "rb") as f:
            f.seek(self.log_from)
            return f.read().decode(errors="replace")

    def wait_for(self, line: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while line not in self.own_log():
            assert self.proc.poll() is None and time.monotonic() < deadline, self.own_log()
            time.sleep(0.05)

    def _wait_ready(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited {self.proc.returncode}:\n{_read(self.log)}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2).read()
                return
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.2)
        raise TimeoutError(_read(self.log))

    def complete(self, prompt: str, timeout: float = 120) -> dict[str, Any]:
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0.0, "logprobs": True, "top_logprobs": 3}
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return dict(json.loads(r.read()))

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGTERM)  # the wrapper drains the cold tier, then exits
        return self.proc.wait(120)


def _cached(answer: dict[str, Any]) -> int:
    return int(answer["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0))


Answers = tuple[dict[str, Any], dict[str, Any], dict[str, Any]]


def _request_restart_request(model: str, log: str, *spilld_args: str) -> Answers:
    """The prompt, a restart, the prompt again, then the control: the prompt with its first word changed."""
    first = Server(model, log, *spilld_args)
    try:
        a = first.complete(PROMPT)
    finally:
        assert first.stop() == 0, _read(log)
    second = Server(model, log, *spilld_args)
    try:
        b = second.complete(PROMPT)
        c = second.complete(CONTROL)
    finally:
        assert second.stop() == 0, _read(log)
    return a, b, c


def _assert_identical_from_cold_tier(a: dict[str, Any], b: dict[str, Any], c: dict[str, Any]) -> None:
    assert _cached(a) == 0  # the first request had nothing to reuse
    assert _cached(b) == a["usage"]["prompt_tokens"] - 1  # all but the last prompt token came from disk
    assert b["choices"][0]["text"] == a["choices"][0]["text"]
    assert b["choices"][0]["logprobs"] == a["choices"][0]["logprobs"]  # same floats: same K/V rows
    # negative control: other K/V rows at the front alone (the same text after the first word) change the
    # log-probabilities, so a restore that brought back wrong rows would have failed the line above
    assert _cached(c) < 4
    assert c["choices"][0]["logprobs"] != a["choices"][0]["logprobs"]


def test_embedded_server_restart_hits_cold_tier(model_dir: str, tmp_path: Any) -> None:
    store = str(tmp_path / "store")
    prom = str(tmp_path / "tier.prom")
    a, b, c = _request_restart_request(
        model_dir, str(tmp_path / "server.log"), "--spilld-dir", store, "--spilld-metrics-file", prom
    )
    assert "cold tier: embedded (no daemon)" in _read(tmp_path / "server.log")
    assert "spilld_mlx_lm_restores_total 1.0" in _read(prom)  # the second server's counters, written at exit
    got = _prom(prom)  # and its store's figures, named as the daemon's, none of the daemon's own
    assert got["spilld_disk_entries"] >= 1 and not {name for name in got if name.startswith(DAEMON_ONLY)}, got
    _assert_identical_from_cold_tier(a, b, c)
    assert "cold tier: restored" in _read(tmp_path / "server.log")


def _gated_scan(gate: str) -> str:
    """A server prelude: the store's folder scan waits until the file ``gate`` exists (a store of many entries)."""
    return (
        "import os, time\n"
        "from spilld.store import Store\n"
        "scan = Store.scan\n"
        "def gated(self, *a, **k):\n"
        f"    while not os.path.exists({gate!r}):\n"
        "        time.sleep(0.05)\n"
        "    return scan(self, *a, **k)\n"
        "Store.scan = gated\n"
    )


def test_the_first_request_does_not_wait_for_the_embedded_folder_scan(model_dir: str, tmp_path: Any) -> None:
    """Found in review: the embedded tier was made on the first request, so the scan of its folder ran on the
    generation thread before the first answer (1.6 s for a store of 3,000 entries, more with more files). It runs
    from the server's start on a thread of its own; a request before it is done goes without a cold tier (a miss,
    nothing written), and what it left in memory is spilled once the tier is open: here, at exit. The next server
    restores it."""
    store, log, gate = str(tmp_path / "store"), str(tmp_path / "server.log"), str(tmp_path / "gate")
    s = Server(model_dir, log, "--spilld-dir", store, prelude=_gated_scan(gate), opened=False)
    try:
        t0 = time.monotonic()
        a = s.complete(PROMPT, timeout=20)  # (before: held until the gate opened, and timed out)
        assert time.monotonic() - t0 < 10 and _cached(a) == 0
        assert OPENED not in s.own_log()
        with open(gate, "w"):
            pass
        s.wait_for(OPENED)
    finally:
        with open(gate, "w"):  # (before the fix, the generation thread waits on it)
            pass
        assert s.stop() == 0, _read(log)
    text = s.own_log()
    assert "draining the cold tier (1 more entries" in text, text  # the first request's entry, spilled at exit
    assert "'cold_misses': 1, 'spills': 1," in text, text
    _restores_as_answered(model_dir, log, store, a)


def _restores_as_answered(model_dir: str, log: str, store: str, a: dict[str, Any]) -> None:
    """A new server on ``store`` restores ``PROMPT`` from the cold tier (all but its last token) and answers it as
    ``a`` was answered, logprobs and all."""
    again = Server(model_dir, log, "--spilld-dir", store)
    try:
        b = again.complete(PROMPT)
    finally:
        assert again.stop() == 0, _read(log)
    assert _cached(b) == a["usage"]["prompt_tokens"] - 1
    assert b["choices"][0]["logprobs"] == a["choices"][0]["logprobs"]


def test_a_folder_still_scanning_at_exit_is_waited_for_up_to_the_drain_timeout(model_dir: str, tmp_path: Any) -> None:
    """The exit waits for a tier still opening only as long as --spilld-drain-timeout, then says what is lost."""
    log = str(tmp_path / "server.log")
    prelude = _gated_scan(str(tmp_path / "never"))
    s = Server(model_dir, log, "--spilld-dir", str(tmp_path / "store"), "--spilld-drain-timeout", "1", prelude=prelude,
               opened=False)  # fmt: skip
    s.complete(PROMPT, timeout=20)
    t0 = time.monotonic()
    assert s.stop() == 0, _read(log)
    assert time.monotonic() - t0 < 20
    assert "was still opening at the timeout: its entries in memory are lost" in _read(log)


def test_an_entry_whose_write_behind_is_in_flight_at_exit_is_not_written_again(model_dir: str, tmp_path: Any) -> None:
    """Found in review: at exit every entry in memory not yet stored was spilled again, not droppable, though its
    write-behind was still queued: the same tokens written twice (the first file then superseded). The exit now
    waits for that write-behind; here each write takes a second, and SIGTERM comes as the answer does."""
    store, log = str(tmp_path / "store"), str(tmp_path / "server.log")
    prelude = (
        "import asyncio\n"
        "from spilld.spiller import Spiller\n"
        "write = Spiller._write\n"
        "async def slow(self, item):\n"
        "    await asyncio.sleep(1.0)\n"
        "    return await write(self, item)\n"
        "Spiller._write = slow\n"
    )
    s = Server(model_dir, log, "--spilld-dir", store, prelude=prelude)
    try:
        a = s.complete(PROMPT)
    finally:
        assert s.stop() == 0, _read(log)
    text = s.own_log()
    # the request's two write-behinds (its prompt, then prompt and answer), none again (before: 1 more, 3 spills)
    assert "draining the cold tier (0 more entries" in text and "'spills': 2," in text, text
    assert "did not store" not in text
    assert sum(name.endswith(".spilld") for _, _, names in os.walk(store) for name in names) == 1
    _restores_as_answered(model_dir, log, store, a)


def test_server_through_daemon_restart_hits_cold_tier(model_dir: str, tmp_path: Any) -> None:
    d = Daemon(new_root(), ["--cap", "256MiB"]).start()
    prom = str(tmp_path / "tier.prom")
    try:
        log = str(tmp_path / "server.log")
        a, b, c = _request_restart_request(model_dir, log, "--spilld-socket", d.socket, "--spilld-metrics-file", prom)
        assert f"cold tier: the spilld daemon at {d.socket} (answers)" in _read(tmp_path / "server.log")
        got = _prom(prom)  # the integration's counters alone: the daemon's own file shows its store
        assert got["spilld_mlx_lm_restores_total"] == 1 and all(n.startswith("spilld_mlx_lm_") for n in got), got
        _assert_identical_from_cold_tier(a, b, c)
        assert d.cli("status", "--json", "--socket", d.socket).returncode == 0
    finally:
        assert d.stop() == 0
        cleanup(d.root)


def test_repeated_stop_signals_still_drain_and_exit_cleanly(model_dir: str, tmp_path: Any) -> None:
    """A second SIGTERM or Ctrl-C while the server stops (found in review: it cut mlx-lm's own stop short, exit 1,
    and the drain ran beside a generation still decoding; with a metrics file a second Ctrl-C hung the exit
    forever). The counters are logged at exit, as the README says."""
    log = str(tmp_path / "server.log")
    s = Server(model_dir, log, "--spilld-dir", str(tmp_path / "store"), "--spilld-metrics-file", str(tmp_path / "m"))
    s.complete(PROMPT)
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGTERM):
        s.proc.send_signal(sig)
        time.sleep(0.05)
    assert s.proc.wait(60) == 0, _read(log)
    text = _read(log)
    assert "mlx_lm.server failed" not in text and "draining the cold tier failed" not in text
    assert "cold tier counters: {'restores': 0" in text  # the values, not only the words


def test_server_without_daemon_still_serves(model_dir: str, tmp_path: Any) -> None:
    """An unreachable daemon is a miss, never an error: the server answers from a full prefill."""
    s = Server(model_dir, str(tmp_path / "server.log"), "--spilld-socket", str(tmp_path / "nobody.sock"))
    try:
        assert _cached(s.complete(PROMPT)) == 0
    finally:
        assert s.stop() == 0
    assert "unreachable" in _read(tmp_path / "server.log")
    assert "(does not answer yet" in _read(tmp_path / "server.log")


# --- in process ------------------------------------------------------------------------------


@pytest.fixture()
def tiny(model_dir: str) -> Iterator[tuple[Any, Any]]:
    import mlx_lm

    loaded = mlx_lm.load(model_dir)
    yield loaded[0], loaded[1]


@pytest.fixture()
def make_tier(tiny: tuple[Any, Any], tmp_path: Any) -> Iterator[Callable[..., EmbeddedTier]]:
    """Embedded tiers for the tiny model in a temporary folder, closed (drained) at the end of the test."""
    made: list[EmbeddedTier] = []

    def make(**kwargs: Any) -> EmbeddedTier:
        made.append(EmbeddedTier(str(tmp_path), model_identity(tiny[0], tiny[1], model_id="tiny"), **kwargs))
        return made[-1]

    yield make
    for t in made:
        t.close(30)


class DropsWriteBehinds:
    """A tier whose droppable spills are always shed, as a full queue would shed them; the rest go through."""

    def __init__(self, inner: EmbeddedTier) -> None:
        self.inner = inner

    def spill(self, tokens: Any, caches: Any, *, droppable: bool = True) -> Any:
        return settled_now(Outcome.DROPPED) if droppable else self.inner.spill(tokens, caches, droppable=False)

    def load(self, tokens: Any, *, longer_than: int = 0) -> Any:
        return self.inner.load(tokens, longer_than=longer_than)

    def close(self, timeout: float | None = None) -> None:
        self.inner.close(timeout)


def _prefilled(model: Any, tokens: list[int]) -> list[Any]:
    cache = make_prompt_cache(model)
    mx.eval(model(mx.array([tokens]), cache=cache))
    return cache


def test_covered_tokens_uses_the_cache_offset(tiny: tuple[Any, Any]) -> None:
    model, _ = tiny
    cache = _prefilled(model, list(range(10)))
    assert covered_tokens(list(range(11)), cache) == 10  # the server keys entries with one unfed token
    assert covered_tokens(list(range(5)), cache) == 5
    assert covered_tokens(list(range(5)), [object()]) is None


def test_a_recurrent_state_beside_a_cache_ahead_is_not_held_to_fewer_tokens() -> None:
    """Found in review: with ``[ArraysCache, KVCache]`` whose KV cache holds a token more than the key, the KV cache
    was cut back and the recurrent state, a token ahead as well, stored as it was: an entry of n tokens holding the
    state after n + 1. Nothing is stored then; the same caches at n are kept as they are."""
    from mlx_lm.models import cache as C

    from spilld.integrations.mlx_lm import held_to
    from tests.caches import fill

    state = C.ArraysCache(1)
    state[0] = mx.zeros((1, 4))
    ahead, level = fill(C.KVCache(), 11), fill(C.KVCache(), 10)
    assert held_to([state, ahead], 10) is None
    assert held_to([state, level], 10) == [state, level]
    cut = held_to([ahead, fill(C.KVCache(), 10)], 10)  # positional caches alone are cut, on clones
    assert cut is not None and [c.offset for c in cut] == [10, 10] and ahead.offset == 11


def test_a_draft_models_cache_list_is_stored_as_of_the_tokens_every_cache_holds(
    tiny: tuple[Any, Any], make_tier: Callable[..., EmbeddedTier]
) -> None:
    """With ``--draft-model`` the server's cache list is the main model's caches then the draft's, and after a
    speculative step the main ones hold one row more (found in review: every spill was refused as
    ``offset_beyond_tokens``, so nothing was ever stored). The entry is stored as of the rows all of them hold,
    and the server's own caches are left as they are."""
    model, _ = tiny
    tier = make_tier()
    lru = ColdTierPromptCache(max_size=4, tier_for=lambda key: tier)
    p = [9, *range(100, 140)]
    main, draft = _prefilled(model, p), _prefilled(model, p[:-1])
    lru.insert_cache("m", p, [*main, *draft])
    tier._run(tier.spiller.drain(30))
    assert tier.spiller.store.counters.stored == 1
    assert [c.offset for c in main] == [len(p)] * len(main)  # the server's caches: untouched
    loaded = tier.load([*p, 99])
    assert loaded is not None and loaded.tokens == p[:-1]
    assert all(c.offset == len(p) - 1 for c in loaded.caches) and len(loaded.caches) == 2 * len(main)
    # the rows restored are the server's own first len(p) - 1, bit for bit (found in review: compared with a prefill
    # of p[:-1] alone, which with OpenBLAS differs in the last bits, a matmul of 40 rows blocked unlike one of 41)
    n = len(p) - 1
    for got, own in zip(loaded.caches, [*main, *draft], strict=True):
        assert mx.array_equal(got.keys[..., :n, :], own.keys[..., :n, :]).item()
        assert mx.array_equal(got.values[..., :n, :], own.values[..., :n, :]).item()


def test_evicted_entries_are_spilled_and_come_back(
    tiny: tuple[Any, Any], make_tier: Callable[..., EmbeddedTier]
) -> None:
    model, _ = tiny
    tier = make_tier()
    lru = ColdTierPromptCache(max_size=1, tier_for=lambda key: DropsWriteBehinds(tier))
    prompts = [[7, i, *range(40, 80)] for i in range(3)]
    for p in prompts:
        lru.insert_cache("m", p, _prefilled(model, p))
    assert len(lru) == 1
    tier._run(tier.spiller.drain(30))
    # Every write-behind was shed, so each entry the LRU evicted was the last copy: spilled, not droppable.
    assert lru.stats["evictions_spilled"] == 2
    for p in prompts:
        cache, rest = lru.fetch_nearest_cache("m", [*p, 99])
        assert cache is not None and len(rest) == 1, p
        want = model(mx.array([[99]]), cache=_prefilled(model, p))
        got = model(mx.array([[99]]), cache=cache)
        assert mx.array_equal(got, want).item()
    assert lru.stats["restores"] == 2  # the third is still in memory


def test_stored_entries_are_not_written_again_when_evicted(
    tiny: tuple[Any, Any], make_tier: Callable[..., EmbeddedTier]
) -> None:
    model, _ = tiny
    tier = make_tier()
    lru = ColdTierPromptCache(max_size=1, tier_for=lambda key: tier)
    for i in range(4):
        p = [3, i, *range(40, 60)]
        lru.insert_cache("m", p, _prefilled(model, p))
        tier._run(tier.spiller.drain(30))
    assert lru.stats["evictions_spilled"] == 0
    assert lru.stats["spills"] == 4
    assert tier.spiller.store.counters.stored == 4


def test_spill_unstored_writes_what_the_queue_shed(
    tiny: tuple[Any, Any], make_tier: Callable[..., EmbeddedTier]
) -> None:
    model, _ = tiny
    tier = make_tier()
    lru = ColdTierPromptCache(max_size=8, tier_for=lambda key: DropsWriteBehinds(tier))
    prompts = [[5, i, *range(60, 100)] for i in range(4)]
    for p in prompts:
        lru.insert_cache("m", p, _prefilled(model, p))
        assert tier.load([*p, 1]) is None  # shed: not on disk
    assert lru.spill_unstored() == len(prompts)
    tier._run(tier.spiller.drain(30))
    assert all(tier.load([*p, 1]) is not None for p in prompts)


def test_spill_unstored_waits_for_a_write_behind_in_flight_up_to_its_timeout(
    tiny: tuple[Any, Any], make_tier: Callable[..., EmbeddedTier]
) -> None:
    """At exit a write-behind still queued is waited for, not spilled a second time; one still queued at the
    timeout is left to the drain (found in review: each was written twice)."""
    import threading

    from spilld.lease import ThreadLockLease

    model, _ = tiny
    engine = threading.Lock()
    tier = make_tier(lease=ThreadLockLease(engine))
    lru = ColdTierPromptCache(max_size=4, tier_for=lambda key: tier)
    p = [6, *range(30, 110)]
    with engine:  # the writer waits for the engine's lock: the write-behind stays queued
        lru.insert_cache("m", [*p, 1], _prefilled(model, p))
        t0 = time.monotonic()
        assert lru.spill_unstored(0.3) == 0 and time.monotonic() - t0 >= 0.3  # left to the drain
    assert lru.spill_unstored(30) == 0  # waited for: stored, not written again
    tier._run(tier.spiller.drain(30))
    assert tier.spiller.store.counters.stored == 1 and tier.spiller.store.counters.superseded == 0


def test_the_exits_spills_never_shed_a_write_behind_left_queued(
    tiny: tuple[Any, Any], make_tier: Callable[..., EmbeddedTier]
) -> None:
    """Found in review: at exit, a write-behind still queued at ``spill_unstored``'s timeout was left to the drain
    droppable, and the exit's own spills (not droppable) of the entries whose write-behind was shed put the queue over
    its cap and shed it: that entry, in memory at exit, was lost. It is promoted first, written once."""
    model, _ = tiny
    a, b = ([k, *range(100, 180)] for k in (4, 5))
    with _writer_held(model, make_tier) as (tier, _):  # f in its write, waiting for engine
        q = tier.spiller.queue
        lru = ColdTierPromptCache(max_size=4, tier_for=lambda key: tier)
        _insert_shedding_the_first(model, tier, lru, b, a)
        assert lru.spill_unstored(0.2) == 1  # b spilled again; a's write-behind, queued still, is left to the drain
        _until(lambda: q.pending_items + q.dropped == 4)  # b's spill queued (and, before, a's write-behind shed)
    tier._run(tier.spiller.drain(30))
    assert lru.unstored_at_exit() == (2, 0) and q.dropped == 1  # before: (2, 1), a's write-behind shed
    assert tier.spiller.store.counters.stored == 3 and tier.spiller.store.counters.superseded == 0
    for p in (a, b):
        loaded = tier.load([*p, 1])
        assert loaded is not None and loaded.tokens == p


@contextlib.contextmanager
def _writer_held(model: Any, make_tier: Callable[..., EmbeddedTier], **kw: Any) -> Iterator[tuple[EmbeddedTier, Any]]:
    """An embedded tier and the engine's lock, held within, for which its writer waits with a spill (f) not
    droppable in its write: what is spilled meanwhile stays queued behind it."""
    import threading

    from spilld.lease import ThreadLockLease

    engine = threading.Lock()
    tier = make_tier(lease=ThreadLockLease(engine), **kw)
    q = tier.spiller.queue
    f = [9, *range(100, 180)]
    with engine:
        tier.spill(f, _prefilled(model, f), droppable=False)
        _until(lambda: q.pending_items == 1 and q._in_flight is not None)
        yield tier, engine


def _insert_shedding_the_first(model: Any, tier: EmbeddedTier, lru: Any, first: list[int], second: list[int]) -> None:
    """Behind ``_writer_held``'s f, a queue with room for one more: inserting ``first`` then ``second`` sheds
    ``first``'s write-behind."""
    q = tier.spiller.queue
    q.cap_bytes = 3 * q.pending_bytes // 2  # room for f and one more (the tiny caches are all of a size)
    lru.insert_cache("m", [*first, 1], _prefilled(model, first))
    lru.insert_cache("m", [*second, 1], _prefilled(model, second))  # over the cap: first's write-behind is shed
    _until(lambda: q.dropped == 1)


def _until(check: Callable[[], bool], timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


@pytest.mark.parametrize("block_tokens", [None, 0], ids=["blocks", "whole-files"])
def test_an_entry_evicted_while_its_write_behind_is_queued_or_written_is_written_once(
    tiny: tuple[Any, Any], make_tier: Callable[..., EmbeddedTier], block_tokens: int | None
) -> None:
    """Found in review: an entry the LRU evicted while its droppable write-behind was still queued (or being
    written) was spilled a second time, not droppable, and both were written: its tail blocks and manifest (the
    whole file with --block-tokens 0) twice, the first copy then superseded. The queued write-behind is kept
    instead, made not droppable (one being written stands for the eviction as it is): each entry is written once."""
    model, _ = tiny
    a, b, c, d = ([k, *range(100, 180)] for k in (4, 5, 6, 7))
    with _writer_held(model, make_tier, **({} if block_tokens is None else {"block_tokens": block_tokens})) as (
        tier,
        engine,
    ):  # f in its write, waiting for engine
        q = tier.spiller.queue
        lru = ColdTierPromptCache(max_size=1, tier_for=lambda key: tier)
        lru.insert_cache("m", [*a, 1], _prefilled(model, a))  # a's write-behind: queued behind f
        lru.insert_cache("m", [*b, 1], _prefilled(model, b))  # evicts a: its write-behind is kept
        _until(lambda: q.pending_items >= 3)
        time.sleep(0.05)  # (a second item, had one been queued, would be by now)
        assert q.pending_items == 3 and lru.stats["evictions_spilled"] == 1
    tier._run(tier.spiller.drain(30))
    with engine:  # b, in memory and stored; then c, whose write-behind the writer takes before c is evicted
        lru.insert_cache("m", [*c, 1], _prefilled(model, c))  # evicts b (stored: nothing spilled)
        _until(lambda: q.pending_items == 1 and q._in_flight is not None)
        lru.insert_cache("m", [*d, 1], _prefilled(model, d))  # evicts c while it is written
        time.sleep(0.05)
        assert q.pending_items == 2 and lru.stats["evictions_spilled"] == 2
    tier._run(tier.spiller.drain(30))
    counters = tier.spiller.store.counters
    assert (counters.stored, counters.superseded, q.stored, q.dropped) == (5, 0, 5, 0)  # before: 7 and 2
    assert not lru._evicting and lru.unstored_at_exit() == (0, 0)
    for p in (a, b, c, d):
        loaded = tier.load([*p, 1])
        assert loaded is not None and loaded.tokens == p


class _FailsWrites(fileio.FileOps):
    """A file layer whose writes fail with EIO once armed, ``times`` of them."""

    def __init__(self) -> None:
        self.times = 0

    def pwritev(self, fd: int, bufs: Any, offset: int) -> int:
        if self.times:
            self.times -= 1
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return super().pwritev(fd, bufs, offset)


def _stored_in_its_place(tier: EmbeddedTier, evicted: Any, ops: Any, a: list[int]) -> None:
    """The evicted entry ``a``, whose write-behind's write failed once (``ops``), was stored in its place and loads."""
    assert evicted.result(30).stored
    tier._run(tier.spiller.drain(30))
    assert ops.times == 0 and tier.spiller.queue.failed == 0 and tier.spiller.store.counters.stored == 2
    loaded = tier.load([*a, 1])
    assert loaded is not None and loaded.tokens == a


def test_an_eviction_whose_write_behind_fails_in_its_write_is_spilled_again(
    tiny: tuple[Any, Any], make_tier: Callable[..., EmbeddedTier]
) -> None:
    """An entry evicted while its write-behind is written leans on that write (``SpillQueue.keep``): found in
    review, when it then failed (an I/O error) the entry, gone from the LRU, was lost, where a write-behind that
    failed before the eviction is spilled again. The eviction's spill is written in its place, not droppable."""
    import threading

    from spilld.lease import ThreadLockLease

    model, _ = tiny
    a, b = ([k, *range(100, 180)] for k in (4, 5))
    engine = threading.Lock()
    tier = make_tier(lease=ThreadLockLease(engine))
    q, ops = tier.spiller.queue, _FailsWrites()
    tier.spiller.store.ops = ops
    lru = ColdTierPromptCache(max_size=1, tier_for=lambda key: tier)
    with engine:  # a's write-behind in its write, waiting for the engine's lock
        lru.insert_cache("m", [*a, 1], _prefilled(model, a))
        _until(lambda: q.pending_items == 1 and q._in_flight is not None)
        lru.insert_cache("m", [*b, 1], _prefilled(model, b))  # evicts a while it is written: it stands for a
        evicted = next(iter(lru._evicting))
        ops.times = 1  # a's write fails once
    _stored_in_its_place(tier, evicted, ops, a)  # before: FAILED, and a was lost


def test_an_eviction_whose_write_behind_was_kept_queued_and_then_fails_is_written_in_its_place(
    tiny: tuple[Any, Any], make_tier: Callable[..., EmbeddedTier]
) -> None:
    """As above for a write-behind still queued at the eviction (kept, made not droppable): found in review, when its
    write then failed the entry was lost. The eviction's spill is held with it and written in its place."""
    import asyncio
    import threading

    model, _ = tiny
    a, b = ([k, *range(100, 180)] for k in (4, 5))
    tier = make_tier()
    q, ops, gate = tier.spiller.queue, _FailsWrites(), threading.Event()
    tier.spiller.store.ops = ops

    async def hold() -> Any:  # the writer waits in a barrier: what is spilled meanwhile stays queued
        return tier.spiller.barrier(action=lambda: asyncio.to_thread(gate.wait, 30))

    lru = ColdTierPromptCache(max_size=1, tier_for=lambda key: tier)
    try:
        tier._run(hold())
        _until(lambda: q._in_flight is not None)
        lru.insert_cache("m", [*a, 1], _prefilled(model, a))  # a's write-behind: queued
        lru.insert_cache("m", [*b, 1], _prefilled(model, b))  # evicts a: its write-behind is kept
        evicted = next(iter(lru._evicting))
        _until(lambda: q.pending_items >= 3)
        time.sleep(0.05)  # (a second item of a, had one been queued, would be by now)
        assert q.pending_items == 3 and lru.stats["evictions_spilled"] == 1
        ops.times = 1  # a's write fails once
    finally:
        gate.set()
    _stored_in_its_place(tier, evicted, ops, a)  # before: FAILED, and a was lost


def test_a_write_behind_kept_for_its_eviction_is_never_shed_under_cap_pressure(
    tiny: tuple[Any, Any], make_tier: Callable[..., EmbeddedTier]
) -> None:
    """The write-behind kept in place of an evicted entry's spill is the entry's last copy: no spill queued after it
    sheds it, however far over the queue's cap (the droppable ones are shed instead)."""
    model, _ = tiny
    a, b = ([k, *range(100, 180)] for k in (4, 5))
    with _writer_held(model, make_tier) as (tier, _):  # f in its write, waiting for engine
        q = tier.spiller.queue
        lru = ColdTierPromptCache(max_size=1, tier_for=lambda key: tier)
        q.cap_bytes = 3 * q.pending_bytes  # room for f, a and b (the tiny caches are all of a size)
        lru.insert_cache("m", [*a, 1], _prefilled(model, a))
        lru.insert_cache("m", [*b, 1], _prefilled(model, b))  # evicts a: its write-behind is kept
        evicted = next(iter(lru._evicting))
        pressure = [tier.spill([8, i, *range(100, 180)], _prefilled(model, [8, i, *range(100, 180)])) for i in range(4)]
        _until(lambda: sum(p.done() for p in pressure) == 3)
        assert not evicted.done() and q.pending_items == 3  # f in flight, a kept, the newest of the pressure
    tier._run(tier.spiller.drain(30))
    assert evicted.result().stored and q.dropped == 4  # b's write-behind and three of the pressure: never a
    assert tier.spiller.store.counters.stored == 3 and tier.spiller.store.counters.superseded == 0
    loaded = tier.load([*a, 1])
    assert loaded is not None and loaded.tokens == a


def test_a_write_behind_shed_before_its_eviction_is_spilled_again_as_the_last_copy(
    tiny: tuple[Any, Any], make_tier: Callable[..., EmbeddedTier]
) -> None:
    """A write-behind the queue shed before its entry was evicted cannot be kept: the eviction spills the last copy
    again, not droppable, as before."""
    model, _ = tiny
    a, b, c = ([k, *range(100, 180)] for k in (4, 5, 6))
    with _writer_held(model, make_tier) as (tier, _):  # f in its write, waiting for engine
        lru = ColdTierPromptCache(max_size=2, tier_for=lambda key: tier)
        _insert_shedding_the_first(model, tier, lru, a, b)
        lru.insert_cache("m", [*c, 1], _prefilled(model, c))  # evicts a
        evicted = next(iter(lru._evicting))
    assert evicted.result(30).stored and lru.stats["evictions_spilled"] == 1
    tier._run(tier.spiller.drain(30))
    loaded = tier.load([*a, 1])
    assert loaded is not None and loaded.tokens == a


@contextlib.contextmanager
def _daemon_tier(tiny: tuple[Any, Any], max_size: int, *args: str) -> Iterator[tuple[Daemon, Any, ColdTierPromptCache]]:
    """A real daemon (``args`` added to its own), the mlx-lm tier on it and an LRU of ``max_size`` over that tier; the
    tier closed at the end."""
    from spilld.integrations.tier import DaemonTier

    model, tokenizer = tiny
    d = Daemon(new_root(), ["--cap", "64MiB", *args]).start()
    try:
        tier = DaemonTier(d.socket, model_identity(model, tokenizer, model_id="tiny"))
        yield d, tier, ColdTierPromptCache(max_size=max_size, tier_for=lambda key: tier)
        tier.close(10)
    finally:
        d.kill()
        cleanup(d.root)


@contextlib.contextmanager
def _stopped(d: Daemon) -> Iterator[None]:
    """The daemon's process stopped (SIGSTOP) within: it answers nothing meanwhile."""
    assert d.proc is not None
    os.kill(d.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)


@pytest.mark.parametrize("write_behind", ["stored", "shed"])
def test_an_eviction_through_the_daemon_is_sent_only_if_its_write_behind_being_shipped_is_not_stored(
    tiny: tuple[Any, Any], write_behind: str
) -> None:
    """Found in review: an entry evicted while its write-behind was being shipped (taken from the client's queue,
    here waiting on a daemon that does not answer) was spilled again and sent in full, and the daemon wrote it
    twice. The eviction's spill now waits, at its turn in the client's queue, for the daemon's answer to the
    write-behind, and is sent only if that is not stored: a droppable spill sent is not a stored one (here, with
    the daemon's write budget spent, the write-behind is shed and the eviction's spill, not droppable, is stored in
    its place). (One still in the client's own queue is kept: ``test_through_the_daemon_a_write_behind_still_in``.)"""
    model, _ = tiny
    shed = write_behind == "shed"
    with _daemon_tier(tiny, 1, *(["--write-budget", "1"] if shed else [])) as (d, tier, lru):
        a, b, f = ([k, *range(100, 180)] for k in (4, 5, 9))
        if shed:  # not droppable: written whatever the budget, which it spends
            assert tier.spill(f, _prefilled(model, f), droppable=False).result(30).stored
        client = tier._connect()
        assert client is not None
        q = client._async.queue
        with _stopped(d):  # nothing is stored meanwhile
            lru.insert_cache("m", [*a, 1], _prefilled(model, a))
            behind = lru._behind[("m", (*a, 1))]
            _until(lambda: q._in_flight is not None and q.pending_items == 1)  # a's write-behind: being shipped
            lru.insert_cache("m", [*b, 1], _prefilled(model, b))  # evicts a
            other = lru._behind[("m", (*b, 1))]
            evicted = next(iter(lru._evicting))
            assert lru.stats["evictions_spilled"] == 1 and evicted is not behind
        assert evicted.result(30).stored and other.result(30).outcome is behind.result(30).outcome
        assert behind.result().outcome is (Outcome.DROPPED if shed else Outcome.STORED)
        st = tier.stats()["queue"]
        assert (st["stored"], st["dropped"]) == ((2, 2) if shed else (2, 0))  # before, stored: a twice (3)
        loaded = tier.load([*a, 1])
        assert loaded is not None and loaded.tokens == a


def test_at_exit_a_write_behind_the_daemon_has_not_stored_is_spilled_again_not_droppable(tiny: tuple[Any, Any]) -> None:
    """Found in review: at exit, a write-behind handed to the daemon and not stored by ``spill_unstored``'s timeout
    was left to the drain, droppable, where the daemon's queue could shed it for the exit's own spills (not
    droppable): that entry, in memory at exit, lost. The daemon's tier cannot promote one its client has shipped
    (here, being shipped): it is spilled again, and that spill is sent only if the daemon does not store the
    write-behind (found in review: it was sent at once, and both were written)."""
    model, _ = tiny
    with _daemon_tier(tiny, max_size=4) as (d, tier, lru):
        a = [4, *range(100, 180)]
        with _stopped(d):  # nothing is stored meanwhile
            lru.insert_cache("m", [*a, 1], _prefilled(model, a))
            behind = lru._behind[("m", (*a, 1))]
            # handed with its write-behind (not counted: the tier keeps that one where it can), spilled again
            assert lru.spill_unstored(0.3) == 0 and not behind.done()  # not left to the drain
            again = lru._at_exit[-1]
            assert again is not behind
        assert again.result(30).stored and lru.unstored_at_exit() == (1, 0)
        assert behind.result(30).stored and tier.stats()["queue"]["stored"] == 1  # before: 2, the entry twice
        loaded = tier.load([*a, 1])
        assert loaded is not None and loaded.tokens == a


@pytest.mark.parametrize("at", ["eviction", "exit"])
def test_through_the_daemon_a_write_behind_still_in_the_clients_queue_stands_for_its_entry(
    tiny: tuple[Any, Any], at: str
) -> None:
    """Found in review: an entry evicted (or held at exit past ``spill_unstored``'s timeout) while its write-behind
    still waited in the daemon client's own queue, not shipped, was spilled again, and both were sent and written
    (the first copy then superseded): ``DaemonTier`` did not pass ``behind`` on. The client keeps it, made not
    droppable where it stands: each entry is sent once."""
    import threading

    from spilld.integrations.tier import DaemonTier
    from spilld.lease import ThreadLockLease

    model, tokenizer = tiny
    ident = model_identity(model, tokenizer, model_id="tiny")
    d = Daemon(new_root(), ["--cap", "64MiB"]).start()
    engine = threading.Lock()
    try:
        tier = DaemonTier(d.socket, ident, lease=ThreadLockLease(engine))
        lru = ColdTierPromptCache(max_size=1 if at == "eviction" else 4, tier_for=lambda key: tier)
        f, a, b = ([k, *range(100, 180)] for k in (9, 4, 5))
        client = tier._connect()
        assert client is not None
        q = client._async.queue
        with engine:  # the client's writer ships f, waiting for the engine's lock: what follows waits in its queue
            tier.spill(f, _prefilled(model, f), droppable=False)
            _until(lambda: q._in_flight is not None)
            lru.insert_cache("m", [*a, 1], _prefilled(model, a))  # a's write-behind: queued behind f
            if at == "eviction":
                lru.insert_cache("m", [*b, 1], _prefilled(model, b))  # evicts a
                held = next(iter(lru._evicting))
            else:
                assert lru.spill_unstored(0.2) == 0  # a's write-behind, queued still: kept, nothing spilled anew
                held = lru._at_exit[-1]
            want = 3 if at == "eviction" else 2  # f, a (and b)
            _until(lambda: q.pending_items >= want)
            time.sleep(0.1)  # (a second item of a, had one been queued, would be by now)
            assert q.pending_items == want  # before: one more, a twice
        assert held.result(30).stored
        report = tier.close(30)
        assert report is not None and report.done and report.not_stored == 0
        assert q.stored == want  # shipped: each entry once
        with Client(d.socket, identity=ident) as c:
            store = c.status()["store"]
            loaded = c.load([*a, 1])
        assert store["stored"] == q.stored and store["superseded"] == 0
        assert loaded is not None and loaded.tokens == a
    finally:
        d.kill()
        cleanup(d.root)


def test_a_hung_daemon_costs_the_engine_one_short_wait_not_one_a_request(
    tiny: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A daemon that accepts but does not answer (stopped, swapping): found in review, every prompt's lookup held
    the server's generation thread for the client's 30 s timeout, and a new tier waited 30 s for its hello."""
    import os

    from spilld import client as client_mod
    from spilld.integrations import tier as tier_mod
    from spilld.integrations.tier import DaemonTier

    model, tokenizer = tiny
    ident = model_identity(model, tokenizer, model_id="tiny")
    monkeypatch.setattr(tier_mod, "RECONNECT_INTERVAL_S", 3.0)
    d = Daemon(new_root(), ["--cap", "64MiB"]).start()
    tiers: list[DaemonTier] = []
    try:
        tiers.append(DaemonTier(d.socket, ident))
        p = [4, *range(200, 240)]
        assert tiers[0].spill(p, _prefilled(model, p), droppable=False).result(30).stored
        assert d.proc is not None
        os.kill(d.proc.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            assert tiers[0].load([*p, 1]) is None
            assert time.monotonic() - t0 < client_mod.LOOKUP_TIMEOUT_S + 1.0
            t0 = time.monotonic()
            assert tiers[0].load([*p, 1]) is None and time.monotonic() - t0 < 0.1  # skipped: no second wait
            t0 = time.monotonic()
            tiers.append(DaemonTier(d.socket, ident))  # a new model's tier: its hello waits a short while
            assert time.monotonic() - t0 < client_mod.CONNECT_TIMEOUT_S + 1.0
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        time.sleep(3.0)  # the back-off over: the daemon answers again
        loaded = tiers[0].load([*p, 1])
        assert loaded is not None and loaded.tokens == p
    finally:
        for t in tiers:
            t.close(10)
        d.kill()
        cleanup(d.root)


def test_an_exit_drain_that_leaves_spills_unwritten_says_so(
    tiny: tuple[Any, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Found in review: with the daemon stopped (SIGSTOP) when the server exited, the entries spilled at exit were
    dropped at --spilld-drain-timeout and the log went from 'draining the cold tier (3 more entries)' to the
    counters, exit 0: lost in silence. What the exit's spills left unstored is said; a drain that stores them all
    says nothing."""
    from spilld.integrations.mlx_lm import ServerTiers, drain_at_exit
    from spilld.integrations.tier import DaemonTier

    model, tokenizer = tiny
    ident = model_identity(model, tokenizer, model_id="tiny")
    key = ("m", None, None)
    d = Daemon(new_root(), ["--cap", "64MiB"]).start()
    try:
        tiers = ServerTiers(None, socket=None, folder=None)
        tiers.tiers[key] = tier = DaemonTier(d.socket, ident)
        lru = ColdTierPromptCache(8, tier_for=lambda k: tier)
        p = [4, *range(200, 240)]
        lru.insert_cache(key, p, _prefilled(model, p))
        drain_at_exit(lru, tiers, 10)
        assert "did not store" not in caplog.text  # all stored: nothing to say
        tiers.tiers[key] = tier = DaemonTier(d.socket, ident)
        lru = ColdTierPromptCache(8, tier_for=lambda k: tier)
        assert d.proc is not None
        os.kill(d.proc.pid, signal.SIGSTOP)
        try:
            q = [5, *range(300, 340)]
            lru.insert_cache(key, q, _prefilled(model, q))
            drain_at_exit(lru, tiers, 1.0)
        finally:
            os.kill(d.proc.pid, signal.SIGCONT)
        assert "did not store 1 of the 1 caches held at exit" in caplog.text, caplog.text
    finally:
        d.kill()
        cleanup(d.root)


def test_an_exit_drain_says_nothing_of_write_behinds_shed_when_their_caches_are_stored(
    tiny: tuple[Any, Any], caplog: pytest.LogCaptureFixture
) -> None:
    """Found in review: with the daemon's write budget spent, the droppable write-behinds still in flight at exit
    were shed (by design: the exit spills their entries again, not droppable, and those are stored), yet the exit
    said 'did not drain: ... 2 more ended not stored; those caches are lost' on every such exit."""
    from spilld.integrations.mlx_lm import ServerTiers, drain_at_exit
    from spilld.integrations.tier import DaemonTier

    model, tokenizer = tiny
    ident = model_identity(model, tokenizer, model_id="tiny")
    key = ("m", None, None)
    d = Daemon(new_root(), ["--cap", "64MiB", "--write-budget", "1K"]).start()
    try:
        tiers = ServerTiers(None, socket=None, folder=None)
        tiers.tiers[key] = tier = DaemonTier(d.socket, ident)
        lru = ColdTierPromptCache(8, tier_for=lambda k: tier)
        prompts = [[6, i, *range(60, 100)] for i in range(3)]
        for p in prompts:
            lru.insert_cache(key, p, _prefilled(model, p))
        drain_at_exit(lru, tiers, 30)
        st = json.loads(d.cli("status", "--socket", d.socket, "--json").stdout)
        assert st["store"]["dropped_budget"] >= 1, st["store"]  # write-behinds were shed at exit
        again = DaemonTier(d.socket, ident)
        try:
            assert all(again.load([*p, 1]) is not None for p in prompts)  # every cache is stored
        finally:
            again.close(10)
        assert "lost" not in caplog.text, caplog.text
    finally:
        d.kill()
        cleanup(d.root)


def test_a_daemon_gone_under_a_connected_tier_is_asked_again_each_interval_not_each_request(
    tiny: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Found in review: with the daemon killed under a running server, every request's lookup and spills tried to
    reconnect, each failure a warning (15 lines for 5 requests, and so on for as long as the daemon stayed down).
    Now the first failure is said once and the daemon is asked again after RECONNECT_INTERVAL_S, as one that was
    unreachable at the first try; once it is back, lookups and spills go through again."""
    from spilld.integrations import tier as tier_mod
    from spilld.integrations.tier import DaemonTier

    monkeypatch.setattr(tier_mod, "RECONNECT_INTERVAL_S", 0.5)
    model, tokenizer = tiny
    d = Daemon(new_root(), ["--cap", "64MiB"]).start()
    try:
        tier = DaemonTier(d.socket, model_identity(model, tokenizer, model_id="tiny"))
        p = [4, *range(200, 240)]
        cache = _prefilled(model, p)
        assert tier.spill(p, cache, droppable=False).result(30).stored
        d.kill()
        caplog.clear()
        t0, requests = time.monotonic(), 0
        while time.monotonic() - t0 < 2.0:  # a request: its lookup, then its spill
            assert tier.load([*p, 1]) is None
            tier.spill([*p, requests], cache).result(30)
            requests += 1
            time.sleep(0.02)
        warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
        assert requests >= 20 and len(warnings) <= 8, (requests, warnings)  # 2 s at 0.5 s apart, one late spill
        d.start()
        time.sleep(0.6)
        loaded = tier.load([*p, 1])
        assert loaded is not None and loaded.tokens == p
        assert tier.spill([*p, 7], cache, droppable=False).result(30).stored
        tier.close(10)
    finally:
        d.kill()
        cleanup(d.root)


def test_a_daemon_restarted_at_once_under_a_connected_tier_is_asked_at_once(tiny: tuple[Any, Any]) -> None:
    """Found in review: any call failed by a lost connection made the tier miss and refuse spills for
    RECONNECT_INTERVAL_S, even with the daemon back already (a service manager's restart, socket activation): a
    lookup 0.3 s after the restart missed, and an evicted cache's spill was refused (that cache lost). Only a daemon
    that accepts no connection is waited for."""
    from spilld.integrations.tier import DaemonTier

    model, tokenizer = tiny
    d = Daemon(new_root(), ["--cap", "64MiB"]).start()
    try:
        tier = DaemonTier(d.socket, model_identity(model, tokenizer, model_id="tiny"))
        p = [4, *range(200, 240)]
        assert tier.spill(p, _prefilled(model, p), droppable=False).result(30).stored
        assert d.proc is not None
        os.kill(d.proc.pid, signal.SIGSTOP)  # a spill under way when the daemon dies (a crash)
        q = [5, *range(300, 340)]
        lost = tier.spill(q, _prefilled(model, q), droppable=False)
        d.kill()
        d.start()  # and back at once
        assert isinstance(lost.result(30).error, errors.ConnectionLost), lost.result()
        time.sleep(0.3)
        loaded = tier.load([*p, 1])
        assert loaded is not None and loaded.tokens == p
        assert tier.spill(q, _prefilled(model, q), droppable=False).result(30).stored
        tier.close(10)
    finally:
        d.kill()
        cleanup(d.root)


def test_the_tiers_of_several_models_drain_within_one_timeout() -> None:
    """The exit drain's --spilld-drain-timeout is the server's, not each model's (found in review: a server that had
    loaded k models could drain for k times it)."""
    from spilld.integrations.mlx_lm import ServerTiers

    class Slow:  # a tier whose queue never empties: its close takes all the time it is given
        def __init__(self) -> None:
            self.given: list[float | None] = []

        def close(self, timeout: float | None = None) -> None:
            self.given.append(timeout)
            time.sleep(timeout or 0)

    tiers = ServerTiers(None, socket=None, folder=None)
    slow = [Slow() for _ in range(3)]
    tiers.tiers = {("m", i): t for i, t in enumerate(slow)}
    t0 = time.monotonic()
    tiers.close(0.6)
    assert time.monotonic() - t0 < 0.6 + 0.3 and all(len(t.given) == 1 for t in slow)


def test_image_placeholder_ids_are_neither_stored_nor_looked_up(
    tiny: tuple[Any, Any], make_tier: Callable[..., EmbeddedTier]
) -> None:
    model, _ = tiny
    tier = make_tier()
    calls: list[str] = []
    for name in ("spill_threadsafe", "load"):  # count what reaches the spiller (a failed lookup would be a miss too)
        real = getattr(tier.spiller, name)
        setattr(tier.spiller, name, lambda *a, _real=real, _name=name, **k: calls.append(_name) or _real(*a, **k))
    lru = ColdTierPromptCache(max_size=2, tier_for=lambda key: tier)
    p = [1, -1, -1, 2, *range(10, 20)]  # mlx-lm keys image tokens with negative ids
    lru.insert_cache("m", p, _prefilled(model, [max(t, 0) for t in p]))
    cache, rest = lru.fetch_nearest_cache("m", [7, -1, 8])  # no error: a plain miss
    assert cache is None and rest == [7, -1, 8]
    tier._run(tier.spiller.drain(30))
    assert calls == [] and tier.spiller.store.counters.stored == 0
    # control: the same calls with plain ids reach the spiller, one spill and one lookup
    q = [1, 0, 0, 2, *range(10, 20)]
    lru.insert_cache("m", q, _prefilled(model, q))
    cache, rest = lru.fetch_nearest_cache("m", [7, 0, 8])
    assert cache is None and rest == [7, 0, 8]
    tier._run(tier.spiller.drain(30))
    assert calls == ["spill_threadsafe", "load"] and tier.spiller.store.counters.stored == 1


def test_unreachable_daemon_leaks_no_thread(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    import threading

    from spilld.format import Identity
    from spilld.integrations import tier as tier_mod

    monkeypatch.setattr(tier_mod, "RECONNECT_INTERVAL_S", 0.0)
    before = set(threading.enumerate())  # (compared as threads, not a count: an earlier test's may end meanwhile)
    t = tier_mod.DaemonTier(str(tmp_path / "nobody.sock"), Identity(model_id="x"))
    for _ in range(5):
        assert t.load([1, 2, 3]) is None
        assert not t.spill([1, 2], []).result().stored
    assert set(threading.enumerate()) - before == set()


def test_a_disk_prefix_shorter_than_memory_is_neither_read_nor_a_hit(
    tiny: tuple[Any, Any], make_tier: Callable[..., EmbeddedTier]
) -> None:
    model, _ = tiny
    tier = make_tier()
    short, long = list(range(8)), list(range(16))
    assert tier.spill(short, _prefilled(model, short), droppable=False).result(30).stored
    lru = ColdTierPromptCache(max_size=2, tier_for=lambda key: DropsWriteBehinds(tier))
    lru.insert_cache("m", long, _prefilled(model, long))  # its write-behind is shed: disk keeps only `short`
    cache, rest = lru.fetch_nearest_cache("m", [*long, 5, 6])
    assert cache is not None and rest == [5, 6]  # memory's 16 tokens beat disk's 8
    assert lru.stats["cold_misses"] == 1 and lru.stats["restores"] == 0
    assert tier.stats()["store"]["hits"] == 0  # the store's hits count only restores the engine kept


def test_both_spilld_dir_and_socket_are_refused(tmp_path: Any) -> None:
    cmd = [sys.executable, "-m", "spilld.integrations.mlx_lm", "--model", "x", "--spilld-dir", str(tmp_path)]
    r = subprocess.run([*cmd, "--spilld-socket", str(tmp_path / "s.sock")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "exclude" in r.stderr, r.stderr


def test_a_spilld_dir_that_cannot_be_a_folder_is_refused_at_start(tmp_path: Any) -> None:
    """Found in review: --spilld-dir under a regular file started the server, whose start line said 'files in
    FOLDER'; the first request logged 'no cold tier' once and every request after was served without one."""
    (tmp_path / "file").write_text("")
    folder = str(tmp_path / "file" / "store")
    # (a host no server can bind: a server started anyway ends at once, rather than serving until the timeout)
    cmd = [sys.executable, "-m", "spilld.integrations.mlx_lm", "--model", "x", "--host", "256.0.0.0"]
    r = subprocess.run([*cmd, "--spilld-dir", folder], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, (r.returncode, r.stderr[-2000:])
    assert f"--spilld-dir {folder}:" in r.stderr and "create folder failed" in r.stderr, r.stderr


def test_a_usage_error_creates_no_spilld_dir(tmp_path: Any) -> None:
    """Found in review: the --spilld-dir check made the folder before mlx-lm read its own options, so a mistyped
    option (exit 2, a usage line) left the folders it named behind; before that check, a refusal created nothing."""
    folder = tmp_path / "new" / "store"
    cmd = [sys.executable, "-m", "spilld.integrations.mlx_lm", "--model", "x", "--spilld-dir", str(folder), "--bogus"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "unrecognized arguments: --bogus" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "new").exists()


def test_a_spilld_dir_a_daemon_serves_is_refused_at_start() -> None:
    """Found in review: with --spilld-dir set to a daemon's folder, the embedded tier (made on the first request)
    waited a minute on the generation thread for the folder's lock, then served without a cold tier. Refused at
    start now (exit 2), naming the daemon's pid; the folder is left as it was."""
    d = Daemon(new_root(), ["--cap", "64MiB"]).start()
    try:
        before = sorted(os.listdir(d.dir))
        cmd = [sys.executable, "-m", "spilld.integrations.mlx_lm", "--model", "x", "--spilld-dir", d.dir]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "served by a daemon (pid" in r.stderr, (r.returncode, r.stderr[-2000:])
        assert len(r.stderr.strip().splitlines()) == 1 and sorted(os.listdir(d.dir)) == before
    finally:
        d.kill()
        cleanup(d.root)


def test_a_model_without_a_tier_is_plain_lru(tiny: tuple[Any, Any]) -> None:
    model, _ = tiny
    lru = ColdTierPromptCache(max_size=2, tier_for=lambda key: None)
    p = list(range(20))
    lru.insert_cache("m", p, _prefilled(model, p))
    cache, rest = lru.fetch_nearest_cache("m", [*p, 5])
    assert cache is not None and rest == [5]
    assert lru.stats["spills"] == 0 and lru.stats["restores"] == 0


def test_wrapper_help_lists_both_option_sets() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "spilld.integrations.mlx_lm", "--help"], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert "--spilld-dir" in out.stdout and "--prompt-cache-size" in out.stdout
    assert all(f"--spilld-{o}" in out.stdout for o in ("cap", "disk-cap", "durability")), out.stdout


def test_the_help_and_mlx_lms_errors_name_this_command_and_the_default_socket() -> None:
    """Found in review: mlx-lm's half of --help, and its errors (a mistyped --spilld-... option among them), named
    the command 'mlx_lm.py', a file the user never ran; --spilld-socket's default was 'the daemon's default socket'
    where the spilld command names the path."""
    cmd = [sys.executable, "-m", "spilld.integrations.mlx_lm"]
    env = {**os.environ, "SPILLD_SOCKET": "/srv/engine/spilld.sock"}  # (no hyphen: the help wraps there)
    out = subprocess.run([*cmd, "--help"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "(default /srv/engine/spilld.sock)" in " ".join(out.stdout.split())
    assert "mlx_lm.py" not in out.stdout and out.stdout.count("usage: python -m spilld.integrations.mlx_lm") == 2
    bad = subprocess.run([*cmd, "--model", "x", "--spilld-dri", "d"], capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.strip().splitlines()[-1].startswith(
        "python -m spilld.integrations.mlx_lm: error: unrecognized arguments: --spilld-dri"
    ), bad.stderr


def test_a_model_whose_caches_are_cache_lists_is_spilled_and_restored(tmp_path: Any) -> None:
    """Found in review: a ``CacheList`` has no offset of its own, so the integration never spilled models built of
    them (falcon_h1, deepseek_v32, ...), though spilld stores them exactly."""
    from tests.models import tiny_falcon_h1

    model = tiny_falcon_h1()
    tier = EmbeddedTier(str(tmp_path), model_identity(model, model_id="falcon"))
    try:
        lru = ColdTierPromptCache(max_size=2, tier_for=lambda key: tier)
        p = [5, *range(10, 50)]
        cache = _prefilled(model, p)
        assert covered_tokens([*p, 7], cache) == len(p)
        lru.insert_cache("m", [*p, 7], cache)
        tier._run(tier.spiller.drain(30))
        assert lru.stats["spills"] == 1 and tier.spiller.store.counters.stored == 1
        loaded = tier.load([*p, 7, 8])
        assert loaded is not None and loaded.tokens == p
        got = model(mx.array([[7, 8]]), cache=loaded.caches)
        assert mx.array_equal(got, model(mx.array([[7, 8]]), cache=_prefilled(model, p))).item()
    finally:
        tier.close(30)


def test_spills_the_tier_refused_at_once_are_not_counted(
    tiny: tuple[Any, Any], tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: ``spills`` and ``evictions_spilled`` counted spills refused on the spot (no daemon)."""
    from spilld.format import Identity
    from spilld.integrations import tier as tier_mod

    monkeypatch.setattr(tier_mod, "RECONNECT_INTERVAL_S", 0.0)
    nobody = tier_mod.DaemonTier(str(tmp_path / "nobody.sock"), Identity(model_id="x"))
    lru = ColdTierPromptCache(max_size=1, tier_for=lambda key: nobody)
    for i in range(3):
        p = [i, *range(10, 20)]
        lru.insert_cache("m", [*p, 1], _prefilled(tiny[0], p))  # each insert evicts the one before
    assert lru.stats["spills"] == 0 and lru.stats["evictions_spilled"] == 0


def test_a_restore_read_a_hung_disk_holds_backs_the_tier_off(
    tiny: tuple[Any, Any], make_tier: Callable[..., EmbeddedTier], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: a read past its deadline was a plain miss, so every prompt that matched a file on a hung
    disk held the generation thread for the whole I/O deadline, prompt after prompt. It is said now
    (``StorageTimeout``), and the tier stops asking for a while, longer at each timeout in a row."""
    from spilld.integrations import tier as tier_mod

    monkeypatch.setattr(tier_mod, "RECONNECT_INTERVAL_S", 1.0)
    model, _ = tiny
    tier = make_tier()
    store = tier.spiller.store
    p = [3, *range(20, 60)]
    assert tier.spill(p, _prefilled(model, p), droppable=False).result(30).stored
    store.io_timeout = 0.3
    read = store.read_hit
    monkeypatch.setattr(store, "read_hit", lambda *a, **k: (time.sleep(1.0), read(*a, **k))[1])
    lru = ColdTierPromptCache(max_size=2, tier_for=lambda key: tier)
    waits = []
    for i in range(3):
        t0 = time.monotonic()
        cache, _ = lru.fetch_nearest_cache("m", [*p, 5, i])
        waits.append(time.monotonic() - t0)
        assert cache is None
    assert waits[0] >= 0.3 and max(waits[1:]) < 0.1, waits  # one wait, then misses at once
    time.sleep(1.1)  # the quiet second over: asked again, timed out again, quiet for twice as long
    lru.fetch_nearest_cache("m", [*p, 5, 9])
    time.sleep(1.1)
    t0 = time.monotonic()
    assert lru.fetch_nearest_cache("m", [*p, 5, 9])[0] is None and time.monotonic() - t0 < 0.1
    monkeypatch.setattr(store, "read_hit", read)  # the disk answers again
    time.sleep(1.2)
    loaded = tier.load([*p, 5])
    assert loaded is not None and loaded.tokens == p
    time.sleep(1.5)  # let the reads left to their threads end


def test_the_integrations_paths_are_absolute_with_the_home_folder_expanded(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from spilld.integrations.mlx_lm import absolute_paths

    monkeypatch.setenv("HOME", "/home/engine")
    opts = argparse.Namespace(spilld_dir="~/cold", spilld_socket=None, spilld_metrics_file="m.prom")
    absolute_paths(opts)
    assert opts.spilld_dir == "/home/engine/cold" and opts.spilld_socket is None
    assert opts.spilld_metrics_file == os.path.join(os.getcwd(), "m.prom")


def test_a_daemon_that_accepts_and_never_answers_is_tried_less_and_less_often(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: each try held the generation thread for the hello's bound, every RECONNECT_INTERVAL_S,
    for as long as the daemon stayed hung (half the engine's time). Failed tries in a row now wait twice as long."""
    from spilld import client as client_mod
    from spilld.format import Identity
    from spilld.integrations import tier as tier_mod

    monkeypatch.setattr(tier_mod, "RECONNECT_INTERVAL_S", 0.2)
    monkeypatch.setattr(client_mod, "CONNECT_TIMEOUT_S", 0.2)
    path = str(tmp_path / "hung.sock")
    hung = socket.socket(socket.AF_UNIX)
    hung.bind(path)
    hung.listen(64)  # accepts (the kernel's backlog), never answers
    try:
        t = tier_mod.DaemonTier(path, Identity(model_id="x"))
        t0, tries = time.monotonic(), 1
        while time.monotonic() - t0 < 3.0:
            c0 = time.monotonic()
            assert t.load([1, 2, 3]) is None
            tries += time.monotonic() - c0 > 0.1  # a try: held for the hello's bound
            time.sleep(0.02)
        assert 3 <= tries <= 5, tries  # 0.2 s apart each time: 8
        t.close(1)
    finally:
        hung.close()


def test_a_stalled_writer_holds_at_most_a_few_evicted_caches_past_the_queue_cap(
    tiny: tuple[Any, Any], make_tier: Callable[..., EmbeddedTier]
) -> None:
    """Found in review: every evicted cache was spilled not droppable, and a queue never sheds those, so a writer
    that stalled (a hung disk, a stopped daemon) kept every cache the LRU let go in memory: the LRU's bounds no
    longer bounded anything. Past LAST_COPIES_HELD the evicted caches are spilled droppable (shed over the cap)."""
    import threading

    from spilld.integrations import mlx_lm as integration
    from spilld.lease import ThreadLockLease

    model, _ = tiny
    engine = threading.Lock()
    tier = make_tier(lease=ThreadLockLease(engine), queue_cap=1 << 20)
    lru = ColdTierPromptCache(max_size=1, tier_for=lambda key: tier)
    one = 0
    with engine:  # the writer waits for the engine's lock: stalled
        for i in range(16):
            p = [3, i, *range(20, 400)]
            cache = _prefilled(model, p)
            one = max(one, sum(c.nbytes for c in cache))
            lru.insert_cache("m", [*p, 1], cache)  # evicts the one before
        q = tier.spiller.queue.counters()
        assert lru.stats["evictions_spilled"] == 15
        assert q["pending_bytes"] <= (1 << 20) + (integration.LAST_COPIES_HELD + 1) * one, (q, one)
    tier._run(tier.spiller.drain(30))


def test_a_daemon_not_there_yet_is_tried_every_interval(
    tmp_path: Any, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Found in review: a daemon not started yet (or restarting) was backed off like a hung one, up to 5 minutes,
    though a try of a missing socket costs the engine nothing."""
    from spilld.format import Identity
    from spilld.integrations import tier as tier_mod

    monkeypatch.setattr(tier_mod, "RECONNECT_INTERVAL_S", 0.1)
    t = tier_mod.DaemonTier(str(tmp_path / "later.sock"), Identity(model_id="x"))
    t0 = time.monotonic()
    while time.monotonic() - t0 < 1.0:
        assert t.load([1, 2, 3]) is None
        time.sleep(0.02)
    tries = sum("unreachable" in r.getMessage() for r in caplog.records)
    assert tries >= 7, tries  # doubling: 4


def test_a_rank_other_than_0_stops_its_generation_before_the_tier_drains(model_dir: str, tmp_path: Any) -> None:
    """In a distributed run only rank 0 serves HTTP; the others wait on their generation thread. Found in review:
    a stop signal there cut that wait short, so the drain ran beside a generation still decoding, and exit was 1."""
    log = tmp_path / "rank1.log"
    script = (
        "import mlx.core as mx\n"
        "class Rank1:\n"
        "    def rank(self): return 1\n"
        "    def size(self): return 1\n"
        "mx.distributed.init = lambda *a, **k: Rank1()\n"
        "from spilld.integrations.mlx_lm import main\n"
        f"main(['--model', {model_dir!r}, '--port', '0', '--spilld-dir', {str(tmp_path / 'store')!r}])\n"
    )
    with open(log, "wb") as f:
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=f, stderr=f)
    try:
        deadline = time.monotonic() + 120
        while "cold tier: embedded" not in _read(log):
            assert proc.poll() is None and time.monotonic() < deadline, _read(log)
            time.sleep(0.2)
        time.sleep(1.0)  # the generation thread started, waiting for requests
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, _read(log)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "mlx_lm.server failed" not in _read(log) and "cold tier counters:" in _read(log)


def test_a_stop_signal_before_the_server_serves_is_a_clean_stop(model_dir: str, tmp_path: Any) -> None:
    """Found in review: SIGTERM sent as soon as the start line ('cold tier: embedded ...') was logged reached the
    wrapper before mlx-lm's serving loop, which alone takes it: 'mlx_lm.server failed' with a traceback, exit 1,
    and the drain ran beside a generation thread never stopped. The signal here comes at the last moment before
    that loop (the HTTP server about to bind), every time."""
    log = tmp_path / "early.log"
    script = (
        "import os, signal\n"
        "from mlx_lm import server\n"
        "serve = server._run_http_server\n"
        "def early(*a, **k):\n"
        "    os.kill(os.getpid(), signal.SIGTERM)\n"
        "    serve(*a, **k)\n"
        "server._run_http_server = early\n"
        "from spilld.integrations.mlx_lm import main\n"
        f"main(['--model', {model_dir!r}, '--port', '0', '--spilld-dir', {str(tmp_path / 'store')!r}])\n"
    )
    text = _exits_cleanly(script, log)
    assert "mlx_lm.server failed" not in text and "Traceback" not in text, text
    assert "stopped before serving" in text and "cold tier counters:" in text


def test_a_stop_signal_inside_the_generators_start_stops_its_thread_before_the_drain(
    model_dir: str, tmp_path: Any
) -> None:
    """Found in review: SIGTERM landing inside mlx-lm's ``ResponseGenerator()``, once its generation thread had
    started, lost the generator; that thread ran on through the drain. The signal here comes as that thread's
    start returns, every time; the drain must find it stopped."""
    log = tmp_path / "inside.log"
    script = (
        "import os, signal, threading\n"
        "from mlx_lm import server\n"
        "started = []\n"
        "class Signalling(threading.Thread):\n"
        "    def start(self):\n"
        "        super().start()\n"
        "        started.append(self)\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "server.Thread = Signalling\n"
        "import spilld.integrations.mlx_lm as integration\n"
        "drain = integration.drain_at_exit\n"
        "def seen(*a, **k):\n"
        "    print('generation threads alive at drain:', sum(t.is_alive() for t in started), flush=True)\n"
        "    drain(*a, **k)\n"
        "integration.drain_at_exit = seen\n"
        f"integration.main(['--model', {model_dir!r}, '--port', '0', '--spilld-dir', {str(tmp_path / 'store')!r}])\n"
    )
    text = _exits_cleanly(script, log)
    assert "generation threads alive at drain: 0" in text, text
    assert "stopped before serving" in text and "Traceback" not in text, text


def test_an_embedded_tier_closed_from_a_spill_futures_callback_closes_once_it_returns(tmp_path: Any) -> None:
    """As the daemon's client (tests/test_client_lifecycle.py): a close on the tier's own loop thread is run once
    the callback returns, never waited for there (it blocked that thread on itself, then failed to join it)."""
    import threading

    from mlx_lm.models import cache as C

    from tests.caches import fill

    tier = EmbeddedTier(str(tmp_path), model_identity(None, model_id="embedded-close"))
    done, took = threading.Event(), []

    def callback(_: object) -> None:
        t0 = time.monotonic()
        tier.close(5)
        took.append(time.monotonic() - t0)
        done.set()

    on_loop(tier, tier.spill(list(range(8)), [fill(C.KVCache(), 8)], droppable=False), callback)
    assert done.wait(30) and took[0] < 1.0
    deadline = time.monotonic() + 10
    while not tier._lt.loop.is_closed() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert tier._lt.loop.is_closed() and not tier.spiller.store.lock.held  # closed, the folder's lock let go


def test_entries_inserted_while_the_daemon_was_away_are_spilled_at_exit(tmp_path: Any) -> None:
    """Found in review: mlx-lm's batched path inserts lazily extracted caches; while the daemon was unreachable the
    spill was refused before any clone evaluated them, and at exit the main thread, which cannot evaluate a graph
    built on the generation thread, refused every one of them: all lost."""
    import threading

    from mlx_lm.generate import BatchGenerator

    from spilld import format as fmt
    from spilld.integrations.tier import DaemonTier
    from tests.models import tiny_llama

    d = Daemon(new_root())
    try:
        model = tiny_llama()
        tier = DaemonTier(d.socket, fmt.Identity(model_id="tiny"))  # no daemon yet
        lru = ColdTierPromptCache(max_size=10, tier_for=lambda key: tier)

        def generation_thread() -> None:  # as the server's: a stream of its own, caches extracted lazily
            bg = BatchGenerator(model, max_tokens=4, stream=mx.default_stream(mx.default_device()))
            bg.insert([[(7 * i) % 250 for i in range(40)]])
            while not (done := [r for r in bg.next()[1] if r.finish_reason is not None]):
                pass
            lru.insert_cache("m", done[0].all_tokens[:], done[0].prompt_cache)
            bg.close()

        t = threading.Thread(target=generation_thread)
        t.start()
        t.join()
        assert lru.stats["spills"] == 0  # refused: no daemon
        d.start()  # the daemon is up by the server's exit, inside the tier's retry wait (found in review: none spilled)
        assert lru.spill_unstored() == 1  # on the main thread
        tier.close(30)
        assert "stored 1," in d.cli("status", "--socket", d.socket).stdout
    finally:
        d.kill()
        cleanup(d.root)


def test_a_process_that_exits_after_its_tier_closed_from_a_callback_loses_no_spill(tmp_path: Any) -> None:
    """Found in review: a close begun on the tier's own loop thread unregistered the exit hook, so a process that
    then exited did not wait for it: of 6 non-droppable spills queued, 1 was stored."""
    script = f"""
import threading
from mlx_lm.models import cache as C
from tests.caches import fill
from spilld.integrations.tier import EmbeddedTier
from spilld import errors
from spilld.identity import model_identity
from spilld.lease import FairLock, ThreadLockLease

# The engine's lock is held until the callback is registered: no spill can settle before, so the callback runs on
# the loop thread (a spill settled first would run it here, and the test would prove nothing).
lock = FairLock()
lock.acquire()
tier = EmbeddedTier({str(tmp_path)!r}, model_identity(None, model_id="exit-close"), lease=ThreadLockLease(lock))
done = threading.Event()
futs = [
    tier.spill(list(range(i, i + 2048)), [fill(C.KVCache(), 2048) for _ in range(4)], droppable=False)
    for i in range(6)
]
on_loop = []
def callback(_):
    on_loop.append(threading.current_thread() is not threading.main_thread())
    tier.close(60)
    done.set()
futs[0].add_done_callback(callback)
assert not futs[0].done()
lock.release()
assert done.wait(60) and on_loop == [True], on_loop
"""
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    r = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    stored = [f for _, _, fs in os.walk(tmp_path) for f in fs if f.endswith(".spilld")]
    assert len(stored) == 6, (stored, r.stderr[-2000:])


def test_a_close_after_one_begun_on_the_loop_thread_keeps_to_its_own_timeout(tmp_path: Any) -> None:
    """Review of the fix above: a close from another thread waited for the one begun on the loop thread without a
    bound, and when that thread held the engine's lock (which the first close's drain waited for) neither ended."""
    import threading

    from mlx_lm.models import cache as C

    from spilld.lease import FairLock, ThreadLockLease
    from tests.caches import fill

    lock = FairLock()
    tier = EmbeddedTier(str(tmp_path), model_identity(None, model_id="join"), lease=ThreadLockLease(lock))
    go, held = threading.Event(), threading.Event()

    def callback(_: object) -> None:  # on the loop thread: a close begun there, with no timeout
        go.set()
        held.wait(30)
        tier.close()

    with lock:  # the engine in a step: nothing of the first spill runs before its callback is attached
        first = tier.spill(list(range(64)), [fill(C.KVCache(), 64) for _ in range(2)], droppable=False)
        first.add_done_callback(callback)
        tier.spill(list(range(100, 164)), [fill(C.KVCache(), 64) for _ in range(2)], droppable=False)
    assert go.wait(30)
    lock.acquire()  # the engine's next step; it then closes the tier with a bound
    held.set()
    took: list[float] = []

    def closer() -> None:
        t0 = time.monotonic()
        tier.close(2)
        took.append(time.monotonic() - t0)

    t = threading.Thread(target=closer, daemon=True)
    t.start()
    t.join(20)
    lock.release()  # the engine's step ends: the first close can finish
    assert took and took[0] < 10, took
    tier._lt._thread.join(30)


def test_the_quiet_time_after_timeouts_doubles_up_to_max_quiet_s(monkeypatch: pytest.MonkeyPatch) -> None:
    """docs/design.md: each timeout in a row doubles the time lookups are skipped, up to ``MAX_QUIET_S``; a load
    that answers in time starts again from ``RECONNECT_INTERVAL_S`` (found in review: the cap was untested)."""
    from spilld import errors
    from spilld.integrations import tier as tier_module

    now = [1000.0]
    monkeypatch.setattr(tier_module.time, "monotonic", lambda: now[0])
    backoff, asked = tier_module.Backoff(), [0]

    def hung() -> None:
        asked[0] += 1
        raise errors.Timeout("no answer")

    quiet = []
    for _ in range(10):
        assert backoff.load(hung, [1, 2, 3]) is None
        start = now[0]
        while backoff.load(hung, [1, 2, 3]) is None and asked[0] == len(quiet) + 1:  # skipped: not asked
            now[0] += 1.0
            if now[0] - start > 2 * tier_module.MAX_QUIET_S:
                break
        quiet.append(now[0] - start)
    want = [min(tier_module.RECONNECT_INTERVAL_S * 2**i, tier_module.MAX_QUIET_S) for i in range(10)]
    assert quiet == want, quiet
    now[0] += tier_module.MAX_QUIET_S
    assert backoff.load(lambda: None, [1, 2, 3]) is None and backoff._quiet_s == tier_module.RECONNECT_INTERVAL_S


def test_a_draft_models_weights_are_part_of_the_identity(tiny: tuple[Any, Any]) -> None:
    """Found in review: with --draft-model an entry holds the draft's caches beside the main model's, but only the
    main model was fingerprinted (the draft's path was a label in model_id): a draft updated in place under the same
    path was restored the old draft's rows, and the request crashed on their shapes. The draft's weights count."""
    import types

    import mlx.core as mx
    from mlx_lm.models import llama

    from spilld.integrations.mlx_lm import ServerTiers

    model, tok = tiny

    def draft(seed: int) -> Any:
        mx.random.seed(seed)
        args = llama.ModelArgs(
            model_type="llama", hidden_size=32, num_hidden_layers=1, intermediate_size=64, num_attention_heads=2,
            rms_norm_eps=1e-5, vocab_size=model.args.vocab_size, num_key_value_heads=2,
        )  # fmt: skip
        m = llama.Model(args)
        mx.eval(m.parameters())
        return m

    def identity(draft_model: Any) -> Any:
        cli = types.SimpleNamespace(kv_bits=None, kv_group_size=64, quantized_kv_start=0)
        p = types.SimpleNamespace(model=model, tokenizer=tok, cli_args=cli, model_key=("m", None, "d"))
        p.draft_model = draft_model
        return ServerTiers(p, socket=None, folder=None).identity(("m", None, "d"))

    alone, one, other = identity(None), identity(draft(1)), identity(draft(2))
    assert len({alone.config_fingerprint, one.config_fingerprint, other.config_fingerprint}) == 3
    assert identity(draft(1)).config_fingerprint == one.config_fingerprint  # the same draft: the same identity


def test_the_embedded_stores_cap_durability_and_queue_cap_are_options(tmp_path: Any) -> None:
    """Found in review: no option set the embedded store's disk cap, durability or queue cap (the daemon's --disk-cap,
    --durability, --cap): a --spilld-dir folder was always fsynced, capped at the default disk cap, its queue at
    2 GiB. They reach the Spiller now, parsed as the daemon parses them."""
    from spilld.integrations.mlx_lm import ServerTiers, _parser, tier_options

    argv = ["--spilld-dir", str(tmp_path), "--spilld-cap", "64MiB", "--spilld-disk-cap", "1.5GiB"]
    opts, rest = _parser().parse_known_args([*argv, "--spilld-durability", "none", "--model", "x"])
    assert rest == ["--model", "x"]
    tiers = ServerTiers(None, socket=None, folder=opts.spilld_dir, **tier_options(opts))
    tiers.open_ahead()
    tiers.wait_opened(30)
    assert tiers._ahead is not None
    spiller = tiers._ahead.result().spiller
    try:
        assert spiller.queue.cap_bytes == 64 << 20 and spiller.store.disk_cap == 3 << 29
        assert spiller.store.durability is fileio.Durability.NONE
    finally:
        tiers.close(10)
    # given nothing, the Spiller's own defaults; through a daemon, only the queue's cap (the client's queue)
    assert tier_options(_parser().parse_known_args(["--spilld-dir", str(tmp_path)])[0]) == {}
    assert tier_options(_parser().parse_known_args(["--spilld-cap", "2G"])[0]) == {"queue_cap": 2 << 30}


def test_the_embedded_stores_block_size_write_budget_and_gate_are_options(tmp_path: Any) -> None:
    """Found in review: the embedded tier took no block size, write budget or write gate (the daemon's
    --block-tokens, --write-budget, --admit-after), so its disk wear could not be bounded as a daemon's can. They
    reach the Spiller's store now, parsed and checked as the daemon's, and its status says them as the daemon's."""
    from spilld.integrations.mlx_lm import ServerTiers, _parser, tier_options

    argv = ["--spilld-dir", str(tmp_path), "--spilld-block-tokens", "32", "--spilld-write-budget", "20GiB"]
    opts, rest = _parser().parse_known_args([*argv, "--spilld-admit-after", "2", "--model", "x"])
    assert rest == ["--model", "x"]
    assert tier_options(opts) == {"block_tokens": 32, "write_budget": 20 << 30, "admit_after": 2}
    tiers = ServerTiers(None, socket=None, folder=opts.spilld_dir, **tier_options(opts))
    tiers.open_ahead()
    tiers.wait_opened(30)
    assert tiers._ahead is not None
    tier = tiers._ahead.result()
    try:
        store = tier.spiller.store
        assert store.block_tokens == 32 and store.write_budget == 20 << 30
        assert store.admission is not None and (store.admission.after, store.admission.size) == (2, 32)
        st = tier.stats()["store"]
        assert (st["write_budget"], st["admit_after"], st["dropped_budget"], st["dropped_admit"]) == (20 << 30, 2, 0, 0)
    finally:
        tiers.close(10)
    # 0 blocks (whole files) is a value given, not left out
    zero = _parser().parse_known_args(["--spilld-dir", str(tmp_path), "--spilld-block-tokens", "0"])[0]
    assert tier_options(zero) == {"block_tokens": 0}


def _prom(path: Any) -> dict[str, float]:
    """A metrics file's samples, each named as PromQL writes it: ``name`` or ``name{label="value"}``."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(_read(path)):
        for s in fam.samples:
            labels = ",".join(f'{k}="{v}"' for k, v in sorted(s.labels.items()))
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


# the daemon's own metrics, which an embedded tier has nothing for (a 0 there would be made up)
DAEMON_ONLY = ("spilld_info", "spilld_uptime_seconds", "spilld_clients", "spilld_client_errors_total",
               "spilld_queue_cap_bytes", "spilld_lookups_total")  # fmt: skip


def _opened_tiers(folder: str, **kwargs: Any) -> Any:
    from spilld.integrations.mlx_lm import ServerTiers

    tiers = ServerTiers(None, socket=None, folder=folder, **kwargs)
    tiers.open_ahead()
    tiers.wait_opened(30)
    return tiers


def _one_round(path: str, tiers: Any) -> dict[str, float]:
    """One write of the integration's metrics file (its stop already set), read back."""
    import threading

    from spilld.integrations.mlx_lm import _write_counters_every

    stop = threading.Event()
    stop.set()
    _write_counters_every(path, ColdTierPromptCache(tier_for=tiers), stop, tiers)
    return _prom(path)


def test_the_embedded_metrics_file_holds_the_stores_figures_under_the_daemons_names(tmp_path: Any) -> None:
    """Found in review: with --spilld-dir no daemon's metrics show the store, and --spilld-metrics-file held the
    integration's counters alone: nothing of the disk. It holds the store's figures now, named as the daemon's (one
    dashboard reads both), and none of the daemon's own (no made-up 0 for its clients, uptime or queue cap); the
    same after the tier is closed (the exit's last write)."""
    from mlx_lm.models import cache as C

    from tests.caches import fill
    from tests.promtext import parse

    folder, prom = str(tmp_path / "store"), str(tmp_path / "tier.prom")
    first = EmbeddedTier(folder, model_identity(None, model_id="metrics"))
    try:
        assert first.spill(list(range(8)), [fill(C.KVCache(), 8)], droppable=False).result(30).stored
    finally:
        first.close(30)
    tiers = _opened_tiers(folder, disk_cap=1 << 30, write_budget=5 << 30)
    try:
        got = _one_round(prom, tiers)
        st = tiers._last_embedded.stats()["store"]
    finally:
        tiers.close(10)
    assert st["entries"] == 1 and got["spilld_disk_entries"] == 1 and got["spilld_disk_bytes"] == st["bytes"] > 0
    assert got["spilld_disk_cap_bytes"] == 1 << 30 and got["spilld_write_budget_bytes"] == 5 << 30
    assert got["spilld_blocks"] == st["blocks"] and got['spilld_queue_outcomes_total{outcome="stored"}'] == 0
    assert got["spilld_mlx_lm_spills_total"] == 0  # the integration's own counters are there still
    assert not {name for name in got if name.startswith(DAEMON_ONLY)}, got
    parse(_read(prom))  # the text format's every rule (one family each, types, HELP), as a strict scraper reads it
    assert _one_round(prom, tiers)["spilld_disk_entries"] == 1  # closed: read where it is, nothing changes it


def test_a_busy_embedded_tier_leaves_the_store_out_of_that_round_only(tmp_path: Any, monkeypatch: Any) -> None:
    """The store's figures are read on the tier's loop (read beside it, a map may change size as it is copied); a
    loop busy past ``STATUS_WAIT_S`` is not waited for: that round has the integration's counters alone."""
    import threading

    from spilld.integrations import mlx_lm as integration

    monkeypatch.setattr(integration, "STATUS_WAIT_S", 0.2)
    prom = str(tmp_path / "tier.prom")
    tiers = _opened_tiers(str(tmp_path / "store"))
    release = threading.Event()
    try:
        tiers._last_embedded._lt.loop.call_soon_threadsafe(release.wait, 20)  # the loop held, as by a long step
        t0 = time.monotonic()
        got = _one_round(prom, tiers)
        took = time.monotonic() - t0
        release.set()
        assert took < 5 and "spilld_mlx_lm_restores_total" in got and "spilld_disk_entries" not in got, (took, got)
        monkeypatch.setattr(integration, "STATUS_WAIT_S", 30.0)  # (a loaded machine: only the answer matters here)
        assert _one_round(prom, tiers)["spilld_disk_entries"] == 0  # the loop free again: the store's figures
    finally:
        release.set()
        tiers.close(10)


def test_through_a_daemon_the_metrics_file_holds_the_integrations_counters_alone(tmp_path: Any) -> None:
    """Through a daemon its own metrics file shows its store: the integration's holds none of it, though its tier
    could ask the daemon's status."""
    from spilld.integrations.mlx_lm import ServerTiers

    class Asked:
        def stats(self) -> dict[str, Any]:
            return {"queue": {"pending_items": 0, "pending_bytes": 0}, "store": {"entries": 3, "bytes": 1, "disk_cap": 1,
                    "hits": 0, "misses": {}}}  # fmt: skip

    tiers = ServerTiers(None, socket=str(tmp_path / "d.sock"), folder=None)
    tiers.tiers[("m", None, None)] = Asked()  # type: ignore[assignment]
    got = _one_round(str(tmp_path / "tier.prom"), tiers)
    assert "spilld_mlx_lm_spills_total" in got and not [n for n in got if not n.startswith("spilld_mlx_lm_")], got


@pytest.mark.parametrize(
    "args",
    [["--spilld-block-tokens", "32"], ["--spilld-write-budget", "1G"], ["--spilld-admit-after", "2"]],
)
def test_the_embedded_stores_wear_options_without_spilld_dir_are_refused(
    capsys: pytest.CaptureFixture[str], args: list[str]
) -> None:
    """As --spilld-disk-cap: through a daemon its own --block-tokens, --write-budget and --admit-after apply, so
    given without --spilld-dir these are refused (exit 2, one line naming the daemon's option), never ignored.
    (In process: ``tier_options`` refuses them; the subprocess test below runs ``main``.)"""
    from spilld.integrations.mlx_lm import _parser, tier_options

    opts = _parser().parse_known_args([*args, "--model", "x"])[0]
    with pytest.raises(SystemExit) as exc:
        tier_options(opts)
    assert exc.value.code == 2
    theirs = args[0].replace("--spilld-", "--")
    assert capsys.readouterr().err == (
        f"spilld.integrations.mlx_lm: {args[0]} without --spilld-dir: the daemon's folder is set by its own options "
        f"(spilld {theirs}); give --spilld-dir, or leave them out\n"
    )


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["--spilld-disk-cap", "4XB"], "argument --spilld-disk-cap: not a size: '4XB'"),
        (["--spilld-cap", "0"], "argument --spilld-cap: '0': a size must be at least 1 byte"),
        (["--spilld-durability", "sometimes"], "argument --spilld-durability: invalid choice: 'sometimes'"),
        (["--spilld-write-budget", "0"], "argument --spilld-write-budget: '0': a size must be at least 1 byte"),
        (["--spilld-block-tokens", "3"], "argument --spilld-block-tokens: block tokens must be 0 (no blocks) or"),
        (["--spilld-block-tokens", "x"], "argument --spilld-block-tokens: invalid int value: 'x'"),
        (["--spilld-admit-after", str(MAX_ADMIT_AFTER + 1)], "argument --spilld-admit-after: admit after must be"),
        (
            ["--spilld-admit-after", "-1"],
            f"argument --spilld-admit-after: admit after must be from 0 (off) to {MAX_ADMIT_AFTER}",
        ),
    ],
)
def test_bad_embedded_store_options_are_refused_with_exit_2(
    tmp_path: Any, capsys: pytest.CaptureFixture[str], args: list[str], said: str
) -> None:
    """A bad size or durability is a usage error (exit 2), as the daemon's: parsed by the daemon's own functions, and
    said in one line as the daemon says it (found in review: argparse's usage block came first).
    (In process, the integration's parser only: ``main`` ends its process once mlx-lm's server took its turn.)"""
    from spilld.integrations.mlx_lm import _parser

    with pytest.raises(SystemExit) as exc:
        _parser().parse_known_args(["--spilld-dir", str(tmp_path), *args, "--model", "x"])
    assert exc.value.code == 2
    prog, err = "python -m spilld.integrations.mlx_lm", capsys.readouterr().err
    assert err.startswith(f"{prog}: {said}") and err.endswith(f" (see `{prog} --help`)\n"), err
    assert err.count("\n") == 1 and "usage:" not in err, err


def test_the_folders_own_settings_without_spilld_dir_are_refused(tmp_path: Any) -> None:
    """--spilld-disk-cap and --spilld-durability set the embedded folder; a daemon's folder is set by the daemon's
    options, so without --spilld-dir they are refused at start (exit 2, one line) rather than ignored."""
    cmd = [sys.executable, "-m", "spilld.integrations.mlx_lm", "--model", "x", "--host", "256.0.0.0"]
    r = subprocess.run(
        [*cmd, "--spilld-durability", "none", "--spilld-disk-cap", "1G"], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2 and r.stderr.strip() == (
        "spilld.integrations.mlx_lm: --spilld-disk-cap, --spilld-durability without --spilld-dir: the daemon's "
        "folder is set by its own options (spilld --disk-cap, --durability); give --spilld-dir, or leave them out"
    ), (r.returncode, r.stderr[-2000:])


def test_an_entry_evicted_while_the_embedded_tier_opens_is_spilled_once_it_is_open(
    tiny: tuple[Any, Any], make_tier: Callable[..., EmbeddedTier]
) -> None:
    """Found in review (the last closing note's 'embedded entries evicted before the tier opened are lost'): while
    the folder was still being scanned, an entry the LRU evicted was refused by the opening tier and let go, the last
    copy; only those still in memory were spilled once the tier was ready. Now it is held (within LAST_COPIES_HELD)
    and spilled, not droppable, at the first call that finds the tier open."""
    from spilld.integrations.mlx_lm import OPENING

    model, _ = tiny
    tier = make_tier()
    ready: list[Any] = []
    lru = ColdTierPromptCache(max_size=1, tier_for=lambda key: ready[0] if ready else OPENING)
    first, second = [7, *range(100, 120)], [8, *range(200, 220)]
    lru.insert_cache("m", first, _prefilled(model, first))
    lru.insert_cache("m", second, _prefilled(model, second))  # evicts `first` while the tier opens
    ready.append(tier)
    lru.fetch_nearest_cache("m", [9, 9])  # the first call that finds the tier open spills the held entry
    assert lru.stats["evictions_spilled"] == 1
    lru.spill_unstored(30)  # `second`, whose write-behind the opening tier refused
    tier.close(30)
    assert lru.unstored_at_exit() == (2, 0)
    assert tier.spiller.store.count == 2
