"""Every benchmark script runs end to end in its ``--smoke`` mode (tiny sizes, seconds) and exits 0.

The figures they print are not checked here (docs/benchmarks.md has the measured ones); what is checked is that
no benchmark path is broken: a crash, a spill that is not stored or a leaked descriptor exits non-zero.
"""

from __future__ import annotations

import glob
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = sorted(glob.glob(os.path.join(ROOT, "scripts", "bench", "*.py")))
# run in --smoke mode by the test that draws their plots, not a second time by test_benchmark_smoke_mode
SMOKED_WITH_PLOT = {"daemon_load.py"}
SMOKE_TIMEOUT_S = 120  # each takes seconds; a hang fails instead of stalling the suite


def test_every_benchmark_is_collected() -> None:
    assert len(SCRIPTS) >= 4, SCRIPTS


PLAIN = [s for s in SCRIPTS if os.path.basename(s) not in SMOKED_WITH_PLOT]


@pytest.mark.parametrize("script", PLAIN, ids=[os.path.basename(s) for s in PLAIN])
def test_benchmark_smoke_mode(script: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(
        [sys.executable, script, "--smoke"], capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S, env=env, cwd=ROOT
    )
    assert out.returncode == 0, (
        f"{os.path.basename(script)} --smoke exited {out.returncode}:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    )


def test_load_by_size_writes_every_arm_and_its_plot(tmp_path: object) -> None:
    """``save_load.py --sizes`` (the size sweep of docs/benchmarks.md): a row per size with every load arm's
    medians, and the plot drawn from the run and again from its JSON (``--replot``)."""
    import json

    pytest.importorskip("matplotlib")
    out, png, png2 = (os.path.join(str(tmp_path), n) for n in ("s.json", "s.png", "r.png"))
    script = os.path.join(ROOT, "scripts", "bench", "save_load.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    for args in (
        ["--smoke", "--sizes", "16MiB,32MiB", "--json", out, "--plot", png],
        ["--replot", out, "--plot", png2],
    ):
        got = subprocess.run(
            [sys.executable, script, *args], capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S, env=env, cwd=ROOT
        )
        assert got.returncode == 0, got.stdout[-4000:] + got.stderr[-4000:]
    with open(out) as f:
        rows = json.load(f)["sizes"]
    assert [r["live_bytes"] for r in rows] == [16 * 2**20, 32 * 2**20]
    for r in rows:
        warm = {arm: v["warm"] for arm, v in r["median_load_gbps"].items()}
        assert set(warm) >= {"spilld", "mlx_lm", "raw_qd", "memcpy_fresh", "memcpy"} and all(
            x > 0 for x in warm.values()
        )
    assert os.path.getsize(png) > 10_000 and os.path.getsize(png2) > 10_000


def test_daemon_load_smoke_runs_both_modes_and_draws_the_ingest_plot(tmp_path: object) -> None:
    """``daemon_load.py --smoke`` (CI's run of it) runs ingest and rss; ``--plot`` draws ingest's GB/s by arm from
    the run, and again from its JSON (``--replot``)."""
    import json

    pytest.importorskip("matplotlib")
    out, png, png2 = (os.path.join(str(tmp_path), n) for n in ("i.json", "i.png", "r.png"))
    script = os.path.join(ROOT, "scripts", "bench", "daemon_load.py")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    for args in (["--smoke", "--json", out, "--plot", png], ["--replot", out, "--plot", png2]):
        got = subprocess.run(
            [sys.executable, script, *args], capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S, env=env, cwd=ROOT
        )
        assert got.returncode == 0, got.stdout[-4000:] + got.stderr[-4000:]
    with open(out) as f:
        run = json.load(f)
    medians = run["ingest"]["medians"]
    assert (
        run["rss"] and len(medians) == 8 and all(v > 0 for v in medians.values())
    )  # 4 arms a durability: 2 in-process, 2 ingest
    for p in (png, png2):
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
