"""Decode latency while caches spill: idle vs mlx-lm's save on the engine thread vs spilld embedded.

An engine thread decodes a tiny random-weight llama continuously under its generation lock. Besides the model's
own cache it carries a large synthetic KV cache (like a big model's) that each decode step extends in place by one
row. At fixed tokens the engine hands caches to the spill arm:

  eviction  caches the engine then drops (views are free)
  snapshot  the engine's own large cache, which it keeps extending (a held view makes its next update copy)

Arms: idle (no spill), mlxlm (mlx_lm save_prompt_cache + fsync, called on the engine thread), spilld (Spiller.spill
with a ThreadLockLease on the generation lock; durability fsync; in the snapshot case with live=True), spilld_views
(snapshot case only: plain zero-copy views, to show the copy they force on the engine), scrub (eviction case only: no
spill, while the daemon's idle-time scrub checks a store of ``--scrub-mib`` MiB at ``--scrub-rate`` on the spiller's
loop, in the engine's process), scrub_daemon (the same, by a real ``spilld serve`` left idle by its clients: its
scrub in a process of its own, as deployed). Every arm runs in every round, interleaved.

    python scripts/bench/decode_interference.py --rounds 3 --json bench-out/interference.json --plot docs/decode_interference.png
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as C
from mlx_lm.models import llama

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import spilld
from spilld import mlxthreads

MiB = 1024 * 1024


DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}


def build_model(a: argparse.Namespace) -> Any:
    mx.random.seed(0)
    args = llama.ModelArgs(
        model_type="llama",
        hidden_size=a.hidden,
        num_hidden_layers=a.layers,
        intermediate_size=a.hidden * 11 // 4,
        num_attention_heads=a.attn_heads,
        num_key_value_heads=a.kv_heads,
        rms_norm_eps=1e-5,
        vocab_size=a.vocab,
        tie_word_embeddings=True,
    )
    model = llama.Model(args)
    model.set_dtype(DTYPES[a.model_dtype])
    mx.eval(model.parameters())
    return model


def big_cache(layers: int, tokens: int, heads: int, dim: int, seed: int) -> list[Any]:
    """A large f16 KVCache list filled in one prefill (buffer has room for the decode rows)."""
    mx.random.seed(seed)
    out = []
    for _ in range(layers):
        c = C.KVCache()
        k = mx.random.normal((1, heads, tokens, dim)).astype(mx.float16)
        c.update_and_fetch(k, k + 1)
        out.append(c)
    mx.eval([c.keys for c in out] + [c.values for c in out])
    return out


def nbytes(caches: list[Any]) -> int:
    return sum(c.keys[..., : c.offset, :].nbytes * 2 for c in caches)


@dataclass
class Result:
    arm: str
    case: str
    lat_ms: list[float] = field(default_factory=list)
    spill_call_ms: list[float] = field(default_factory=list)
    after_spill_ms: list[float] = field(default_factory=list)
    spilled_bytes: int = 0
    spill_wall_s: float = 0.0
    longest_lease_ms: float = 0.0
    spill_k: list[int] = field(default_factory=list)  # timed tokens at which a spill was handed over
    settled_k: list[int] = field(default_factory=list)  # timed tokens by which each spill was durable
    scrubbed_bytes: int = 0

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.lat_ms)
        normal = [v for i, v in enumerate(self.lat_ms) if i not in set(self._after_idx)]
        return {
            "arm": self.arm,
            "case": self.case,
            "p50_ms": statistics.median(lat),
            "p99_ms": lat[min(len(lat) - 1, round(0.99 * (len(lat) - 1)))],
            "max_ms": lat[-1],
            "normal_median_ms": statistics.median(normal) if normal else None,
            "after_spill_ms": self.after_spill_ms,
            "spill_call_ms": self.spill_call_ms,
            "spilled_MiB": self.spilled_bytes / MiB,
            "spill_GBps": self.spilled_bytes / self.spill_wall_s / 1e9 if self.spill_wall_s else None,
            "longest_lease_ms": self.longest_lease_ms,
            "scrubbed_MiB": self.scrubbed_bytes / MiB,
        }

    _after_idx: list[int] = field(default_factory=list)


def decode_step(lock: Any, model: Any, tok: mx.array, own: list[Any], live_big: list[Any], row: mx.array) -> None:
    """One decode step under the generation lock: the model's token, and one row into each large cache."""
    with lock:
        logits = model(tok, cache=own)
        for c in live_big:
            c.update_and_fetch(row, row)
        mx.eval(logits, [c.keys for c in live_big], [c.values for c in live_big])


