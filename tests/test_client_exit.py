"""A client process exits cleanly after its daemon fails under it: no abort at exit, no stray error logs.

The engine here is a real process: it decodes in a thread of its own and spills through ``Client`` while the test
SIGKILLs the daemon (and, in one case, starts a new one on the same socket). The process must then stop with exit
status 0 and an stderr free of ``terminate called`` (an mlx thread alive at interpreter shutdown), ``Future
exception was never retrieved`` and ``Task was destroyed`` (requests the client had given up on).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.daemons import Daemon, cleanup, new_root

ROUNDS = 3  # the abort was intermittent

ENGINE = r"""
import sys, threading, time
import mlx.core as mx
from mlx_lm.models import cache as C
import spilld
from spilld import mlxthreads
from spilld.client import Client
from spilld.lease import ThreadLockLease

sock, mode = sys.argv[1], sys.argv[2]
lock = threading.Lock()
client = Client(sock, identity=spilld.Identity("exit"), lease=ThreadLockLease(lock), timeout=5.0)
futs = []

def engine():
    cache = C.KVCache()
    for step in range(250):
        with lock:
            cache.update_and_fetch(mx.random.normal((1, 8, 16, 64)), mx.random.normal((1, 8, 16, 64)))
            mx.eval(cache.keys, cache.values)
            if step % 10 == 0:
                futs.append(client.spill(list(range(cache.offset)), [cache], live=step % 20 == 0, droppable=False))
        time.sleep(0.002)

th = mlxthreads.start_thread(engine, "engine")  # an engine thread frees its mlx streams as it ends
print("ready", flush=True)
th.join()
outcomes = [f.result(timeout=60).outcome.value for f in futs]
for call in (lambda: client.lookup([1, 2, 3]), lambda: client.status(), lambda: client.drain(timeout=1)):
    try:
        call()
    except Exception as exc:  # the daemon is gone (or new): a typed error, never a hang
        print("call failed:", type(exc).__name__, flush=True)
if mode != "no_close":  # an engine may also just exit, its client still open
    client.close(timeout=2)
print("outcomes", sorted(set(outcomes)), flush=True)
"""


@pytest.mark.parametrize("mode", ["kill", "restart", "no_close"])
def test_a_client_process_exits_cleanly_after_its_daemon_is_killed(mode: str) -> None:
    restart = mode != "kill"
    for _ in range(ROUNDS):
        d = Daemon(new_root(), ["--cap", "64MiB"]).start()
        try:
            env = {**os.environ, "PYTHONPATH": os.getcwd()}
            proc = subprocess.Popen(
                [sys.executable, "-c", ENGINE, d.socket, mode],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            assert proc.stdout is not None
            assert proc.stdout.readline().strip() == "ready"
            time.sleep(0.3)  # spills are on their way
            d.stop(signal.SIGKILL)
            if restart:
                time.sleep(0.2)
                d.start()
            out, err = proc.communicate(timeout=240)
            assert proc.returncode == 0, f"exit {proc.returncode}\nstdout:\n{out}\nstderr:\n{err}"
            for bad in ("terminate called", "never retrieved", "Task was destroyed", "Traceback", "Exception in"):
                assert bad not in err, f"{bad!r} in the client's stderr:\n{err}"
            assert "outcomes" in out
        finally:
            d.kill()
            cleanup(d.root)
