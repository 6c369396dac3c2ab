"""``pip install .`` with no extras in a fresh venv, then ``spilld --cap 64MiB`` serves, stores and drains.

The daemon must run on a plain install (no mlx-lm): this builds one, starts its daemon, spills a real cache into
it from this interpreter (which has mlx-lm, as an engine's does), drains and stops it with the plain install's
own commands, and verifies the file. Slow (a venv and a wheel build): run by hand or in CI, not by pytest.

    python scripts/check_plain_install.py [--keep]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
READY_TIMEOUT_S = 60.0


def run(*cmd: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    print("$", " ".join(cmd), flush=True)
    return subprocess.run(cmd, check=check, capture_output=True, text=True, timeout=1800)


def wait_ready(path: str, proc: subprocess.Popen[bytes]) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the daemon exited with {proc.returncode}")
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.connect(path)
                return
            except OSError:
                time.sleep(0.1)
    raise SystemExit("the daemon did not listen in time")


async def spill(sock: str) -> str:
    """Store one real cache through the daemon (this interpreter is the engine: it has mlx-lm)."""
    sys.path.insert(0, ROOT)
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache

    from spilld.client import AsyncClient
    from spilld.format import Identity

    cache = KVCache()
    cache.update_and_fetch(mx.ones((1, 2, 40, 8)), mx.ones((1, 2, 40, 8)))
    async with AsyncClient(sock, identity=Identity(model_id="plain")) as client:
        settled = await client.spill(list(range(40)), [cache])
        if not settled.stored:
            raise SystemExit(f"spill not stored: {settled}")
        path: str = settled.value.path
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--keep", action="store_true", help="keep the venv and the store")
    args = ap.parse_args()
    work = tempfile.mkdtemp(prefix="spilld-plain-")
    venv, store, sock = os.path.join(work, "venv"), os.path.join(work, "store"), os.path.join(work, "run", "s.sock")
    bin_ = os.path.join(venv, "bin")
    try:
        run(sys.executable, "-m", "venv", venv)
        run(os.path.join(bin_, "pip"), "install", "-q", ROOT)
        if run(os.path.join(bin_, "python"), "-c", "import mlx_lm", check=False).returncode == 0:
            raise SystemExit("mlx_lm is installed: this is not a plain install")
        daemon = subprocess.Popen([os.path.join(bin_, "spilld"), "--cap", "64MiB", "--dir", store, "--socket", sock])
        try:
            wait_ready(sock, daemon)
            path = asyncio.run(spill(sock))
            drained = run(os.path.join(bin_, "spilld"), "drain", "--socket", sock, "--timeout", "30")
            print(drained.stdout.strip())
            daemon.send_signal(signal.SIGTERM)
            if daemon.wait(60) != 0:
                raise SystemExit(f"the daemon stopped with {daemon.returncode}")
        finally:
            if daemon.poll() is None:
                daemon.kill()
        print(run(os.path.join(bin_, "spilld"), "verify", path).stdout.strip())
        print("plain install: served, stored, drained, verified")
        return 0
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())
