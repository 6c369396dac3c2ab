"""Time to first token after an engine restart, from whole files against blocks (issue 14's TTFT target).

Per run and arm, arms alternating: a daemon is started on a fresh folder with ``--block-tokens B`` (0: whole
files) and ``--warm-bytes 0`` (no read-ahead warms the files), then ``spilld demo --json`` runs against it (the
tiny model's 3-turn chat spilled through the daemon, then an engine restart: the next question answered by a full
prefill and from the cold tier), then the daemon is stopped with SIGTERM. Reported per arm: the cold-tier TTFT of
each run and its median, the full prefill's median, and the ratio of the medians (blocks / whole files).

    python scripts/bench/restart_ttft.py [--runs 10] [--blocks 0,64] [--smoke] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from spilld.daemon.listen import is_served

SOCKET_WAIT_S = 30.0  # a daemon that has not bound its socket by then failed to start
DEMO_TIMEOUT_S = 300.0


def one_run(block_tokens: int) -> dict[str, Any]:
    """One daemon and one demo; the demo's JSON figures."""
    d = tempfile.mkdtemp(prefix="spilld-ttft-")
    sock = os.path.join(d, "s.sock")
    daemon = subprocess.Popen(
        [sys.executable, "-m", "spilld", "--dir", os.path.join(d, "store"), "--socket", sock,
         "--block-tokens", str(block_tokens), "--warm-bytes", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + SOCKET_WAIT_S
        while not is_served(sock):  # accepting, not only bound (a refused connect raced the listen)
            if daemon.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the daemon did not start: {daemon.stderr.read() if daemon.stderr else ''}")
            time.sleep(0.05)
        demo = subprocess.run(
            [sys.executable, "-m", "spilld", "demo", "--socket", sock, "--json"],
            capture_output=True, text=True, timeout=DEMO_TIMEOUT_S,
        )  # fmt: skip
        if demo.returncode != 0:
            raise SystemExit(f"spilld demo exited {demo.returncode}:\n{demo.stdout[-2000:]}\n{demo.stderr[-2000:]}")
        return dict(json.loads(demo.stdout.strip().splitlines()[-1]))
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(timeout=60)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        shutil.rmtree(d, ignore_errors=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=10, help="runs per arm (default 10)")
    p.add_argument("--blocks", default="0,64", help="the arms' --block-tokens, comma-separated (default 0,64)")
    p.add_argument("--smoke", action="store_true", help="one run of the last arm (each run is a whole demo)")
    p.add_argument("--json", default=None, help="write the figures here too")
    a = p.parse_args()
    arms = [int(b) for b in a.blocks.split(",")]
    if a.smoke:
        a.runs, arms = 1, arms[-1:]
    runs: dict[int, list[dict[str, Any]]] = {b: [] for b in arms}
    for r in range(a.runs):
        for b in arms if r % 2 == 0 else reversed(arms):
            f = one_run(b)
            runs[b].append(f)
            print(
                f"run {r + 1} B={b}: cold tier {f['ttft_with_tier_ms']:.1f} ms, full prefill "
                f"{f['ttft_without_tier_ms']:.1f} ms, {f['restored_tokens']} tokens restored, {f['entries']} entries",
                flush=True,
            )
    med = {b: statistics.median(f["ttft_with_tier_ms"] for f in runs[b]) for b in arms}
    print()
    print("| B | cold-tier TTFT per run (ms) | median | full prefill, median |")
    print("|---|---|---|---|")
    for b in arms:
        per_run = ", ".join(f"{f['ttft_with_tier_ms']:.1f}" for f in runs[b])
        prefill = statistics.median(f["ttft_without_tier_ms"] for f in runs[b])
        print(f"| {b} | {per_run} | **{med[b]:.1f}** | {prefill:.0f} ms |")
    if len(arms) == 2:
        base, other = arms
        print(f"\nB={other} / B={base}, ratio of the medians: {med[other] / med[base]:.3f}")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"args": vars(a), "runs": {str(b): v for b, v in runs.items()}}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
