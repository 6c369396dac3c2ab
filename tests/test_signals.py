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
from tests.daemons import Daemon, cleanup, new_root


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    d = Daemon(new_root(), ["--cap", "64MiB", "--drain-deadline", "60"]).start()
    try:
        yield d
    finally:
        d.kill()
        cleanup(d.root)


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