def run_arm(arm: str, case: str, args: argparse.Namespace, model: Any, folder: str) -> Result:
    res = Result(arm, case)
    lock = threading.Lock()
    loop = asyncio.new_event_loop()
    loop_thread = mlxthreads.start_thread(loop.run_forever, "spill-loop", daemon=True)
    lease = spilld.ThreadLockLease(lock)
    spiller: spilld.Spiller | None = None
    scrubbing = None
    if arm == "scrub":
        scrubbing = start_scrub(folder, args, loop)
    scrub_daemon = start_scrub_daemon(folder, args, loop) if arm == "scrub_daemon" else None
    if arm.startswith("spilld"):
        spiller = asyncio.run_coroutine_threadsafe(
            spilld.Spiller.open(folder, identity=spilld.Identity("bench"), lease=lease, queue_cap=4 << 30), loop
        ).result()

    own = C.make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(1, args.context + 1))]), cache=own))
    live_big = big_cache(args.big_layers, args.big_tokens, args.heads, args.dim, seed=1)
    step = max(1, (args.tokens - args.warmup) // args.spills)
    spill_at = list(range(args.warmup, args.tokens, step))[: args.spills]
    # caches the engine will evict, made before the clock starts (making them is not decode work)
    evict = {}
    if case == "eviction" and arm not in ("idle", "scrub", "scrub_daemon"):
        evict = {s: big_cache(args.big_layers, args.big_tokens, args.heads, args.dim, seed=s) for s in spill_at}
    futures: list[Any] = []
    settled_at: list[float] = []
    tok = mx.array([[5]])
    row = mx.zeros((1, args.heads, 1, args.dim), dtype=mx.float16)
    t_first_spill = None
    token_t: list[float] = []
    last = time.perf_counter()
    for i in range(args.tokens + args.warmup):
        decode_step(lock, model, tok, own, live_big, row)
        now = time.perf_counter()
        # token-to-token time: everything the engine thread did since the last token counts
        dt, last = (now - last) * 1e3, now
        k = i - args.warmup
        if k >= 0:
            res.lat_ms.append(dt)
            token_t.append(now)
        if k - 1 in spill_at:
            res.after_spill_ms.append(dt)
            res._after_idx.append(len(res.lat_ms) - 1)
        if k in spill_at and arm not in ("idle", "scrub", "scrub_daemon"):
            res.spill_k.append(k)
            caches = live_big if case == "snapshot" else evict.pop(k)
            res.spilled_bytes += nbytes(caches)
            t_first_spill = t_first_spill or time.perf_counter()
            t1 = time.perf_counter()
            if arm == "mlxlm":
                path = os.path.join(folder, f"mlxlm-{i}.safetensors")
                with lock:
                    C.save_prompt_cache(path, caches)
                    fd = os.open(path, os.O_RDONLY)
                    os.fsync(fd)
                    os.close(fd)
                settled_at.append(time.perf_counter())
            else:
                assert spiller is not None
                live = case == "snapshot" and arm == "spilld"  # the engine keeps extending these caches
                fut = spiller.spill_threadsafe(list(range(caches[0].offset)), caches, live=live)
                fut.add_done_callback(lambda _f: settled_at.append(time.perf_counter()))
                futures.append(fut)
            res.spill_call_ms.append((time.perf_counter() - t1) * 1e3)
            del caches  # the eviction case: the engine drops them
    for f in futures:
        outcome = f.result(timeout=600)
        if not outcome.stored:
            raise RuntimeError(f"{arm} {case}: a spill was not stored: {outcome}")
    if t_first_spill and settled_at:
        # from the first spill to the last one durable (decode ran meanwhile)
        res.spill_wall_s = max(settled_at) - t_first_spill
        res.settled_k = [bisect.bisect_left(token_t, t) for t in sorted(settled_at)]
    if scrubbing is not None:
        task, scrub = scrubbing
        res.scrubbed_bytes = scrub.stats.bytes + scrub.stats.passes * sum(n for _, n, _ in scrub.targets())
        asyncio.run_coroutine_threadsafe(cancelled(task), loop).result()
    if scrub_daemon is not None:
        res.scrubbed_bytes = scrub_daemon.stop()
    res.longest_lease_ms = lease.longest_hold_s * 1e3
    if spiller is not None:
        asyncio.run_coroutine_threadsafe(spiller.close(), loop).result()
    loop.call_soon_threadsafe(loop.stop)
    loop_thread.join()
    loop.close()
    shutil.rmtree(folder, ignore_errors=True)
    os.makedirs(folder, exist_ok=True)
    return res


async def cancelled(task: asyncio.Task[Any]) -> None:
    """Cancel ``task`` and wait until it has unwound (its check on a worker thread included)."""
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def scrub_store(folder: str, args: argparse.Namespace) -> Any:
    """A store of ``--scrub-mib`` MiB in ``folder``/scrub, for a scrub to check."""
    from spilld.store import Store

    store = Store(os.path.join(folder, "scrub"), disk_cap=2**42, durability="none")
    per = args.big_tokens * args.heads * args.dim * 2 * 2  # bytes of one layer's K and V
    for i in range(max(1, args.scrub_mib * MiB // (per * args.big_layers))):
        caches = big_cache(args.big_layers, args.big_tokens, args.heads, args.dim, seed=100 + i)
        await store.put(list(range(i * 100_000, i * 100_000 + args.big_tokens)), caches, spilld.Identity("s"))
    return store


def start_scrub(folder: str, args: argparse.Namespace, loop: asyncio.AbstractEventLoop) -> tuple[Any, Any]:
    """The store of ``scrub_store`` and its scrub running on ``loop``, in this process (no first delay)."""
    from spilld.scrub import Scrub

    async def start() -> tuple[Any, Any]:
        store = await scrub_store(folder, args)
        scrub = Scrub(store, args.scrub_rate * MiB, interval=0.0)

        async def run() -> None:
            while True:
                await scrub.scrub_pass()

        return asyncio.get_running_loop().create_task(run()), scrub

    return asyncio.run_coroutine_threadsafe(start(), loop).result()


class ScrubDaemon:
    """A real ``spilld serve`` on the store of ``scrub_store``, with no client: its idle-time scrub checks the store
    at ``--scrub-rate`` (a pass a second at most) in a process of its own, as in a deployment."""

    def __init__(self, folder: str, args: argparse.Namespace) -> None:
        from tests.daemons import Daemon, new_root

        self.root = new_root()
        flags = ["--dir", os.path.join(folder, "scrub"), "--durability", "none", "--warm-bytes", "0"]
        flags += ["--scrub-rate", f"{args.scrub_rate}MiB", "--scrub-every", "1s"]
        self.daemon = Daemon(self.root, flags).start()
        deadline = time.monotonic() + 30
        while self.scrubbed() == 0:  # its first pass starts one interval after the start
            if time.monotonic() > deadline:
                raise RuntimeError(f"the daemon's scrub did not start:\n{self.daemon.read_log()}")
            time.sleep(0.1)
        self.before = self.scrubbed()

    def scrubbed(self) -> int:
        out = self.daemon.cli("--socket", self.daemon.socket, "status", "--json", timeout=30)
        st = json.loads(out.stdout)
        return int(st["scrub"]["bytes"]) + int(st["scrub"]["passes"]) * int(st["store"]["bytes"])

    def stop(self) -> int:
        """Stop the daemon: the bytes its scrub checked while the arm ran."""
        from tests.daemons import cleanup

        try:
            return self.scrubbed() - self.before
        finally:
            self.daemon.stop()
            cleanup(self.root)


def start_scrub_daemon(folder: str, args: argparse.Namespace, loop: asyncio.AbstractEventLoop) -> ScrubDaemon:
    asyncio.run_coroutine_threadsafe(scrub_store(folder, args), loop).result()
    return ScrubDaemon(folder, args)


def spill_call_cost(folder: str, layers: int = 32, tokens: int = 8192 - 1) -> dict[str, float]:
    """Engine-thread cost of Spiller.spill(); the default cache is 1 GiB (32 layers of (1, 8, 8192, 128) f16)."""
    caches = big_cache(layers, tokens, 8, 128, seed=7)
    loop = asyncio.new_event_loop()
    th = mlxthreads.start_thread(loop.run_forever, "spill-loop", daemon=True)
    sp = asyncio.run_coroutine_threadsafe(spilld.Spiller.open(folder, identity=spilld.Identity("bench")), loop).result()
    costs = []
    futs = []
    for _ in range(5):
        t0 = time.perf_counter()
        futs.append(sp.spill_threadsafe(list(range(caches[0].offset)), caches))
        costs.append((time.perf_counter() - t0) * 1e3)
    cancelled = sum(1 for f in futs if not f.result(timeout=600).stored)
    asyncio.run_coroutine_threadsafe(sp.close(), loop).result()
    loop.call_soon_threadsafe(loop.stop)
    th.join()
    shutil.rmtree(folder, ignore_errors=True)
    return {
        "median_ms": statistics.median(costs),
        "max_ms": max(costs),
        "bytes": nbytes(caches),
        "not_stored": cancelled,
    }


def plot(rows: list[Result], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4), sharey=True)
    for ax, case in zip(axes, ("eviction", "snapshot"), strict=True):
        for r in rows:
            if r.case == case:
                line = ax.plot(r.lat_ms, label=r.arm, linewidth=0.8)[0]
                for k in r.spill_k:  # a spill handed over (solid) and durable (dotted), in the arm's colour
                    ax.axvline(k, color=line.get_color(), linewidth=0.6, alpha=0.6)
                for k in r.settled_k:
                    ax.axvline(k, color=line.get_color(), linewidth=0.6, alpha=0.6, linestyle=":")
        ax.set_title(f"{case}: per-token decode latency (spill handed over |, durable :)")
        ax.set_xlabel("token")
        ax.set_yscale("log")
        ax.legend()
    axes[0].set_ylabel("ms (log)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def add_engine_args(p: argparse.ArgumentParser) -> None:
    """The engine's shape: its model, its large synthetic cache, its prompt (shared with decode_abab.py)."""
    p.add_argument("--big-layers", type=int, default=16)
    p.add_argument("--big-tokens", type=int, default=4000, help="rows of the large cache (default 4000: 4 x 250 MiB)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--attn-heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--model-dtype", default="float32", choices=sorted(DTYPES), help="float32 on CPU; bfloat16 on a GPU")
    p.add_argument("--context", type=int, default=4, help="prompt tokens prefilled before decoding (default 4)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=240, help="timed decode tokens per arm (default 240)")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--spills", type=int, default=4, help="spills per arm (default 4)")
    add_engine_args(p)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--cases", default="eviction,snapshot")
    p.add_argument("--arms", default="idle,mlxlm,spilld,spilld_views,scrub,scrub_daemon")
    p.add_argument("--scrub-mib", type=int, default=256, help="scrub arm: MiB of the store it checks (default 256)")
    p.add_argument(
        "--scrub-rate", type=int, default=32, help="scrub arm: MiB a second (default 32, the daemon's default)"
    )
    p.add_argument(
        "--dir", default=None, help="scratch folder on the disk under test (default: a temp folder in /var/tmp)"
    )
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="write a PNG of per-token latency (last round)")
    p.add_argument(
        "--smoke", action="store_true", help="seconds-long check that every arm runs: a tiny model and caches, 1 round"
    )
    p.add_argument(
        "--switch-interval", type=float, default=None, help="sys.setswitchinterval for the run (Python default 0.005 s)"
    )
    p.add_argument("--skip-1gib", action="store_true")
    args = p.parse_args()
    if args.smoke:
        args.tokens, args.warmup, args.spills, args.big_layers, args.big_tokens, args.rounds = 24, 4, 2, 2, 256, 1
        args.hidden, args.layers, args.vocab, args.scrub_mib = 64, 2, 512, 2
    folder = args.dir or tempfile.mkdtemp(prefix="spilld-bench-", dir="/var/tmp" if os.path.isdir("/var/tmp") else None)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    model = build_model(args)
    print(
        f"device {mx.default_device()}, big cache {args.big_layers} layers x {args.big_tokens} tokens "
        f"= {args.big_layers * args.big_tokens * args.heads * args.dim * 2 * 2 / MiB:.0f} MiB per spill, "
        f"{args.spills} spills per arm",
        flush=True,
    )
    rows: list[Result] = []
    summaries: list[dict[str, Any]] = []
    for rnd in range(args.rounds):
        arms = args.arms.split(",")
        arms = arms[rnd % len(arms) :] + arms[: rnd % len(arms)]
        for case in args.cases.split(","):
            for arm in arms:
                if (arm == "spilld_views" and case != "snapshot") or (arm.startswith("scrub") and case != "eviction"):
                    continue
                gc.collect()
                r = run_arm(arm, case, args, model, folder)
                s = r.summary() | {"round": rnd}
                summaries.append(s)
                if rnd == args.rounds - 1:
                    rows.append(r)
                print(
                    f"round {rnd} {case:9s} {arm:7s} p50 {s['p50_ms']:7.2f}  p99 {s['p99_ms']:8.2f}  max {s['max_ms']:8.2f} ms"
                    f"  after-spill {[round(x, 1) for x in r.after_spill_ms]}  spill() {[round(x, 2) for x in r.spill_call_ms]} ms"
                    f"  lease max {s['longest_lease_ms']:.2f} ms"
                    + (f"  {s['spill_GBps']:.2f} GB/s" if s["spill_GBps"] else "")
                    + (f"  scrubbed {r.scrubbed_bytes / MiB:.0f} MiB" if arm.startswith("scrub") else ""),
                    flush=True,
                )
    print("\nmedians over rounds:")
    table = []
    for case in args.cases.split(","):
        idle = [s for s in summaries if s["case"] == case and s["arm"] == "idle"]
        idle_p99 = statistics.median(s["p99_ms"] for s in idle) if idle else None
        for arm in args.arms.split(","):
            ss = [s for s in summaries if s["case"] == case and s["arm"] == arm]
            if not ss:
                continue
            p50 = statistics.median(s["p50_ms"] for s in ss)
            p99 = statistics.median(s["p99_ms"] for s in ss)
            mx_ = statistics.median(s["max_ms"] for s in ss)
            after = statistics.median(x for s in ss for x in s["after_spill_ms"]) if ss[0]["after_spill_ms"] else None
            normal = statistics.median(s["normal_median_ms"] for s in ss)
            row = {
                "case": case,
                "arm": arm,
                "p50_ms": p50,
                "p99_ms": p99,
                "max_ms": mx_,
                "p99_vs_idle": p99 / idle_p99 if idle_p99 else None,
                "after_spill_vs_normal": after / normal if after else None,
            }
            table.append(row)
            print(
                f"  {case:9s} {arm:7s} p50 {p50:7.2f}  p99 {p99:8.2f} ({row['p99_vs_idle'] or 0:.2f}x idle)  max {mx_:8.2f} ms"
                + (f"  step after spill {after:.2f} ms = {row['after_spill_vs_normal']:.2f}x normal" if after else "")
            )
    one_gib = None
    if args.smoke:  # the same code path on a cache of 2 MiB, every spill stored
        if spill_call_cost(folder, layers=2, tokens=1023)["not_stored"]:
            raise RuntimeError("spill() cost: a 2 MiB spill was not stored")
    elif not args.skip_1gib:
        one_gib = spill_call_cost(folder)
        print(
            f"\nspill() on the engine thread, 1 GiB cache: median {one_gib['median_ms']:.3f} ms, max {one_gib['max_ms']:.3f} ms"
        )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "runs": summaries, "table": table, "spill_call_1gib": one_gib}, f, indent=1)
    if args.plot:
        plot(rows, args.plot)
        print(f"plot: {args.plot}")
    shutil.rmtree(folder, ignore_errors=True)


if __name__ == "__main__":
    main()
