"""The shared tier (issue 15): time to first token on a host that has never seen a prompt, against a full prefill.

One ``redis-server`` (started here, on a free localhost port, no persistence) and two daemons as two hosts (each its
own folder and socket, ``--remote``, blocks of ``--block-tokens``). Host A prefills a prompt of ``--tokens`` tokens
on a tiny random-weight llama (``spilld.tinymodel``'s shape), spills it and waits until its pushes are done. Then,
run by run, arms alternating:

- prefill: a fresh cache, the whole prompt through the model, the first token sampled (greedy);
- remote: a fresh host B (an empty folder: a daemon started for the run) loads the prompt's prefix through the
  daemon's lookup, which fetches the blocks and manifest from Redis, checks every byte and keeps them; then the
  last token through the model and the first token sampled. The time includes the fill, the local write (fsync)
  and the verified load, not the daemon's start.
- local: the same load again on host B (its own disk now, warm).

The first token of the remote and local arms must equal the prefill's. Then Redis is stopped (SIGSTOP) and
``--lookups`` lookups of unknown prompts are timed on host A: each must come back a miss within the probe bound.

    python scripts/bench/remote_tier.py [--tokens 3000 --runs 5] [--smoke] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import mlx.core as mx
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

import spilld
from spilld.client import AsyncClient
from spilld.tinymodel import TinySpec

VOCAB = 256


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_redis(work: str) -> tuple[subprocess.Popen[bytes], str]:
    exe = shutil.which("redis-server")
    if exe is None:
        raise SystemExit("redis-server is not installed (scripts/test.sh installs it)")
    port = free_port()
    cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", work]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while True:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return proc, f"redis://127.0.0.1:{port}/0"
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


class Host:
    """A daemon with its own folder and socket."""

    def __init__(self, work: str, name: str, url: str, block_tokens: int) -> None:
        self.root = os.path.join(work, name)
        os.makedirs(self.root)
        self.socket = os.path.join(self.root, "s.sock")
        cmd = [sys.executable, "-m", "spilld", "--dir", os.path.join(self.root, "store"), "--socket", self.socket]
        cmd += ["--cap", "1GiB", "--block-tokens", str(block_tokens), "--remote", url]
        self.log = open(os.path.join(self.root, "log"), "wb")  # noqa: SIM115 (closed in stop)
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=self.log)
        deadline = time.monotonic() + 60
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"daemon {name} did not start: {open(self.log.name).read()[-2000:]}")
            time.sleep(0.02)

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.log.close()


def model_of(spec: TinySpec) -> Any:
    mx.random.seed(spec.seed)
    args = llama.ModelArgs(
        model_type="llama", hidden_size=spec.hidden, num_hidden_layers=spec.layers,
        intermediate_size=spec.intermediate, num_attention_heads=spec.heads, num_key_value_heads=spec.kv_heads,
        rms_norm_eps=1e-5, vocab_size=VOCAB, tie_word_embeddings=True,
    )  # fmt: skip
    m = llama.Model(args)
    mx.eval(m.parameters())
    return m


def first_token(model: Any, tokens: list[int], cache: list[Any]) -> int:
    out = model(mx.array(tokens)[None], cache=cache)
    tok = mx.argmax(out[0, -1])
    mx.eval(tok)
    return int(tok.item())


async def pushes_done(c: AsyncClient, timeout: float = 120.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        r = (await c.status())["remote"]
        if r["pushed"] and r["queue"]["len"] == 0 and r["pushing"] == 0:
            return dict(r)
        if time.monotonic() > deadline:
            raise RuntimeError(f"pushes not done: {r}")
        await asyncio.sleep(0.05)


async def restore_ttft(c: AsyncClient, model: Any, prompt: list[int]) -> tuple[float, int]:
    t0 = time.perf_counter()
    got = await c.load(prompt)
    if got is None or len(got.tokens) != len(prompt) - 1:
        raise RuntimeError(f"host B restored {None if got is None else len(got.tokens)} tokens")
    tok = first_token(model, prompt[len(got.tokens) :], got.caches)
    return time.perf_counter() - t0, tok


async def bench(args: argparse.Namespace, work: str) -> dict[str, Any]:
    spec = TinySpec(hidden=64, layers=2, intermediate=128) if args.smoke else TinySpec()
    model = model_of(spec)
    ident = spilld.model_identity(model, model_id="bench-remote")
    prompt = [(i * 7919 + 13) % VOCAB for i in range(args.tokens)]
    redis, url = start_redis(work)
    a = Host(work, "a", url, args.block_tokens)
    out: dict[str, Any] = {"tokens": args.tokens, "block_tokens": args.block_tokens, "spec": spec.__dict__}
    try:
        ca = await AsyncClient.open(a.socket, identity=ident, name="host-a")
        cache = make_prompt_cache(model)
        want = first_token(model, prompt, cache)
        # the cache host A keeps: the prompt less its last token, as an engine's spill after a request
        held = make_prompt_cache(model)
        first_token(model, prompt[:-1], held)
        if not (await ca.spill(prompt[:-1], held, droppable=False)).stored:
            raise RuntimeError("host A did not store the prompt")
        out["pushed"] = await pushes_done(ca)
        arms: dict[str, list[float]] = {"prefill": [], "remote": [], "local": []}
        for run in range(args.runs):
            t0 = time.perf_counter()
            if first_token(model, prompt, make_prompt_cache(model)) != want:
                raise RuntimeError("prefill disagrees with itself")
            arms["prefill"].append(time.perf_counter() - t0)
            b = Host(work, f"b{run}", url, args.block_tokens)
            try:
                cb = await AsyncClient.open(b.socket, identity=ident, name="host-b")
                for arm in ("remote", "local"):
                    s, tok = await restore_ttft(cb, model, prompt)
                    if tok != want:
                        raise RuntimeError(f"{arm}: first token {tok}, the prefill's {want}")
                    arms[arm].append(s)
                out.setdefault("host_b_remote", (await cb.status())["remote"])
                await cb.close()
            finally:
                b.stop()
        med = {k: statistics.median(v) for k, v in arms.items()}
        out["ttft_s"] = arms
        out["median_ms"] = {k: round(1e3 * v, 1) for k, v in med.items()}
        out["remote_over_prefill"] = round(med["remote"] / med["prefill"], 3)
        out["stopped_lookup_ms"] = await stopped_lookups(ca, redis, args.lookups)
        await ca.close()
    finally:
        a.stop()
        redis.send_signal(signal.SIGCONT)
        redis.kill()
        redis.wait()
    return out


async def stopped_lookups(c: AsyncClient, redis: subprocess.Popen[bytes], n: int) -> dict[str, float]:
    """Lookups of unknown prompts while Redis is stopped: each a miss, in about the probe bound."""
    redis.send_signal(signal.SIGSTOP)
    times = []
    try:
        for i in range(n):
            t0 = time.perf_counter()
            if isinstance(await c.lookup([(i * 31 + k) % VOCAB for k in range(500)]), spilld.Hit):
                raise RuntimeError("a hit with Redis stopped")
            times.append(1e3 * (time.perf_counter() - t0))
    finally:
        redis.send_signal(signal.SIGCONT)
    return {"p50": round(statistics.median(times), 2), "max": round(max(times), 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=3000, help="prompt tokens (default 3000)")
    p.add_argument("--runs", type=int, default=5, help="runs, arms alternating (default 5)")
    p.add_argument("--block-tokens", type=int, default=64, help="B of both hosts (default 64)")
    p.add_argument("--lookups", type=int, default=20, help="lookups timed with Redis stopped (default 20)")
    p.add_argument("--smoke", action="store_true", help="a small model, 300 tokens, 1 run (CI)")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args()
    if args.smoke:
        args.tokens, args.runs, args.lookups = 300, 1, 3
    work = tempfile.mkdtemp(prefix="spilld-bench-remote-")
    try:
        out = asyncio.run(bench(args, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    m = out["median_ms"]
    print(
        f"{out['tokens']} tokens, B={out['block_tokens']}, {args.runs} runs: time to first token, medians: "
        f"prefill {m['prefill']} ms, host B from Redis {m['remote']} ms ({out['remote_over_prefill']}x the "
        f"prefill), host B again from its disk {m['local']} ms; lookups with Redis stopped: "
        f"p50 {out['stopped_lookup_ms']['p50']} ms, max {out['stopped_lookup_ms']['max']} ms"
    )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
