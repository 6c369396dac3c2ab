"""Every thread spilld starts frees its mlx streams when it ends (mlx's contract; else the process aborts at exit)."""

from __future__ import annotations

import ast
import concurrent.futures
import pathlib
import subprocess
import sys
import textwrap
import threading
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models import cache as C

from spilld import lease, loader, mlxthreads
from spilld.loopthread import LoopThread
from spilld.saver import save

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _eval_and_report() -> bool:
    a = mx.random.normal((32, 32))
    mx.eval(a @ a)
    return mlxthreads.releases_at_thread_end()


@pytest.mark.asyncio
async def test_off_loop_work_frees_the_mlx_streams_of_any_pool_it_runs_on() -> None:
    assert await lease.off_loop(_eval_and_report)  # the loop's default executor: a pool spilld did not make


def test_spilld_pools_free_their_threads_mlx_streams() -> None:
    for pool in (lease._compute_pool(), lease._background_pool()):
        assert pool.submit(_eval_and_report).result()


def test_a_loop_thread_frees_its_mlx_streams() -> None:
    lt = LoopThread("spilld-test-loop")
    try:

        async def report() -> bool:
            return _eval_and_report()

        assert lt.run(report())
    finally:
        lt.stop()


def test_the_loaders_pool_frees_its_threads_mlx_streams(
    tmp_path: pathlib.Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    c = C.KVCache()
    c.update_and_fetch(mx.zeros((1, 8, 2048, 128)), mx.zeros((1, 8, 2048, 128)))  # 16 MiB: read by the pool
    path = tmp_path / "e.spilld"
    save(path, list(range(2048)), [c])
    seen: list[bool] = []
    real = mlxthreads.worker_pool

    def spy(n: int, name: str, initializer: Any = None) -> concurrent.futures.ThreadPoolExecutor:
        pool = real(n, name, initializer)
        seen.append(pool.submit(_eval_and_report).result())
        return pool

    monkeypatch.setattr(mlxthreads, "worker_pool", spy)
    assert loader.load(path, threads=2).caches[0].offset == 2048
    assert seen == [True]


def test_the_release_runs_on_the_ending_thread_and_leaves_the_callers_streams(monkeypatch: pytest.MonkeyPatch) -> None:
    released: list[int] = []
    monkeypatch.setattr(mlxthreads, "release_streams", lambda: released.append(threading.get_ident()))
    ran: list[int] = []

    def work() -> None:
        _eval_and_report()
        ran.append(threading.get_ident())

    mlxthreads.start_thread(work, "spilld-test").join()
    assert released == ran and len(ran) == 1
    assert not mlxthreads.releases_at_thread_end()  # the caller (main) thread's are mlx's to free at exit
    a = mx.ones((4,))
    mx.eval(a + 1)  # this thread's streams are still there


def test_a_thread_that_freed_its_streams_really_lost_them() -> None:
    """What the release does, seen from the thread itself: mlx refuses work on it afterwards."""
    got: list[str] = []

    def work() -> None:
        _eval_and_report()
        mlxthreads.release_streams()
        try:
            mx.eval(mx.ones((2,)) + 1)
        except RuntimeError as exc:
            got.append(str(exc))

    mlxthreads.start_thread(work, "spilld-test").join()
    assert len(got) == 1 and "Stream" in got[0]


def test_a_cut_load_made_on_a_thread_that_ends_is_usable_after_it(tmp_path: pathlib.Path) -> None:
    """A trim can leave lazy arrays bound to the loading thread's streams (a batch cache's offsets): the loader
    evaluates every array of what it returns."""
    c = C.BatchKVCache([0, 0])
    c.update_and_fetch(mx.ones((2, 2, 8, 16)), mx.ones((2, 2, 8, 16)))
    path = tmp_path / "b.spilld"
    save(path, list(range(8)), [c])
    got: list[Any] = []
    mlxthreads.start_thread(lambda: got.append(loader.load(path, upto=5, threads=1)), "spilld-test").join()
    assert got[0].caches[0].offset.tolist() == [5, 5]


def test_spilld_starts_no_thread_and_hands_no_work_to_a_pool_but_through_mlxthreads() -> None:
    """A ``Thread``, ``Timer`` or ``ThreadPoolExecutor`` made anywhere else in spilld/ (or a subclass of one), work
    given to ``run_in_executor`` without ``releasing``, or ``asyncio.to_thread`` would run on a thread that never frees
    its mlx streams."""
    found = []
    for path in sorted((ROOT / "spilld").rglob("*.py")):
        if path.name == "mlxthreads.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            where = f"{path.relative_to(ROOT)}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.ClassDef) and any(_name(b) in ("Thread", "Timer") for b in node.bases):
                found.append(f"{where}: class {node.name}")
            if not isinstance(node, ast.Call):
                continue
            name = _name(node.func)
            wrapped = len(node.args) == 2 and "releasing(" in ast.unparse(node.args[1])
            if name in ("Thread", "Timer", "ThreadPoolExecutor", "to_thread") or (
                name == "run_in_executor" and not wrapped
            ):
                found.append(f"{where}: {ast.unparse(node)[:80]}")
    assert found == []


