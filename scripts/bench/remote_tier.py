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

Part ``throughput``: a synthetic cache (``--tp-layers`` layers of K and V f16 ``(1, 8, T, 128)``, ``--tp-mib`` MiB)
spilled on host A; per run a fresh host B restores it through Redis (fill and load, every hash checked), then again
from its own disk (warm), and host A from its disk (warm); GB/s of cache bytes, medians. Beside them, the
machine's ceiling for this path (``raw``): every value Redis holds for the cache read over one plain socket,
pipelined GETs, each reply received into a buffer allocated once (no client library, no check, no write): what
any client could fetch over this loopback from this Redis.

Part ``shared``: 10 conversations sharing a ``--system-tokens`` system prompt, 5 spilled on each of two hosts
(synthetic caches whose system rows are the same bytes); bytes pushed by both hosts against the bytes Redis holds
(each key once) and against what the hosts wrote to their disks (what a tier without probes would upload).

    python scripts/bench/remote_tier.py [--parts ttft,throughput,shared] [--tokens 3000 --runs 5] [--smoke]
        [--json out.json]
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
from mlx_lm.models import cache as C
from mlx_lm.models import llama
from mlx_lm.models.cache import make_prompt_cache

import spilld
from spilld.client import AsyncClient
from spilld.daemon.listen import is_served
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
        while not is_served(self.socket):  # accepting, not only bound (a refused connect raced the listen)
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"daemon {name} did not start (its log: {self.log.name})")
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
        if r["pushed"] + r["push_present"] and r["queue"]["len"] == 0 and r["pushing"] == 0:
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


def kv(layers: int, tokens: int, seed: int, heads: int = 8, dim: int = 128) -> list[Any]:
    out = []
    for i in range(layers):
        c = C.KVCache()
        mx.random.seed(seed * 1000 + i)
        c.update_and_fetch(*(mx.random.normal((1, heads, tokens, dim)).astype(mx.float16) for _ in range(2)))
        mx.eval(c.keys, c.values)
        out.append(c)
    return out


def joined(a: list[Any], b: list[Any]) -> list[Any]:
    """Caches holding ``a``'s rows then ``b``'s (a system prompt's rows, then a conversation's own)."""
    out = []
    for x, y in zip(a, b, strict=True):
        c = C.KVCache()
        k = mx.concatenate([x.keys[..., : x.offset, :], y.keys[..., : y.offset, :]], axis=2)
        v = mx.concatenate([x.values[..., : x.offset, :], y.values[..., : y.offset, :]], axis=2)
        c.update_and_fetch(k, v)
        mx.eval(c.keys, c.values)
        out.append(c)
    return out


def raw_get_seconds(url: str) -> tuple[float, int]:
    """Seconds to fetch every string value of ``spilld:*`` with pipelined GETs over a plain socket, and their bytes.
    Each reply's header is checked against the value's length (a value gone or changed meanwhile fails the arm)."""
    import redis

    r = redis.Redis.from_url(url)
    sizes = {k: int(r.strlen(k)) for k in r.scan_iter("spilld:*") if r.type(k) == b"string"}
    r.close()
    if not sizes:
        raise RuntimeError("redis holds no value to fetch")
    host, port = url.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    cmds = b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k) for k in sizes)
    buf = memoryview(bytearray(max(sizes.values()) + 2))
    with socket.create_connection((host, int(port)), timeout=30) as s, s.makefile("rb", buffering=0) as f:
        t0 = time.perf_counter()
        s.sendall(cmds)
        for n in sizes.values():
            head = f.readline()  # unbuffered: one byte a call, a few calls a value
            if head != b"$%d\r\n" % n:
                raise RuntimeError(f"redis answered {head[:40]!r} for a value of {n} bytes")
            got = 0
            while got < n + 2:
                k = s.recv_into(buf[got : n + 2])
                if k == 0:
                    raise RuntimeError("redis closed the connection")
                got += k
        return time.perf_counter() - t0, sum(sizes.values())


