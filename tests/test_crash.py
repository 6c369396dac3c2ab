"""Crash: SIGKILL the daemon at random moments under load; every acknowledged entry survives intact.

Bounded in CI (50 kills); SPILLD_LONG=1 runs 1,000.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
from typing import Any

import pytest
from mlx_lm.models import cache as C

import spilld
from spilld import fileio
from spilld.client import AsyncClient
from tests.caches import fill, live, same
from tests.conftest import LONG
from tests.daemons import Daemon, cleanup, new_root

KILLS = 1000 if LONG else 50
IDENT = spilld.Identity("crash")


def item(n: int) -> tuple[list[int], list[Any]]:
    """Deterministic content per item number; the first token makes every item its own prompt."""
    tokens = [100_000 + n, *range(511)]
    return tokens, [fill(C.KVCache(), 512, heads=4, dim=64, seed=n) for _ in range(2)]  # 2 x 512 KiB


async def load_cycle(d: Daemon, first: int, rng: random.Random) -> list[int]:
    """Spill items until killed at a random moment; return the item numbers acknowledged as stored."""
    acked: list[int] = []
    client = await AsyncClient.connect(d.socket, identity=IDENT, shm=rng.random() < 0.5)
    n = first
    futs: dict[int, Any] = {}
    kill_at = asyncio.get_running_loop().time() + rng.uniform(0.0, 0.4)
    while asyncio.get_running_loop().time() < kill_at:
        tokens, caches = item(n)
        futs[n] = client.spill(tokens, caches, droppable=False)
        n += 1
        await asyncio.sleep(rng.uniform(0, 0.02))
    assert d.proc is not None
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()
    for k, f in futs.items():
        try:
            res = await asyncio.wait_for(f, 10)
        except (TimeoutError, spilld.SpillError):
            continue
        if res.stored:
            acked.append(k)
    await client.close(timeout=1)
    return acked


def test_sigkill_under_load_never_loses_or_corrupts_an_acknowledged_entry() -> None:
    rng = random.Random(1234)
    d = Daemon(new_root(), ["--cap", "64MiB"])
    acked: list[int] = []
    try:
        next_item = 0
        for _ in range(KILLS):
            d.start()
            got = asyncio.run(load_cycle(d, next_item, rng))
            acked += got
            next_item += 1000
        d.start()
        temps = [f for _, _, fs in os.walk(d.dir) for f in fs if fileio.is_temp_name(f)]
        assert temps == []  # the scan at start reaped every orphan

        async def verify() -> int:
            client = await AsyncClient.connect(d.socket, identity=IDENT)
            checked = 0
            for n in acked:
                tokens, caches = item(n)
                loaded = await client.load([*tokens, 7])
                assert loaded is not None, f"acknowledged item {n} is gone"
                assert all(same(live(a), live(b)) for a, b in zip(loaded.caches, caches, strict=True))
                checked += 1
            st = await client.status()
            assert st["store"]["quarantined"] == 0  # no torn file was ever published
            await client.close()
            return checked

        assert asyncio.run(verify()) == len(acked)
        assert len(acked) > KILLS // 5  # the load really ran between kills
        print(f"{KILLS} kills: {len(acked)} acknowledged entries, all loaded exactly")
        for f in (os.path.join(p, n) for p, _, fs in os.walk(d.dir) for n in fs if n.endswith(".spilld")):
            spilld.verify_file(f)
    finally:
        d.kill()
        cleanup(d.root)


@pytest.mark.parametrize("point", ["open_new", "fallocate", "pwritev", "fsync", "rename", "open_dir"])
def test_a_crash_at_each_syscall_of_the_save_path_leaves_old_or_new(tmp_path: Any, point: str) -> None:
    """Whitebox: die (an exception no one catches) right before each syscall; then scan."""

    class Died(BaseException):
        pass

    class Crashing(fileio.FileOps):
        def __getattribute__(self, name: str) -> Any:
            if name == point:
                raise Died(name)
            return super().__getattribute__(name)

    root = tmp_path / "store"
    folder = root / "fp" / "base"
    folder.mkdir(parents=True)
    tokens, caches = item(1)
    with pytest.raises(Died):
        spilld.save(folder / "x.spilld", tokens, caches, ops=Crashing(), direct=False)
    names = os.listdir(folder)
    assert "x.spilld" not in names or point == "open_dir"  # published only after the rename
    if "x.spilld" in names:
        assert [s.hash for s in spilld.verify_file(folder / "x.spilld").slots()]  # and whole
