"""New TLS connections to the shared tier: redis-py's own SSL context per connection against the tier's one shared
context (``spilld.remote.client.tls_context``), arms alternating in one run.

A TLS-only ``redis-server`` is started here on a free localhost port, on a self-signed certificate made with
openssl (``tests.redis_servers.tls_redis_server``). Per arm and round, ``--connects`` clients are made one after
another, each connected by a PING: the time of each connect (context, TCP connect, handshake, PING), all of it on
the event loop's thread. Reported: the median and the slowest connect per arm, and the ratio of the medians.

    python scripts/bench/tls_connect.py [--rounds 5] [--connects 20] [--smoke] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from spilld.remote import RemoteConfig
from spilld.remote.client import close_client, make_client, tls_context
from tests.redis_servers import tls_redis_server

BOUND_S = 5.0  # per connect, loose: what is measured is how long it takes, not whether it fits the tier's bound


async def connect_times(config: RemoteConfig, shared: bool, n: int) -> list[float]:
    """Seconds per new connection (a fresh client each, connected by its first PING)."""
    ctx = await asyncio.to_thread(tls_context, config, None) if shared else None
    out = []
    for _ in range(n):
        client = make_client(config, None, ctx)
        t0 = time.perf_counter()
        await client.ping()
        out.append(time.perf_counter() - t0)
        await close_client(client)
    return out


async def run(args: argparse.Namespace) -> dict[str, list[float]]:
    with tls_redis_server() as server:
        config = RemoteConfig(server.url(server.cert), tls_connect_timeout_s=BOUND_S, socket_timeout_s=BOUND_S)
        times: dict[str, list[float]] = {"per_connection": [], "shared": []}
        for r in range(args.rounds):
            for arm in ("per_connection", "shared") if r % 2 == 0 else ("shared", "per_connection"):
                times[arm] += await connect_times(config, arm == "shared", args.connects)
        return times


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="rounds, arms alternating (default 5)")
    p.add_argument("--connects", type=int, default=20, help="connects per arm and round (default 20)")
    p.add_argument("--smoke", action="store_true", help="2 rounds of 2 connects (figures mean nothing)")
    p.add_argument("--json", default=None, help="write the per-connect times here too")
    a = p.parse_args()
    if a.smoke:
        a.rounds, a.connects = 2, 2
    times = asyncio.run(run(a))
    med = {arm: statistics.median(v) * 1000 for arm, v in times.items()}
    print("| SSL context | connects | median (ms) | slowest (ms) |")
    print("|---|---|---|---|")
    for arm, v in times.items():
        print(f"| {arm.replace('_', ' ')} | {len(v)} | {med[arm]:.1f} | {max(v) * 1000:.1f} |")
    print(f"\nper connection / shared, ratio of the medians: {med['per_connection'] / med['shared']:.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"args": vars(a), "seconds": times}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
