"""Crash: SIGKILL the daemon at random moments under load; every acknowledged entry survives intact.

Bounded in CI (50 kills); SPILLD_LONG=1 runs 1,000.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
import sys
from typing import Any

import pytest
from mlx_lm.models import cache as C

import spilld
import spilld.loader
from spilld import fileio
from spilld.client import AsyncClient
from tests.caches import fill, live, same
from tests.conftest import LONG
from tests.daemons import Daemon, cleanup, new_root

KILLS = 1000 if LONG else 50
AFTER_ACK = 0.75  # the share of kills timed from the cycle's first acknowledged entry
ACK_WAIT_S = 60.0  # a daemon that stores nothing for this long under load is broken
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IDENT = spilld.Identity("crash")


def item(n: int) -> tuple[list[int], list[Any]]:
    """Deterministic content per item number; the first token makes every item its own prompt."""
    tokens = [100_000 + n, *range(511)]
    return tokens, [fill(C.KVCache(), 512, heads=4, dim=64, seed=n) for _ in range(2)]  # 2 x 512 KiB


def stored(f: asyncio.Future[Any]) -> bool:
    return f.done() and not f.cancelled() and f.exception() is None and bool(f.result().stored)


async def load_cycle(d: Daemon, first: int, rng: random.Random) -> list[int]:
    """Spill items until killed at a random moment; return the item numbers acknowledged as stored."""
    acked: list[int] = []
    client = await AsyncClient.open(d.socket, identity=IDENT, shm=rng.random() < 0.5)
    n = first
    futs: dict[int, Any] = {}
    loop = asyncio.get_running_loop()
    delay = rng.uniform(0.0, 0.4)
    # most kills land a random moment after the first acknowledgment (so a slow machine still kills under load),
    # the others a random moment after the connect, often before anything was stored
    since = None if rng.random() < AFTER_ACK else loop.time()
    give_up = loop.time() + ACK_WAIT_S
    while since is None or loop.time() < since + delay:
        assert loop.time() < give_up, "the daemon acknowledged nothing"
        tokens, caches = item(n)
        futs[n] = client.spill(tokens, caches, droppable=False)
        n += 1
        await asyncio.sleep(rng.uniform(0, 0.02))
        if since is None and any(stored(f) for f in futs.values()):
            since = loop.time()
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
            client = await AsyncClient.open(d.socket, identity=IDENT)
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
        assert len(acked) >= KILLS // 2  # the load really ran between kills (3 in 4 cycles kill after an ack)
        print(f"{KILLS} kills: {len(acked)} acknowledged entries, all loaded exactly")
        for f in (os.path.join(p, n) for p, _, fs in os.walk(d.dir) for n in fs if n.endswith(".spilld")):
            spilld.loader.verify_file(f)
    finally:
        d.kill()
        cleanup(d.root)


# (syscall, which call of it, kill before or after it): every step of a publish, from the temp file's creation to
# the folder's fsync. The sequence is open_new, fallocate, pwritev..., fsync (file), close, rename, open_dir, fsync
# (folder), close.
CRASH_POINTS = [
    ("open_new", 1, "before"),
    ("fallocate", 1, "after"),  # an empty temp file of the full size
    ("pwritev", 1, "after"),  # some tensors written, not the header
    ("fsync", 1, "before"),  # every byte written, none synced
    ("fsync", 1, "after"),  # the temp file complete and durable, not renamed
    ("rename", 1, "after"),  # published, the folder not synced
    ("fsync", 2, "after"),  # the folder synced: the save's last syscall
]


def crashing_save(path: str, method: str, nth: int, when: str) -> None:
    """Run in a child process: save item 1 over ``path`` and SIGKILL this process at the chosen syscall."""

    class Crashing(fileio.FileOps):
        calls = 0

        def __getattribute__(self, name: str) -> Any:
            real = super().__getattribute__(name)
            if name != method:
                return real

            def call(*args: Any) -> Any:
                Crashing.calls += 1
                if Crashing.calls == nth and when == "before":
                    os.kill(os.getpid(), signal.SIGKILL)
                out = real(*args)
                if Crashing.calls == nth and when == "after":
                    os.kill(os.getpid(), signal.SIGKILL)
                return out

            return call

    tokens, caches = item(1)
    spilld.save(path, tokens, caches, identity=IDENT, ops=Crashing(), direct=False)
    raise SystemExit(3)  # the chosen syscall never came: the test's list of points is wrong


@pytest.mark.parametrize("method,nth,when", CRASH_POINTS, ids=[f"{w}-{m}-{n}" for m, n, w in CRASH_POINTS])
def test_a_kill_at_each_syscall_of_a_save_leaves_the_old_file_or_the_new(
    tmp_path: Any, method: str, nth: int, when: str
) -> None:
    """A real crash (SIGKILL: no cleanup, no finally) at each step of a save over an existing entry, then a scan."""
    from spilld.store import Store

    root = str(tmp_path / "store")
    path = Store(root).new_path(IDENT, "")
    os.makedirs(os.path.dirname(path))
    spilld.save(path, *item(0), identity=IDENT)  # the old entry, as a daemon published it
    code = f"from tests.test_crash import crashing_save; crashing_save({path!r}, {method!r}, {nth}, {when!r})"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    child = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert child.returncode == -signal.SIGKILL, child.stderr
    published = (method, when) == ("rename", "after") or (method, nth) == ("fsync", 2)
    temps = [f for _, _, fs in os.walk(root) for f in fs if fileio.is_temp_name(f)]
    assert len(temps) == (0 if published or (method, when) == ("open_new", "before") else 1)  # the kill left it

    store = Store(root)
    store.scan()  # what a restarted daemon does first
    assert [f for _, _, fs in os.walk(root) for f in fs if fileio.is_temp_name(f)] == []  # every orphan reaped
    assert store.counters.reaped_temp == len(temps) and store.counters.quarantined == 0
    assert [e.path for e in store.entries] == [path]  # one entry under the name, never a torn one
    want_tokens, want_caches = item(1 if published else 0)
    got = spilld.load(path)
    assert got.tokens == want_tokens
    assert all(same(live(a), live(b)) for a, b in zip(got.caches, want_caches, strict=True))
