"""The daemon under load: ingest rate over the socket, and memory while producers outrun the disk.

    python scripts/bench/daemon_load.py ingest --json bench-out/ingest.json
    python scripts/bench/daemon_load.py rss --seconds 60 --cap 512MiB --json bench-out/rss.json

ingest: one client ships 256 MiB items, through shared memory or inline frames, to a daemon writing to disk
(durability fsync) and to one writing to tmpfs with durability none (the socket path alone); GB/s = bytes stored /
wall time. Two arms write the same bytes with Store.put in this process (no socket), to disk with fsync and to
tmpfs with none: the daemon's own write path, measured side by side, the ceiling each ingest arm is compared with
(the one of its own durability and place). Two more in-process arms copy each item's bytes once into fresh memory
(on a thread, the next item's copy beside this one's write) before Store.put: the least any ingest from another
process must do (the engine's arrays are its own allocations), so the most an ingest arm can reach on this machine.
rss: several producer connections ship droppable 64 MiB items as fast as they can for a while; the daemon's RSS
is sampled every 0.2 s. Growth over the idle daemon's RSS is compared with cap + largest item + 64 MiB.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import json
import os
import statistics
import sys
import time
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models import cache as C

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import spilld
from spilld import format as fmt
from spilld.client import AsyncClient
from spilld.codecs import default_provider
from spilld.config import parse_size
from spilld.saver import WRITE_BATCH_BYTES, BytesSource, TensorBytes
from spilld.spiller import new_item, planned
from spilld.store import Store
from tests.daemons import Daemon, cleanup, new_root

MiB = 1024 * 1024


def caches(total: int, seed: int = 0) -> list[Any]:
    """KVCaches of f16 (1, 8, 4096, 128): 8 MiB per tensor, ``total`` bytes in all."""
    mx.random.seed(seed)
    out = []
    for _ in range(max(1, total // (16 * MiB))):
        c = C.KVCache()
        k = mx.random.normal((1, 8, 4096, 128)).astype(mx.float16)
        c.update_and_fetch(k, k)
        out.append(c)
    mx.eval([c.keys for c in out])
    return out


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


async def ingest(d: Daemon, item_bytes: int, items: int, shm: bool) -> dict[str, Any]:
    client = await AsyncClient.open(d.socket, identity=spilld.Identity("ingest"), queue_cap=4 << 30, shm=shm)
    cs = caches(item_bytes)
    t0 = time.perf_counter()
    futs = [client.spill([i, *range(4095)], cs) for i in range(items)]
    results = [await f for f in futs]
    wall = time.perf_counter() - t0
    await client.close()
    stored = sum(r.stored for r in results)
    return {
        "items": items,
        "stored": stored,
        "bytes": stored * item_bytes,
        "wall_s": wall,
        "GBps": stored * item_bytes / wall / 1e9,
    }


async def rss(d: Daemon, seconds: float, item_bytes: int, producers: int) -> dict[str, Any]:
    assert d.proc is not None
    pid = d.proc.pid
    await asyncio.sleep(1.0)
    idle = rss_kib(pid)
    samples: list[tuple[float, int]] = []
    stop = time.monotonic() + seconds
    cs = caches(item_bytes)
    offered = 0
    outcomes: dict[str, int] = {}

    async def producer(k: int) -> None:
        nonlocal offered
        client = await AsyncClient.open(d.socket, identity=spilld.Identity("rss"), queue_cap=2 * item_bytes)
        i = 0
        while time.monotonic() < stop:
            fut = client.spill([k, i, *range(4094)], cs)
            offered += item_bytes
            i += 1
            r = await fut
            outcomes[r.outcome.value] = outcomes.get(r.outcome.value, 0) + 1
        await client.close()

    async def sampler() -> None:
        t0 = time.monotonic()
        while time.monotonic() < stop + 2:
            samples.append((time.monotonic() - t0, rss_kib(pid)))
            await asyncio.sleep(0.2)

    t0 = time.perf_counter()
    await asyncio.gather(sampler(), *(producer(k) for k in range(producers)))
    wall = time.perf_counter() - t0
    client = await AsyncClient.open(d.socket, identity=spilld.Identity("rss"))
    drained = await client.drain(timeout=120)
    st = await client.status()
    await client.close()
    peak = max(v for _, v in samples)
    return {
        "idle_rss_MiB": idle / 1024,
        "peak_rss_MiB": peak / 1024,
        "growth_MiB": (peak - idle) / 1024,
        "bound_MiB": (d_cap(d) + item_bytes) / MiB + 64,
        "offered_GBps": offered / wall / 1e9,
        "written_GBps": st["queue"]["bytes_written"] / wall / 1e9,
        "outcomes": outcomes,
        "queue": st["queue"],
        "drained": drained.done,
        "samples": samples,
    }


def copied(chunks: list[list[bytes | bytearray | memoryview]]) -> list[list[bytes | bytearray | memoryview]]:
    """Each tensor's bytes copied once into fresh memory (numpy's copy: it lets other threads run meanwhile)."""
    out: list[list[bytes | bytearray | memoryview]] = []
    for c in chunks:
        b = np.empty(len(c[0]), np.uint8)
        np.copyto(b, np.frombuffer(c[0], np.uint8))
        out.append([b.data])
    return out


async def write_path(
    root: str, item_bytes: int, items: int, durability: str = "fsync", copy: bool = False
) -> dict[str, Any]:
    """The daemon's write path without the socket: ``Store.put`` of the same bytes, in this process. ``copy``: each
    item's bytes are first copied once (``copied``, on a thread, one item ahead of the writes)."""
    store = Store(root, durability=durability)
    cs = caches(item_bytes)
    # the tokens of ``ingest``'s items: each its own first token, so no item's blocks are another's to reuse
    made = [
        planned(new_item(spilld.Identity("ingest"), default_provider(), [i, *range(4095)], cs)) for i in range(items)
    ]
    header, sources = made[0]
    chunks: list[list[bytes | bytearray | memoryview]] = [[b"".join(bytes(r) for r in TensorBytes(i, s, src, None).runs_now())] for i, (s, src) in
              enumerate(zip(header.slots(), sources, strict=True))]  # fmt: skip
    heads = [fmt.header_from_wire(h.to_wire()) for h, _ in made]
    del made
    loop = asyncio.get_running_loop()
    copier = concurrent.futures.ThreadPoolExecutor(1)
    t0 = time.perf_counter()
    ahead = loop.run_in_executor(copier, copied, chunks) if copy else None
    for k, h in enumerate(heads):
        these = chunks
        if ahead is not None:
            these = await ahead
            ahead = loop.run_in_executor(copier, copied, chunks) if k + 1 < len(heads) else None
        srcs: list[Any] = [BytesSource(c, s.shape) for c, s in zip(these, h.slots(), strict=True)]
        await store.put([], [], h.identity, planned=(h, srcs), batch_bytes=WRITE_BATCH_BYTES)  # as the daemon does
    wall = time.perf_counter() - t0
    copier.shutdown()
    if (written := store.counters.blocks_written) != items * len(header.tokens) // store.block_tokens:
        raise RuntimeError(f"{written} blocks written: some were reused, the arm would not write every byte")
    return {"items": items, "stored": items, "bytes": items * item_bytes, "wall_s": wall,
            "GBps": items * item_bytes / wall / 1e9}  # fmt: skip


