"""mypy and ruff are part of the test suite."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_mypy() -> None:
    r = _run("mypy")
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_lint() -> None:
    r = _run("ruff", "check", "spilld", "tests", "scripts")
    assert r.returncode == 0, r.stdout + r.stderr


def test_ruff_format() -> None:
    r = _run("ruff", "format", "--check", "spilld", "tests", "scripts")
    assert r.returncode == 0, r.stdout + r.stderr
