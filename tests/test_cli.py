"""The command line: every verb and exit code, run as a real subprocess."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

DATA = Path(__file__).parent / "data" / "v1"


def spilld(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "spilld", *args], capture_output=True, text=True, timeout=120)


def test_help_lists_exit_codes() -> None:
    r = spilld("--help")
    assert r.returncode == 0 and "exit codes" in r.stdout and "inspect" in r.stdout


def test_usage_errors() -> None:
    assert spilld("bogus").returncode == 2
    assert spilld("inspect").returncode == 2  # argparse: missing FILE
    assert spilld("--cap", "4 parsecs", "--socket", "/tmp/x-never.sock").returncode == 2  # sizes are checked first


def test_inspect_text_and_json() -> None:
    r = spilld("inspect", str(DATA / "kv.spilld"))
    assert r.returncode == 0 and "all tensor hashes match" in r.stdout and "kv v1 offset=9" in r.stdout
    r = spilld("inspect", "--json", str(DATA / "kv.spilld"))
    d = json.loads(r.stdout)
    assert d["ok"] and d["header"]["tokens"] == list(range(100, 109)) and d["header"]["caches"][0]["kind"] == "kv"


def test_inspect_and_verify_refuse_a_corrupt_file(tmp_path: Any) -> None:
    bad = tmp_path / "bad.spilld"
    shutil.copy(DATA / "kv.spilld", bad)
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF
    bad.write_bytes(bytes(data))
    r = spilld("inspect", "--json", str(bad))
    assert r.returncode == 1 and json.loads(r.stdout)["code"] == "tensor_hash_mismatch"
    assert spilld("inspect", "--no-verify", str(bad)).returncode == 0  # header alone is fine
    r = spilld("verify", str(DATA / "kv.spilld"), str(bad))
    assert r.returncode == 1 and "ok   " in r.stdout and "BAD  " in r.stdout
    assert spilld("verify", *map(str, sorted(DATA.glob("*.spilld")))).returncode == 0
