"""How the daemon stops: SIGHUP drains like SIGTERM; a second signal exits at once with a documented code."""

from __future__ import annotations

import asyncio
import json
import signal
from collections.abc import Iterator
from typing import Any

import pytest

import spilld
from spilld.client import AsyncClient
from spilld.daemon.server import SECOND_SIGNAL_EXIT
from tests.daemons import Daemon, cleanup, new_root, serving


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    with serving("--cap", "64MiB", "--drain-deadline", "60") as d:
        yield d


def log_lines(d: Daemon) -> list[dict[str, Any]]:
    return [json.loads(line) for line in d.read_log().splitlines() if line.startswith("{")]


def test_sighup_drains_and_exits_0(daemon: Daemon) -> None:
    assert daemon.stop(signal.SIGHUP) == 0
    assert any(r["msg"].startswith("SIGHUP: stopping") for r in log_lines(daemon)), daemon.read_log()


@pytest.mark.asyncio
async def test_a_second_signal_during_a_drain_exits_3(daemon: Daemon) -> None:
    from mlx_lm.models import cache as C

    from tests.caches import fill

    hold = asyncio.Event()

    async def lease(fn: Any) -> Any:  # an engine that never has a free moment: the daemon's write waits
        await hold.wait()
        return await asyncio.to_thread(fn)  # a grant is held off the loop until the daemon's step is done

    client = await AsyncClient.open(daemon.socket, identity=spilld.Identity("busy"), grant_lease=True, lease=lease)
    client.lease = spilld.NoLease()  # ship freely; only the daemon's write waits on the grantor
    client.spill(list(range(8)), [fill(C.KVCache(), 8)])
    await client.queue.drain()
    client.lease = lease
    assert daemon.proc is not None
    daemon.proc.send_signal(signal.SIGTERM)  # the drain starts and waits on the write
    await asyncio.sleep(1.0)
    assert daemon.proc.poll() is None
    daemon.proc.send_signal(signal.SIGTERM)
    code = await asyncio.get_running_loop().run_in_executor(None, lambda: daemon.proc.wait(30) if daemon.proc else 0)
    assert code == SECOND_SIGNAL_EXIT == 3
    last = log_lines(daemon)[-1]
    assert last["msg"] == "second signal: exiting now" and last["items_lost"] == 1, last
    hold.set()
    await client.close(timeout=1)


@pytest.mark.asyncio
async def test_a_stop_keeps_its_drain_deadline_while_a_write_waits_for_a_grant() -> None:
    """Found in review: with a write waiting for an engine's grant, a stop overran --drain-deadline by up to
    --request-timeout (the cancelled step waited out the grant's timeout), and asyncio's "Task exception was never
    retrieved" went into the JSON log as plain text."""
    import time

    from mlx_lm.models import cache as C

    from tests.caches import fill

    d = Daemon(new_root(), ["--cap", "64MiB", "--drain-deadline", "2", "--request-timeout", "30"]).start()
    hold = asyncio.Event()

    async def lease(fn: Any) -> Any:  # an engine that never has a free moment: the daemon's write waits
        await hold.wait()
        return await asyncio.to_thread(fn)

    try:
        client = await AsyncClient.open(d.socket, identity=spilld.Identity("busy"), grant_lease=True, lease=lease)
        client.lease = spilld.NoLease()
        client.spill(list(range(8)), [fill(C.KVCache(), 8)])
        await client.queue.drain()
        client.lease = lease
        await asyncio.sleep(0.5)
        assert d.proc is not None
        t0 = time.monotonic()
        d.proc.send_signal(signal.SIGTERM)
        code = await asyncio.get_running_loop().run_in_executor(None, lambda: d.proc.wait(60) if d.proc else 0)
        assert code == 3 and time.monotonic() - t0 < 2 + 4  # the deadline, not the grant's 30 s
        text = d.read_log()
        assert all(line.startswith("{") for line in text.splitlines() if line.strip()), text
        # the loss said at warning, with what was lost (found in review: one info line whose counts read 0)
        lines = [json.loads(line) for line in text.splitlines() if line.strip()]
        lost = [ln for ln in lines if ln.get("level") == "warning" and "work left" in ln.get("msg", "")]
        assert len(lost) == 1 and lost[0]["items_lost"] == 1 and lost[0]["bytes_lost"] > 0, text
        hold.set()
        await client.close(timeout=1)
    finally:
        d.kill()
        cleanup(d.root)


