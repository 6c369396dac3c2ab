"""The lazily made background pool: threads that ask for it at once get one pool."""

from __future__ import annotations

import concurrent.futures
import threading
import time
from typing import Any

import pytest

from spilld import lease

RACERS = 8


def test_the_background_pool_is_made_once_under_racing_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    made: list[Any] = []
    real = concurrent.futures.ThreadPoolExecutor

    class SlowToMake(real):  # type: ignore[misc, valid-type]
        def __init__(self, *a: Any, **kw: Any) -> None:
            made.append(self)
            time.sleep(0.05)  # widens the gap between "is there a pool?" and "here it is"
            super().__init__(*a, **kw)

    start = threading.Barrier(RACERS)
    got: list[Any] = []

    def ask() -> None:
        start.wait()
        got.append(lease._background_pool())

    monkeypatch.setattr(lease, "_background", None)
    monkeypatch.setattr(lease.concurrent.futures, "ThreadPoolExecutor", SlowToMake)
    threads = [threading.Thread(target=ask) for _ in range(RACERS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for pool in made:
        pool.shutdown()
    assert len(made) == 1 and all(p is made[0] for p in got)


@pytest.mark.asyncio
async def test_a_granted_step_never_waits_behind_background_work() -> None:
    """Found in review: a step an engine granted its lease for ran on the background pool, behind the shared
    tier's block reads and checks, while the engine waited, held. It has threads of its own now."""
    import asyncio

    from spilld.daemon.connection import GrantorLease

    release = threading.Event()
    busy = [asyncio.ensure_future(lease.off_loop(lambda: release.wait(30), background=True)) for _ in range(4)]

    class Granting:  # the connection's side of a grant: granted at once
        id = 1

        def __init__(self) -> None:
            self.done: list[int] = []

        async def ask_lease(self, timeout: float) -> int:
            return 7

        def lease_done(self, grant: int) -> None:
            self.done.append(grant)

    conn = Granting()
    try:
        step = GrantorLease(conn, 5.0)(lambda: threading.current_thread().name)  # type: ignore[arg-type]
        name = await asyncio.wait_for(step, 2.0)
        assert name.startswith("spilld-held") and conn.done == [7]
    finally:
        release.set()
        await asyncio.gather(*busy)
