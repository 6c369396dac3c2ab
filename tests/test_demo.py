"""``spilld demo`` end to end: it starts its own daemon when none answers, or uses the one running."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from spilld.daemon import is_served
from tests.daemons import Daemon, cleanup, new_root


def _demo(*args: str) -> tuple[dict[str, Any], str]:
    out = subprocess.run(
        [sys.executable, "-m", "spilld", "demo", "--json", *args], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert len(out.stdout.strip().splitlines()) == 1  # --json: stdout is the result alone, progress on stderr
    return json.loads(out.stdout), out.stderr


def _check_cold_tier_path(f: dict[str, Any]) -> None:
    assert f["restored_tokens"] > 0  # the restart was served from disk
    assert f["restored_tokens"] < f["prompt_tokens"]
    assert f["same_first_token"] is True
    # The whole next-token distribution, not one argmax: the two answers agree to rounding, and the control (one
    # restored value moved) shows that a wrong row moves the logits far more than that.
    assert f["control_logits_max_diff"] > 0
    assert f["logits_max_diff"] <= f["control_logits_max_diff"] / 100
    assert f["entries"] >= 1 and f["bytes_on_disk"] > 0
    print(json.dumps(f))  # the timings are shown, never asserted


def test_demo_starts_and_stops_its_own_daemon() -> None:
    root = new_root()
    try:
        f, text = _demo("--socket", f"{root}/s.sock", "--dir", f"{root}/store")
        _check_cold_tier_path(f)
        assert "starting one for this demo" in text
        assert Daemon(root).cli("status", "--socket", f"{root}/s.sock").returncode == 4  # stopped at the end
    finally:
        cleanup(root)


def test_demo_uses_a_running_daemon_and_leaves_it_running() -> None:
    d = Daemon(new_root(), ["--cap", "256MiB"]).start()
    try:
        f, text = _demo("--socket", d.socket)
        _check_cold_tier_path(f)
        assert "using the daemon" in text
        assert d.proc is not None and d.proc.poll() is None
        assert d.cli("status", "--socket", d.socket).returncode == 0
    finally:
        assert d.stop() == 0
        cleanup(d.root)


def test_demo_refuses_a_dir_the_running_daemon_does_not_serve() -> None:
    """Found in review: README says a --dir given is never ignored, but `demo --dir D` with a daemon already on the
    socket used that daemon's own folder without a word. It is refused (exit 2) unless that daemon serves D."""
    d = Daemon(new_root(), ["--cap", "256MiB"]).start()
    try:
        other = f"{d.root}/elsewhere"
        r = subprocess.run(
            [sys.executable, "-m", "spilld", "demo", "--socket", d.socket, "--dir", other],
            capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        assert r.returncode == 2 and f"serves {d.dir}, not {other}" in r.stderr, r.stderr
        assert d.cli("status", "--socket", d.socket).returncode == 0  # left running, untouched
    finally:
        assert d.stop() == 0
        cleanup(d.root)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGTERM])
def test_a_stop_signal_stops_the_demos_daemon_and_removes_its_temp_folder(sig: signal.Signals) -> None:
    """Found in review: SIGHUP or SIGTERM to `spilld demo` left the daemon it started running (a session of its
    own) and its temp folder behind; the next demo found the socket in use. Now the demo stops its daemon, removes
    the folder, and exits 128 + the signal."""
    root = new_root()
    sock, tmp = f"{root}/s.sock", f"{root}/tmp"
    os.mkdir(tmp)
    pid = None
    with open(f"{root}/err", "w") as err:  # a file, not a pipe: a daemon left behind would hold a pipe open
        proc = subprocess.Popen(
            [sys.executable, "-m", "spilld", "demo", "--socket", sock, "--dir", f"{root}/store"],
            stdout=subprocess.DEVNULL, stderr=err, env={**os.environ, "TMPDIR": tmp},
        )  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while not (os.listdir(tmp) and is_served(sock)):  # its temp folder made, its daemon up
            assert proc.poll() is None and time.monotonic() < deadline, Path(f"{root}/err").read_text()
            time.sleep(0.05)
        pid = json.loads(Daemon(root).cli("status", "--json", "--socket", sock).stdout)["pid"]
        proc.send_signal(sig)
        code = proc.wait(120)
        said = Path(f"{root}/err").read_text()
        assert not _alive(pid) and not is_served(sock), said  # its daemon stopped
        assert os.listdir(tmp) == [], os.listdir(tmp)  # its temp folder removed
        assert code == 128 + sig and f"stopped by {sig.name}" in said, (code, said)
    finally:
        proc.kill()
        proc.wait()
        if pid is not None and _alive(pid):  # left running (the bug): stopped here
            os.kill(pid, signal.SIGKILL)
        cleanup(root)
