"""The daemon's writes keep out of a granting engine's steps: the lease is held for the whole of each write step.

A real engine thread in this process decodes under its lock and records each step's span; the real daemon (a
subprocess, debug log) records the span of each of its write steps. Clocks: both are CLOCK_MONOTONIC on one host.
With the grant there is no overlap at all; without it (the negative control) some daemon steps run during an
engine step.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models import cache as C

import spilld
from spilld import mlxthreads
from spilld.client import Client
from tests.caches import fill
from tests.daemons import Daemon, cleanup, new_root, serving

LAYERS = 24  # 48 tensors per spill: 48 daemon write steps
SPILLS = 3
STEP_S = 0.004  # an engine step: the lock is held this long, then let go for a moment


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    with serving("--cap", "256MiB", "--log-level", "debug", "--block-tokens", "0") as d:
        yield d


def daemon_steps(d: Daemon, name: str) -> list[tuple[float, float]]:
    """The spans of the daemon's write steps for the client called ``name``, from its debug log."""
    spans = []
    pat = re.compile(r"write step for (\S+): ([0-9.]+)-([0-9.]+)")
    for line in d.read_log().splitlines():
        try:
            msg = str(json.loads(line).get("msg", ""))
        except ValueError:
            continue
        m = pat.search(msg)
        if m and m.group(1) == name:
            spans.append((float(m.group(2)), float(m.group(3))))
    return spans


def run(d: Daemon, grant: bool) -> tuple[int, int]:
    """Spill while an engine thread decodes; the daemon steps that overlapped an engine step, and all of them."""
    name = f"engine-{'grant' if grant else 'plain'}"
    lock = threading.Lock()
    caches = [fill(C.KVCache(), 256, heads=8, dim=64, seed=i) for i in range(LAYERS)]
    client = Client(
        d.socket, identity=spilld.Identity(name), name=name, lease=spilld.ThreadLockLease(lock), grant_lease=grant
    )
    engine_spans: list[tuple[float, float]] = []
    stop = threading.Event()

    def engine() -> None:
        x = mx.random.normal((256, 256))
        while not stop.is_set():
            with lock:
                t0 = time.monotonic()
                while time.monotonic() - t0 < STEP_S:
                    mx.eval(x @ x)
                engine_spans.append((t0, time.monotonic()))
            time.sleep(0.0003)  # the gap between two decode steps

    th = mlxthreads.start_thread(engine, "engine")  # an engine thread frees its mlx streams as it ends
    try:
        futs = [client.spill(list(range(256 + i)), caches) for i in range(SPILLS)]
        assert all(f.result(timeout=120).stored for f in futs)
        assert client.drain(timeout=60).done
    finally:
        stop.set()
        th.join()
        client.close()
    time.sleep(0.2)  # the log is flushed line by line
    steps = daemon_steps(d, name)
    overlaps = sum(1 for a0, a1 in steps if any(a0 < b1 and b0 < a1 for b0, b1 in engine_spans))
    return overlaps, len(steps)


def test_the_daemon_never_writes_during_a_granting_engines_step(daemon: Daemon) -> None:
    overlaps, steps = run(daemon, grant=True)
    assert steps == SPILLS * 2 * LAYERS + SPILLS  # every tensor step and every publish step was recorded
    assert overlaps == 0


def test_without_the_grant_the_daemon_writes_during_engine_steps(daemon: Daemon) -> None:
    overlaps, steps = run(daemon, grant=False)
    # with no grant the daemon's own bytes are written in batches: a lease call per batch, not per step
    assert SPILLS <= steps < SPILLS * 2 * LAYERS + SPILLS
    assert overlaps > 0  # the negative control: the same measurement does see overlaps