def _name(f: ast.expr) -> str:
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else ""


# A process whose spilld threads (both pools, the loop's default executor, a daemon thread still running at exit)
# ran mlx work: which threads freed their streams, told from an atexit handler (the pools' threads have ended by then).
SCRIPT = textwrap.dedent(
    """
    import asyncio, atexit, os, threading, time
    import mlx.core as mx
    from spilld import lease, mlxthreads

    ran, released, real = set(), [], mlxthreads.release_streams
    MAIN = threading.get_ident()

    def record():
        released.append(threading.get_ident())
        if threading.get_ident() == MAIN:
            os.write(1, b"released on main\\n")
        real()

    mlxthreads.release_streams = record

    def work():
        a = mx.random.normal((64, 64))
        mx.eval(a @ a)
        ran.add(threading.get_ident())

    async def main():
        for _ in range(4):
            await lease.off_loop(work)
            await lease.off_loop(work, background=True)
            await lease.off_loop(work, compute=True)

    asyncio.run(main())
    left, worked = [], threading.Event()
    mlxthreads.start_thread(
        lambda: (work(), left.append(threading.get_ident()), worked.set(), time.sleep(3600)), "left-running", daemon=True
    )
    worked.wait(60)
    # idents are reused once a thread ends: the one left running may hold an ended pool thread's
    atexit.register(lambda: print("unreleased", len(ran - set(left) - set(released)), "main", MAIN in ran, flush=True))
    """
)


def test_a_process_whose_spilld_threads_ran_mlx_frees_every_ending_threads_streams_and_exits_cleanly() -> None:
    """Every thread that ran spilld's mlx work and ended freed its streams (the daemon thread still running is the
    one left); none was freed on the main thread, even the daemon thread's, which Python drops there at exit; and the
    process exits 0 (before the release: about half of a similar script's runs aborted at exit on Python 3.11)."""
    got = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )
    assert (got.returncode, got.stdout.strip()) == (0, "unreleased 0 main False"), (got.stdout, got.stderr[-2000:])


def test_release_is_a_no_op_without_mlx() -> None:
    script = "import sys; from spilld import mlxthreads; mlxthreads.release_streams(); print('mlx' in sys.modules)"
    got = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=True)
    assert got.stdout.strip() == "False"


def test_a_loop_thread_stops_in_bounded_time_with_a_default_executor_worker_stuck(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found in review: on Python 3.11, the default executor's shutdown, once its wait timed out, joined its thread
    on the loop without a bound, so a worker stuck on a lock (the engine's, held) or a hung disk held the loop
    thread, and ``stop`` (a client's close), for ever."""
    import asyncio
    import threading
    import time

    from spilld import loopthread

    monkeypatch.setattr(loopthread, "STOP_TASKS_TIMEOUT_S", 0.5)
    stuck, entered = threading.Event(), threading.Event()

    def blocked() -> None:
        entered.set()
        stuck.wait(60)

    lt = loopthread.LoopThread("stuck-executor")

    async def start() -> None:
        asyncio.get_running_loop().run_in_executor(None, blocked)  # the loop's default executor

    lt.run(start())
    assert entered.wait(10)
    stopped = threading.Event()
    stopper = threading.Thread(target=lambda: (lt.stop(), stopped.set()), daemon=True)
    t0 = time.monotonic()
    stopper.start()
    try:
        assert stopped.wait(20), "stop() still waits for the stuck worker"
        assert time.monotonic() - t0 < 10 and lt.loop.is_closed()
    finally:
        stuck.set()