async def throughput(args: argparse.Namespace, work: str, url: str) -> dict[str, Any]:
    per_token = args.tp_layers * 2 * 8 * 128 * 2
    tokens = max(args.block_tokens * 2, args.tp_mib * 2**20 // per_token)
    ident = spilld.Identity("bench-remote-throughput")
    caches = kv(args.tp_layers, tokens, seed=1)
    nbytes = per_token * tokens
    prompt = [*range(tokens), 0]
    import redis

    with redis.Redis.from_url(url) as r:
        r.flushall()  # the raw arm reads every value Redis holds: only this part's
    a = Host(work, "tp-a", url, args.block_tokens)
    arms: dict[str, list[float]] = {"remote": [], "b_local": [], "a_local": [], "raw": []}
    raw_bytes = 0
    try:
        ca = await AsyncClient.open(a.socket, identity=ident, name="tp-a")
        if not (await ca.spill(prompt[:-1], caches, droppable=False)).stored:
            raise RuntimeError("host A did not store the cache")
        del caches
        await pushes_done(ca)
        for run in range(args.runs):
            b = Host(work, f"tp-b{run}", url, args.block_tokens)
            try:
                cb = await AsyncClient.open(b.socket, identity=ident, name="tp-b")
                for arm, c in (("remote", cb), ("b_local", cb), ("a_local", ca)):
                    t0 = time.perf_counter()
                    got = await c.load(prompt)
                    arms[arm].append(time.perf_counter() - t0)
                    if got is None or len(got.tokens) != tokens:
                        raise RuntimeError(f"{arm}: {None if got is None else len(got.tokens)} tokens restored")
                    del got
                await cb.close()
            finally:
                b.stop()
            seconds, raw_bytes = raw_get_seconds(url)
            arms["raw"].append(seconds * nbytes / raw_bytes)  # scaled to the cache's bytes: the same GB/s
        await ca.close()
    finally:
        a.stop()
    gbs = {k: round(nbytes / 1e9 / statistics.median(v), 3) for k, v in arms.items()}
    return {
        "bytes": nbytes, "tokens": tokens, "seconds": arms, "gb_s": gbs,
        "remote_over_local": round(gbs["remote"] / gbs["b_local"], 3), "raw_bytes": raw_bytes,
        "remote_over_raw": round(gbs["remote"] / gbs["raw"], 3),
    }  # fmt: skip


async def shared(args: argparse.Namespace, work: str, url: str, redis_port: int) -> dict[str, Any]:
    import redis

    with redis.Redis(host="127.0.0.1", port=redis_port) as r:
        r.flushall()  # only this part's keys are counted
    ident = spilld.Identity("bench-remote-shared")
    layers = 4
    system = kv(layers, args.system_tokens, seed=7, heads=2, dim=64)
    sys_tokens = list(range(10_000, 10_000 + args.system_tokens))
    hosts = [Host(work, f"sh-{i}", url, args.block_tokens) for i in range(2)]
    out: dict[str, Any] = {"system_tokens": args.system_tokens, "conversations": 10}
    try:
        clients = [await AsyncClient.open(h.socket, identity=ident, name=f"sh-{i}") for i, h in enumerate(hosts)]
        for n in range(10):
            own = kv(layers, args.conv_tokens, seed=100 + n, heads=2, dim=64)
            toks = [*sys_tokens, *range(20_000 + 1000 * n, 20_000 + 1000 * n + args.conv_tokens)]
            done = await clients[n % 2].spill(toks, joined(system, own), droppable=False)
            if not done.stored:
                raise RuntimeError(f"conversation {n} not stored: {done}")
            await pushes_done(clients[n % 2])
        stats = [await c.status() for c in clients]
        for c in clients:
            await c.close()
    finally:
        for h in hosts:
            h.stop()
    with redis.Redis(host="127.0.0.1", port=redis_port) as r:
        held = sum(int(r.strlen(k)) for k in r.scan_iter("spilld:*") if r.type(k) == b"string")
    pushed = sum(s["remote"]["bytes_pushed"] for s in stats)
    written = sum(s["store"]["bytes_written"] for s in stats)
    out |= {
        "bytes_pushed": pushed, "bytes_in_redis": held, "bytes_written_by_hosts": written,
        "pushed_over_unique": round(pushed / held, 3), "written_over_unique": round(written / held, 3),
        "push_present": sum(s["remote"]["push_present"] for s in stats),
    }  # fmt: skip
    return out


async def bench(args: argparse.Namespace, work: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    redis, url = start_redis(work)
    try:
        if "ttft" in args.parts:
            out["ttft"] = await ttft(args, work, url, redis)
        if "throughput" in args.parts:
            out["throughput"] = await throughput(args, work, url)
        if "shared" in args.parts:
            out["shared"] = await shared(args, work, url, int(url.rsplit(":", 1)[1].split("/")[0]))
    finally:
        redis.send_signal(signal.SIGCONT)
        redis.kill()
        redis.wait()
    return out


async def ttft(args: argparse.Namespace, work: str, url: str, redis: subprocess.Popen[bytes]) -> dict[str, Any]:
    spec = TinySpec(hidden=64, layers=2, intermediate=128) if args.smoke else TinySpec()
    model = model_of(spec)
    ident = spilld.model_identity(model, model_id="bench-remote")
    prompt = [(i * 7919 + 13) % VOCAB for i in range(args.tokens)]
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
    p.add_argument("--parts", type=lambda s: s.split(","), default=["ttft", "throughput", "shared"])
    p.add_argument("--tp-layers", type=int, default=32, help="throughput: layers of the synthetic cache")
    p.add_argument("--tp-mib", type=int, default=256, help="throughput: MiB of the synthetic cache (default 256)")
    p.add_argument("--system-tokens", type=int, default=2000, help="shared: tokens of the system prompt")
    p.add_argument("--conv-tokens", type=int, default=300, help="shared: each conversation's own tokens")
    p.add_argument("--smoke", action="store_true", help="small sizes, 1 run (CI)")
    p.add_argument("--json", default=None, help="write the figures here")
    args = p.parse_args()
    if args.smoke:
        args.tokens, args.runs, args.lookups, args.tp_layers, args.tp_mib = 300, 1, 3, 2, 4
        args.system_tokens, args.conv_tokens = 200, 40
    work = tempfile.mkdtemp(prefix="spilld-bench-remote-")
    try:
        out = asyncio.run(bench(args, work))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if "ttft" in out:
        t = out["ttft"]
        m = t["median_ms"]
        print(
            f"ttft: {t['tokens']} tokens, B={t['block_tokens']}, {args.runs} runs, medians: prefill {m['prefill']} ms, "
            f"host B from Redis {m['remote']} ms ({t['remote_over_prefill']}x the prefill), host B again from its "
            f"disk {m['local']} ms; lookups with Redis stopped: p50 {t['stopped_lookup_ms']['p50']} ms, "
            f"max {t['stopped_lookup_ms']['max']} ms"
        )
    if "throughput" in out:
        t = out["throughput"]
        print(
            f"throughput: {t['bytes'] / 2**20:.0f} MiB, {args.runs} runs, medians GB/s: host B through Redis "
            f"{t['gb_s']['remote']}, host B from its disk {t['gb_s']['b_local']}, host A from its disk "
            f"{t['gb_s']['a_local']}; Redis / local {t['remote_over_local']}x; raw GETs over a plain socket (the "
            f"ceiling) {t['gb_s']['raw']}, Redis / raw {t['remote_over_raw']}x"
        )
    if "shared" in out:
        s = out["shared"]
        print(
            f"shared: 10 conversations, a {s['system_tokens']}-token system prompt, 2 hosts: pushed "
            f"{s['bytes_pushed'] / 2**20:.1f} MiB, Redis holds {s['bytes_in_redis'] / 2**20:.1f} MiB "
            f"({s['pushed_over_unique']}x); the hosts wrote {s['bytes_written_by_hosts'] / 2**20:.1f} MiB "
            f"({s['written_over_unique']}x)"
        )
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