def d_cap(d: Daemon) -> int:
    return parse_size(d.args[d.args.index("--cap") + 1])


WRITE_PATH = "disk, fsync, Store.put in-process"
WRITE_PATH_NONE = "tmpfs, no sync, Store.put in-process"
PLUS_COPY = "Store.put after one copy"
ARMS = [
    (WRITE_PATH, ["--durability", "fsync"], None, False),
    (f"disk, fsync, {PLUS_COPY}", ["--durability", "fsync"], None, False),
    ("disk, fsync, shm", ["--durability", "fsync"], None, True),
    ("disk, fsync, inline", ["--durability", "fsync"], None, False),
    (WRITE_PATH_NONE, ["--durability", "none"], "/dev/shm", False),
    (f"tmpfs, no sync, {PLUS_COPY}", ["--durability", "none"], "/dev/shm", False),
    ("tmpfs, no sync, shm", ["--durability", "none"], "/dev/shm", True),
    ("tmpfs, no sync, inline", ["--durability", "none"], "/dev/shm", False),
]
BASELINE = {label: WRITE_PATH if "fsync" in extra else WRITE_PATH_NONE for label, extra, *_ in ARMS}  # like for like


def run_ingest(a: argparse.Namespace) -> dict[str, Any]:
    rows = []
    for run in range(a.runs):
        for label, extra, where, shm in ARMS:
            if label in (WRITE_PATH, WRITE_PATH_NONE) or label.endswith(PLUS_COPY):
                root = os.path.join(where, f"spilld-bench-{os.getpid()}") if where else new_root()
                os.makedirs(root, exist_ok=True)
                try:
                    r = asyncio.run(
                        write_path(root, parse_size(a.item), a.items, extra[1], label.endswith(PLUS_COPY))
                    ) | {
                        "arm": label,
                        "run": run,
                    }
                finally:
                    cleanup(root)
                rows.append(r)
                print(f"run {run} {label:15s} {r['GBps']:.2f} GB/s ({r['wall_s']:.2f} s)", flush=True)
                continue
            root = new_root()
            d = Daemon(root, ["--cap", "4GiB", *extra])
            if where:
                d.args += ["--dir", os.path.join(where, f"spilld-bench-{os.getpid()}")]
            d.start()
            try:
                r = asyncio.run(ingest(d, parse_size(a.item), a.items, shm)) | {"arm": label, "run": run}
            finally:
                d.stop()
                cleanup(root)
                if where:
                    cleanup(os.path.join(where, f"spilld-bench-{os.getpid()}"))
            rows.append(r)
            print(
                f"run {run} {label:15s} {r['GBps']:.2f} GB/s ({r['stored']}/{r['items']} stored, {r['wall_s']:.2f} s)",
                flush=True,
            )
    med = {label: statistics.median(r["GBps"] for r in rows if r["arm"] == label) for label, *_ in ARMS}
    for label, v in med.items():
        print(f"median {label:38s} {v:.2f} GB/s ({v / med[BASELINE[label]]:.2f}x the write path at its durability)")
    return {"medians": med, "rows": rows, "ok": all(r["stored"] == r["items"] for r in rows)}