class GrantsHeldBack:
    """An engine lease (steps off the loop) that lets the first ``n`` turns through and holds back the rest."""

    def __init__(self, n: int) -> None:
        self.n, self.calls, self.open = n, 0, threading.Event()
        self.holds: list[float] = []

    async def __call__(self, fn: Any, /) -> Any:
        import asyncio

        self.calls += 1
        if self.calls > self.n:
            await asyncio.to_thread(self.open.wait)
        t0 = time.monotonic()
        try:
            return await asyncio.to_thread(fn)
        finally:
            self.holds.append(time.monotonic() - t0)


def test_no_grant_in_time_fails_the_write_and_a_late_grant_is_let_go_at_once() -> None:
    args = ["--cap", "256MiB", "--log-level", "debug", "--block-tokens", "0", "--request-timeout", "4"]
    daemon = Daemon(new_root(), args).start()
    caches = [fill(C.KVCache(), 16, seed=i) for i in range(2)]
    lease = GrantsHeldBack(4)  # the client's own 4 takes; the daemon's first ask is never answered in time
    client = Client(daemon.socket, identity=spilld.Identity("late"), name="late", lease=lease, grant_lease=True)
    try:
        t0 = time.monotonic()
        settled = client.spill(list(range(16)), caches).result(timeout=120)
        waited = time.monotonic() - t0
        assert settled.outcome.value == "failed" and settled.error is not None and settled.error.code == "timeout"
        assert 3.9 <= waited < 15  # --request-timeout 4: it waited that long, and did not write unheld
        assert daemon_steps(daemon, "late") == []
        lease.open.set()  # the engine grants, too late: the daemon lets it go at once
        deadline = time.monotonic() + 10
        while len(lease.holds) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(lease.holds) == 5 and lease.holds[-1] < 2  # at once: not after a request timeout (4 s)
        assert not [f for _, _, fs in os.walk(daemon.dir) for f in fs if f.endswith(".spilld")]
    finally:
        lease.open.set()  # a grant still waiting for the engine would hold the close
        client.close()
        daemon.kill()
        cleanup(daemon.root)


class NeverGrants:
    """An engine lease that takes its own turns (the client's reads of its caches) but never answers the daemon's
    asks for one (the client's grant is the call that holds the turn: ``AsyncClient._grant``'s ``hold``)."""

    def __init__(self) -> None:
        self.open = threading.Event()

    async def __call__(self, fn: Any, /) -> Any:
        import asyncio

        if getattr(fn, "__name__", "") == "hold":
            await asyncio.to_thread(self.open.wait)
        return await asyncio.to_thread(fn)


def test_an_engine_that_missed_a_grant_holds_the_daemons_writer_once_not_once_an_item() -> None:
    """Found in review: the daemon has one writer, and each item of a grantor that does not answer held it for a
    request timeout, so one stuck engine delayed every other client's writes by that much per item. After one missed
    grant its items fail at once; another client's write waits one timeout at most."""
    args = ["--cap", "256MiB", "--block-tokens", "0", "--request-timeout", "2"]
    daemon = Daemon(new_root(), args).start()
    lease = NeverGrants()
    stuck = Client(daemon.socket, identity=spilld.Identity("stuck"), name="stuck", lease=lease, grant_lease=True)
    other = Client(daemon.socket, identity=spilld.Identity("other"), name="other")
    try:
        items = [stuck.spill([i, *range(15)], [fill(C.KVCache(), 16, seed=i)]) for i in range(4)]
        time.sleep(0.3)  # all four committed: queued at the daemon ahead of the other client's
        t0 = time.monotonic()
        assert other.spill(list(range(100, 116)), [fill(C.KVCache(), 16, seed=9)]).result(timeout=60).stored
        waited = time.monotonic() - t0
        assert waited < 2 * 2, waited  # one missed grant (2 s), not one an item (8 s)
        outcomes = [f.result(timeout=60) for f in items]
        assert all(s.outcome.value == "failed" and s.error is not None and s.error.code == "timeout" for s in outcomes)
        st = other.status()
        assert st["store"]["store_errors"] == 0  # an engine's missed grant is no failed write of the disk's
    finally:
        lease.open.set()
        stuck.close()
        other.close()
        daemon.kill()
        cleanup(daemon.root)
