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
SMOKE_TIMEOUT_S = 120  # each takes seconds; a hang fails instead of stalling the suite


def test_every_benchmark_is_collected() -> None:
    assert len(SCRIPTS) >= 4, SCRIPTS


@pytest.mark.parametrize("script", SCRIPTS, ids=[os.path.basename(s) for s in SCRIPTS])
def test_benchmark_smoke_mode(script: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
    out = subprocess.run(
        [sys.executable, script, "--smoke"], capture_output=True, text=True, timeout=SMOKE_TIMEOUT_S, env=env, cwd=ROOT
    )
    assert out.returncode == 0, (
        f"{os.path.basename(script)} --smoke exited {out.returncode}:\n{out.stdout[-4000:]}\n{out.stderr[-4000:]}"
    )