def plot_ingest(result: dict[str, Any], path: str) -> None:
    """GB/s by arm: the median as a bar, each run as a dot, the disk's arms and tmpfs's side by side, each group's
    write path first (the ceiling its ingest arms are compared with)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = list(result["medians"])
    fig, ax = plt.subplots(figsize=(12, 4.5))
    for i, label in enumerate(labels):
        base = label == BASELINE[label]
        color = "tab:gray" if base else "tab:olive" if label.endswith(PLUS_COPY) else "tab:blue"
        ax.bar(i, result["medians"][label], color=color, alpha=0.7)
        runs = [r["GBps"] for r in result["rows"] if r["arm"] == label]
        ax.plot([i] * len(runs), runs, "k.", markersize=6)
        if not base:
            ratio = result["medians"][label] / result["medians"][BASELINE[label]]
            ax.text(i, result["medians"][label] / 2, f"{ratio:.2f}x", ha="center", color="white", fontweight="bold")
    ax.set_xticks(range(len(labels)), [label.replace(", ", "\n") for label in labels], fontsize=8)
    ax.set_ylabel("GB/s (bar: median; dots: runs)")
    ax.set_title("ingest through the daemon (blue) against its write path (gray), and after one copy (olive)")
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def run_rss(a: argparse.Namespace) -> dict[str, Any]:
    root = new_root()
    d = Daemon(root, ["--cap", a.cap]).start()
    try:
        r = asyncio.run(rss(d, a.seconds, parse_size(a.rss_item), a.producers))
    finally:
        d.stop()
        cleanup(root)
    print(json.dumps({k: v for k, v in r.items() if k != "samples"}, indent=1))
    ok = r["growth_MiB"] <= r["bound_MiB"]
    print(f"growth {r['growth_MiB']:.0f} MiB vs bound {r['bound_MiB']:.0f} MiB: {'met' if ok else 'MISSED'}")
    return r | {"ok": ok and r["drained"] and not r["outcomes"].get("failed")}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", nargs="?", choices=["ingest", "rss"], help="required unless --smoke (which runs both)")
    p.add_argument("--items", type=int, default=8)
    p.add_argument("--item", default="256MiB", help="item size for ingest (default 256MiB)")
    p.add_argument("--rss-item", default="64MiB", help="item size for rss (default 64MiB)")
    p.add_argument("--seconds", type=float, default=60.0)
    p.add_argument("--cap", default="512MiB")
    p.add_argument("--producers", type=int, default=4)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--json", default=None)
    p.add_argument("--plot", metavar="PNG", default=None, help="ingest: draw GB/s by arm, each run a dot (matplotlib)")
    p.add_argument("--replot", metavar="JSON", default=None, help="draw --plot from an ingest run's JSON")
    p.add_argument(
        "--smoke", action="store_true", help="seconds-long check that both modes and every arm run (16 MiB items)"
    )
    a = p.parse_args()
    if a.replot and a.plot:
        with open(a.replot) as f:
            run = json.load(f)
        plot_ingest(run.get("ingest", run), a.plot)  # (a --smoke run's JSON holds both modes)
        return 0
    if a.smoke:
        a.items, a.item, a.rss_item, a.seconds, a.cap, a.producers, a.runs = 2, "16MiB", "16MiB", 1.0, "64MiB", 2, 1
    elif a.mode is None:
        p.error("a mode (ingest or rss) is required without --smoke")
    modes = ["ingest", "rss"] if a.smoke and a.mode is None else [a.mode]
    out: dict[str, Any] = {"mode": a.mode, "args": vars(a)}
    ok = True
    for mode in modes:
        r = run_ingest(a) if mode == "ingest" else run_rss(a)
        ok = ok and r.pop("ok")
        out |= r if len(modes) == 1 else {mode: r}
    if a.plot and "ingest" in modes:
        plot_ingest(out["ingest"] if len(modes) > 1 else out, a.plot)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1)
    if not ok:
        print("FAILED: an item was not stored, a spill failed, the drain did not finish or memory passed its bound")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