def test_asyncios_own_log_lines_are_json_lines_too(capfd: pytest.CaptureFixture[str]) -> None:
    """asyncio reports a task whose exception nobody retrieved on its own logger: in the daemon's format, never a
    block of plain text in a JSON log."""
    import logging

    from spilld.daemon.logs import setup_logging

    loggers = [logging.getLogger(name) for name in ("spilld", "asyncio")]
    before = [(lg.handlers[:], lg.propagate, lg.level) for lg in loggers]
    try:
        setup_logging("info", json_logs=True)
        logging.getLogger("asyncio").error("Task exception was never retrieved")
        err = capfd.readouterr().err.strip().splitlines()
        assert [json.loads(line)["logger"] for line in err] == ["asyncio"], err
    finally:  # this process's loggers as they were (other tests capture spilld's)
        for lg, (handlers, propagate, level) in zip(loggers, before, strict=True):
            lg.handlers[:], lg.propagate = handlers, propagate
            lg.setLevel(level)


@pytest.mark.parametrize("after_s", [0.0, 0.02, 0.05, 0.3])
def test_a_second_signal_with_nothing_left_exits_0(after_s: float) -> None:
    """Found in review: any second signal exited 3 ("work was left"), an idle daemon's too, as `timeout` sends one
    to the process and one to its group; and one that came as the loop closed killed the process (-15), which had
    logged its exit 0. Exit 3 is for work left; with none, the stop's own 0, whenever the second signal comes."""
    import time

    d = Daemon(new_root(), ["--cap", "64MiB"]).start()
    try:
        assert d.proc is not None
        d.proc.send_signal(signal.SIGTERM)
        time.sleep(after_s)
        if d.proc.poll() is None:
            d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(30) == 0, d.read_log()
    finally:
        d.kill()
        cleanup(d.root)


@pytest.mark.asyncio
async def test_a_drain_whose_daemon_goes_away_exits_3(daemon: Daemon) -> None:
    """Found in review: README says `spilld drain` exits 3 when the daemon stops answering during the drain, but a
    daemon that died mid-drain gave exit 4 ("cannot be reached"), as if there had been nothing to wait for."""
    from mlx_lm.models import cache as C

    from tests.caches import fill

    hold = asyncio.Event()

    async def lease(fn: Any) -> Any:  # an engine that never has a free moment: the daemon's write waits
        await hold.wait()
        return await asyncio.to_thread(fn)

    client = await AsyncClient.open(daemon.socket, identity=spilld.Identity("busy"), grant_lease=True, lease=lease)
    client.lease = spilld.NoLease()
    client.spill(list(range(8)), [fill(C.KVCache(), 8)])
    await client.queue.drain()
    client.lease = lease
    loop = asyncio.get_running_loop()
    drain = loop.run_in_executor(None, lambda: daemon.cli("drain", "--socket", daemon.socket, "--timeout", "60"))
    await asyncio.sleep(1.5)  # the drain waits on the held write
    assert daemon.proc is not None and not drain.done()
    daemon.proc.kill()
    r = await drain
    assert r.returncode == 3 and "went away during the drain" in r.stdout, (r.returncode, r.stdout, r.stderr)
    hold.set()
    await client.close(timeout=1)


@pytest.mark.asyncio
async def test_a_stop_signal_during_the_scan_ends_it_and_the_daemon_never_serves(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Any
) -> None:
    """Found in review: SIGTERM during a long start-up scan (5,001 entries) waited for the whole scan, unbounded by
    the drain deadline; then the daemon listened, said it served, and stopped. The scan ends at its next file now,
    its index not taken, and the daemon never listens. A real scan told to stop indexes nothing."""
    import os
    import threading
    import time

    from mlx_lm.models.cache import KVCache

    from spilld.daemon import Daemon as InProcess
    from spilld.store import Store
    from spilld.store import store as store_module
    from tests.caches import fill
    from tests.daemons import quiet_config

    real, entered, waited = store_module.scan_root, threading.Event(), []

    def slow(root: str, ops: Any, reap: bool, stopped: Any = bool, tally: Any = None) -> Any:  # a big store's scan
        entered.set()
        t0 = time.monotonic()
        while not stopped() and time.monotonic() - t0 < 20:
            time.sleep(0.01)
        waited.append(time.monotonic() - t0)
        return real(root, ops, reap, stopped, tally)

    root = new_root()
    try:
        cfg = quiet_config(root)
        async with spilld.Spiller(cfg.dir, identity=spilld.Identity("m")) as sp:
            assert (await sp.spill(list(range(8)), [fill(KVCache(), 8)])).stored
        assert Store(cfg.dir).scan(stopped=lambda: True) == 0  # told to stop at once: nothing indexed
        monkeypatch.setattr(store_module, "scan_root", slow)
        daemon = InProcess(cfg)
        serving = asyncio.ensure_future(daemon.serve())
        assert await asyncio.to_thread(entered.wait, 10)
        daemon._on_signal(signal.SIGTERM)
        assert await asyncio.wait_for(serving, 10) == 0
        assert waited[0] < 10 and daemon.store.count == 0 and not os.path.exists(cfg.socket)
        monkeypatch.setattr(store_module, "scan_root", real)
        assert Store(cfg.dir).scan() == 1  # the next start's scan finds the entry
    finally:
        cleanup(root)
