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
