"""Wear: bytes written and bytes kept on disk per byte of cache, with prefix blocks of B tokens (issue 14).

    python scripts/bench/chat_wear.py --json bench-out/wear.json            # B = 64, 128, 256; all three parts
    python scripts/bench/chat_wear.py --blocks 0,256 --parts chat           # B = 0: every entry whole (v1 style)
    python scripts/bench/chat_wear.py --smoke

Three parts, each run once per block size B (``--blocks``), arms side by side in one table:

chat: mlx-lm's own HTTP server with spilld as its cold tier (``python -m spilld.integrations.mlx_lm --spilld-socket``)
and a spilld daemon (``spilld serve --block-tokens B``), both subprocesses on this machine, the tiny random-weight
model (``spilld.tinymodel``, nothing downloaded). This script is the chat client: a K-turn chat over
``/v1/chat/completions`` on localhost, greedy. One server and daemon per B, the chats side by side (a thread each;
the model uses about one core), so an arm's seconds are not a speed figure. The spills are the integration's own:
one after each prompt's prefill (the user segment, all but the last prompt token) and one after each generation.
Each request re-renders the whole conversation through the chat template, the previous answers included. Two
things keep that rendering what a real model's would be: the generated ids are held to printable ASCII (a
``logit_bias`` on every other id), so the text the client gets back encodes to the same ids (a random model's
bytes are mostly invalid UTF-8, which would make every answer diverge where it starts), and the client sends each
answer back without its last ``--trim`` characters, as a template that trims the content or renders the end of a
turn differently from what the model generated (an end-of-turn or stop token) does: each turn's cache then shares
the previous one's prefix except its last few tokens. Figures are taken after turn K (12 and 40), once the daemon
has stored every spill: store stats ``bytes_written`` and ``bytes`` (on disk, each block once) from the daemon's
``status``, and the final conversation's cache bytes: the sum of its arrays' live rows (the tokens of the longest
stored entry x the bytes a token, measured on a real prefill of the model).

synthetic: an 8B-shaped cache without a model: 32 layers of ``KVCache``, 8 KV heads, head dim 128, float16
(128 KiB a token), 32k tokens over 40 turns, each turn a prefill of ~410 new tokens (spilled, all but the
last prompt token) and a generation of ~410 (spilled), the next prompt sharing everything but the last
``--trim`` tokens of the previous answer. The engine is this script: it trims its cache to the shared prefix and
appends new rows, as mlx-lm does. Spills are ``Store.put`` in this process, awaited one by one (no queue, so none
is shed): the store's write path is what is measured. ~4 GiB at the end: full mode only (``--smoke`` runs a small
shape); ``--durability none`` is allowed and printed with the figures (compare like with like).

shared: ten conversations that share a 2,000-token system prompt (same 8B shape, ``Store.put`` in this process).
The first spills the system segment, as the server does when its memory tier does not have it; each then spills
after its prefill and after its generation. Disk bytes against the unique bytes (every distinct token prefix
counted once) and against what the ten conversations hold in all.

Targets (issue 14): written <= 1.3x and on disk <= 1.2x the final conversation's cache, at 12 and 40 turns;
shared: disk <= 1.1x the unique bytes. Exit status 0 only when every arm ran, nothing was shed or failed, and
the final conversation is stored whole.
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import gc
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import mlx.core as mx
from mlx_lm.models import cache as C

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import spilld
from spilld.client import Client
from spilld.loader import read_header
from spilld.store import Store, list_entries
from spilld.tinymodel import TinySpec, model_config, write_tiny_model
from tests.daemons import Daemon

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MiB = 1024 * 1024
TARGET_WRITTEN, TARGET_DISK, TARGET_SHARED = 1.3, 1.2, 1.1


@dataclass
class Wear:
    """One figure: what a store wrote and kept for a conversation (or a set of them) of ``cache`` bytes."""

    part: str
    block_tokens: int
    turns: int
    tokens: int  # tokens the final conversation's cache holds
    spills: int
    written: int  # store stats bytes_written
    disk: int  # store stats bytes (each block once)
    cache: int  # the final conversation's cache bytes (shared: the unique bytes)
    entries: int
    blocks: int
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def write_amp(self) -> float:
        return self.written / self.cache

    @property
    def disk_amp(self) -> float:
        return self.disk / self.cache


def mib(n: float) -> str:
    return f"{n / MiB:,.1f}"


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


def rows_on_disk(root: str) -> tuple[int, int]:
    """(file bytes, tensor bytes) of every manifest and block under a store folder: the rest is headers and padding
    (each tensor starts at a 16 KiB boundary). Read-only, safe beside a running daemon."""
    files = data = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            if not name.endswith((".spilld", ".spilld-block")):
                continue
            path = os.path.join(dirpath, name)
            try:
                data += read_header(path).data_bytes
                files += os.stat(path).st_size
            except (spilld.SpillError, OSError):
                continue  # removed (superseded) while we read
    return files, data


def unique_positions(convs: Sequence[Sequence[int]]) -> int:
    """Distinct token prefixes of a set of token lists (the nodes of their trie): what shared blocks could hold once."""
    s = sorted(tuple(c) for c in convs)
    return sum(len(x) for x in s) - sum(common_prefix(s[i - 1], s[i]) for i in range(1, len(s)))


# --- chat: the mlx-lm server with its cold tier, and a daemon -------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def live_bytes(caches: Sequence[Any]) -> int:
    """The bytes of a list of KVCaches' live rows (their buffers also hold step capacity past the offset)."""
    return sum(a.nbytes // a.shape[2] * c.offset for c in caches for a in (c.keys, c.values) if c.offset)


def tiny_bytes_per_token(spec: TinySpec) -> int:
    """Bytes of live cache rows a token, measured: a prefill of 8 tokens through the model, its state summed."""
    from mlx_lm.models import llama

    model = llama.Model(llama.ModelArgs.from_dict(model_config(spec)))
    model.set_dtype(mx.float32)  # as write_tiny_model saves it
    cache = C.make_prompt_cache(model)
    mx.eval(model(mx.array([list(range(8))]), cache=cache))
    assert all(isinstance(c, C.KVCache) for c in cache), cache
    total = live_bytes(cache)
    assert total % 8 == 0
    return total // 8


def user_message(turn: int, chars: int) -> str:
    words = ["the", "cold", "tier", "keeps", "long", "prompts", "warm", "across", "restarts", "while", "decode"]
    rng = random.Random(turn)
    text = f"Question {turn}:"
    while len(text) < chars:
        text += " " + rng.choice(words)
    return text[:chars]


def ascii_only_bias(vocab: int) -> dict[str, float]:
    """A logit bias that leaves printable ASCII but '<' (no special-token text): the answer re-encodes to its ids."""
    allowed = set(range(32, 127)) - {ord("<")}
    return {str(t): -1000.0 for t in range(vocab) if t not in allowed}


class ChatArm:
    """A daemon with ``--block-tokens B`` and mlx-lm's server using it as its cold tier; this is the chat client."""

    def __init__(self, b: int, model_dir: str, work: str, durability: str) -> None:
        self.b = b
        self.root = tempfile.mkdtemp(prefix=f"cw{b}-", dir="/tmp")  # short: AF_UNIX path limit
        self.daemon = Daemon(self.root, ["--block-tokens", str(b), "--durability", durability])
        self.port = free_port()
        self.server_log = os.path.join(work, f"server-B{b}.log")
        self.model_dir = model_dir
        self.server: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.daemon.start(wait=False)

    def start_server(self) -> None:
        self.daemon.wait_ready(60)
        cmd = [
            sys.executable,
            "-m",
            "spilld.integrations.mlx_lm",
            "--model",
            self.model_dir,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--spilld-socket",
            self.daemon.socket,
        ]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))}
        with open(self.server_log, "ab") as f:
            self.server = subprocess.Popen(cmd, stdout=f, stderr=f, env=env, start_new_session=True)

    def wait_ready(self, timeout: float = 180.0) -> None:
        assert self.server is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.server.poll() is not None:
                raise RuntimeError(f"server exited {self.server.returncode}:\n{self.read_log()[-4000:]}")
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=2).read()
                return
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.2)
        raise TimeoutError(self.read_log()[-4000:])

    def read_log(self) -> str:
        try:
            with open(self.server_log) as f:
                return f.read()
        except FileNotFoundError:
            return ""

    def chat(self, messages: list[dict[str, str]], max_tokens: int, bias: dict[str, float]) -> dict[str, Any]:
        body = {"messages": messages, "max_tokens": max_tokens, "temperature": 0.0, "logit_bias": bias}
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/v1/chat/completions",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=600) as r:
            return dict(json.loads(r.read()))

    def settled(self, at_least: int, timeout: float = 120.0) -> dict[str, Any]:
        """The daemon's status once it has settled ``at_least`` spills, nothing is pending, and nothing moves."""
        deadline = time.monotonic() + timeout
        last: tuple[int, ...] | None = None
        while time.monotonic() < deadline:
            with Client(self.daemon.socket, identity=spilld.Identity("chat-wear-probe")) as probe:  # the daemon
                st = probe.status()  # cuts a connection silent for minutes, so one a call
            q = st["queue"]
            done = q["stored"] + q["dropped"] + q["failed"] + q["cancelled"]
            mark = (done, q["pending_items"], st["ingest"]["open_spills"], st["store"]["bytes_written"])
            if done >= at_least and not q["pending_items"] and not st["ingest"]["open_spills"] and mark == last:
                return st
            last = mark
            time.sleep(0.3)
        raise TimeoutError(f"the daemon settled {last} of {at_least} spills in {timeout:.0f} s")

    def stop(self) -> None:
        if self.server is not None and self.server.poll() is None:
            self.server.send_signal(signal.SIGTERM)  # the wrapper drains its tier, then exits
            try:
                self.server.wait(120)
            except subprocess.TimeoutExpired:
                self.server.kill()
                self.server.wait()
        self.daemon.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def run_chat(arm: ChatArm, args: argparse.Namespace, bpt: int, vocab: int) -> tuple[list[Wear], list[str]]:
    """The K-turn chat against one arm; a Wear at every checkpoint. Returns the answers too (same in every arm?)."""
    bias = ascii_only_bias(vocab)
    messages: list[dict[str, str]] = []
    answers: list[str] = []
    out: list[Wear] = []
    t0 = time.perf_counter()
    for turn in range(1, max(args.chat_turns) + 1):
        messages.append({"role": "user", "content": user_message(turn, args.user_chars)})
        r = arm.chat(messages, args.answer_tokens, bias)
        answer = r["choices"][0]["message"]["content"]
        usage = r["usage"]
        if usage["completion_tokens"] != args.answer_tokens or not answer.isascii():
            raise RuntimeError(f"turn {turn}: {usage['completion_tokens']} tokens, ascii {answer.isascii()}")
        answers.append(answer)
        messages.append({"role": "assistant", "content": answer[: len(answer) - args.trim]})
        if turn not in args.chat_turns:
            continue
        st = arm.settled(2 * turn)
        wall = time.perf_counter() - t0
        q, s = st["queue"], st["store"]
        # the generation's spill: what the server's cache holds (prompt and answer; its last token fed or not)
        held = max((e["tokens"] for e in list_entries(arm.daemon.dir)), default=0)
        sent = usage["prompt_tokens"] + usage["completion_tokens"]
        if held not in (sent - 1, sent):
            raise RuntimeError(f"B={arm.b} turn {turn}: the longest entry holds {held} tokens, the chat {sent}")
        out.append(
            Wear(
                "chat",
                arm.b,
                turn,
                held,
                q["stored"],
                s["bytes_written"],
                s["bytes"],
                held * bpt,
                s["entries"],
                s["blocks"],
                wall,
                {
                    "dropped": q["dropped"],
                    "failed": q["failed"],
                    "cancelled": q["cancelled"],
                    "disk_tensor_bytes": rows_on_disk(arm.daemon.dir)[1],
                    "superseded": s["superseded"],
                    "blocks_written": s["blocks_written"],
                    "blocks_reused": s["blocks_reused"],
                    "prompt_tokens": usage["prompt_tokens"],
                    "held_bytes": st["ingest"]["held_bytes"],  # tensor bytes the client did not send (held blocks)
                    "unique_added": s["unique_added"],
                },
            )
        )
    return out, answers


def chat_part(args: argparse.Namespace, work: str) -> tuple[list[Wear], list[str]]:
    spec = TinySpec(hidden=64, layers=2, intermediate=128) if args.smoke else TinySpec()
    model_dir = write_tiny_model(os.path.join(work, "tiny"), spec)
    bpt = tiny_bytes_per_token(spec)
    vocab = int(str(model_config(spec)["vocab_size"]))
    print(
        f"\nchat: mlx-lm server + spilld daemon (subprocesses, HTTP on localhost), tiny model {spec.layers} layers "
        f"hidden {spec.hidden} f32 ({bpt} B a token), ~{args.user_chars + args.answer_tokens + 19 - args.trim} new "
        f"tokens a turn ({args.user_chars}-char user message, {args.answer_tokens} generated, {args.trim} chars of "
        f"each answer not re-rendered), durability {args.durability}",
        flush=True,
    )
    arms = [ChatArm(b, model_dir, work, args.durability) for b in args.blocks]
    results: list[Wear] = []
    notes: list[str] = []
    try:
        for a in arms:  # daemons, then servers, all starting side by side: their imports overlap
            a.start()
        for a in arms:
            a.start_server()
        for a in arms:
            a.wait_ready()
        with concurrent.futures.ThreadPoolExecutor(len(arms)) as pool:  # side by side: the model is single-threaded
            done = list(pool.map(lambda a: run_chat(a, args, bpt, vocab), arms))
        transcripts = []
        for rows, answers in done:
            results += rows
            transcripts.append(answers)
            for w in rows:
                print(
                    f"  B={w.block_tokens:<4} after turn {w.turns:>3}: {w.spills} spills, {mib(w.written)} MiB "
                    f"written, {mib(w.disk)} MiB on disk, cache {mib(w.cache)} MiB, not sent (held) "
                    f"{mib(w.extra['held_bytes'])} MiB ({w.wall_s:.1f} s)",
                    flush=True,
                )
        same = all(t == transcripts[0] for t in transcripts)
        notes.append(f"chat: the same answers in every arm: {'yes' if same else 'NO'}")
    finally:
        for a in arms:
            a.stop()
    return results, notes


# --- synthetic: an 8B-shaped cache, Store.put in this process ---------------------------------------------------------


@dataclass(frozen=True)
class Shape:
    layers: int
    heads: int
    dim: int
    dtype: Any = mx.float16

    @property
    def bytes_per_token(self) -> int:
        return self.layers * 2 * self.heads * self.dim * self.dtype.size


class Engine:
    """The engine's side: one cache (KVCache buffers allocated once), trimmed to a shared prefix and extended."""

    def __init__(self, shape: Shape, capacity: int, seed: int) -> None:
        self.shape = shape
        self.caches: list[Any] = []
        for _ in range(shape.layers):
            c = C.KVCache()
            c.keys = mx.zeros((1, shape.heads, capacity, shape.dim), shape.dtype)
            c.values = mx.zeros((1, shape.heads, capacity, shape.dim), shape.dtype)
            self.caches.append(c)
        mx.eval([x for c in self.caches for x in (c.keys, c.values)])
        self.tokens: list[int] = []  # the ids the cache holds
        mx.random.seed(seed)

    def feed(self, tokens: list[int]) -> None:
        """Reuse the longest shared prefix, then append rows for the rest (random values; one chunk for all layers)."""
        keep = common_prefix(self.tokens, tokens)
        for c in self.caches:
            c.trim(c.offset - keep)
        n = len(tokens) - keep
        if n:
            chunk = mx.random.normal((1, self.shape.heads, n, self.shape.dim)).astype(self.shape.dtype)
            for c in self.caches:
                c.update_and_fetch(chunk, chunk)
            mx.eval([x for c in self.caches for x in (c.keys, c.values)])
        self.tokens = list(tokens)


class TokenIds:
    """Fresh token ids, seeded: each call gives ``n`` ids no other call repeats in the same order."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)

    def __call__(self, n: int) -> list[int]:
        return [self.rng.randrange(1 << 17) for _ in range(n)]


def new_store(root: str, b: int, durability: str) -> Store:
    store = Store(root, durability=durability, block_tokens=b, disk_cap=1 << 60)
    store.scan()
    return store


async def spill(store: Store, engine: Engine, ident: spilld.Identity) -> None:
    await store.put(list(engine.tokens), engine.caches, ident)


def check_stored(store: Store, tokens: Sequence[int], what: str) -> None:
    """The final conversation is indexed whole: a lookup of it plus one token matches all of it."""
    hit = store.lookup(spilld.Identity(what), "", [*tokens, 0])
    matched = getattr(hit, "matched", 0)
    if matched != len(tokens):
        raise RuntimeError(f"{what}: the final conversation ({len(tokens)} tokens) is not stored whole: {hit}")


def wear_of(part: str, b: int, turns: int, store: Store, engine: Engine, spills: int, t0: float) -> Wear:
    s = store.stats()
    return Wear(
        part,
        b,
        turns,
        len(engine.tokens),
        spills,
        s["bytes_written"],
        s["bytes"],
        live_bytes(engine.caches),
        s["entries"],
        s["blocks"],
        time.perf_counter() - t0,
        {
            "superseded": s["superseded"],
            "blocks_written": s["blocks_written"],
            "blocks_reused": s["blocks_reused"],
            "disk_tensor_bytes": rows_on_disk(store.root)[1],
        },
    )


async def synthetic_arm(b: int, args: argparse.Namespace, shape: Shape, root: str) -> list[Wear]:
    turns = max(args.synth_turns)
    per_turn = args.synth_tokens // turns
    user, answer = per_turn // 2, per_turn - per_turn // 2
    ids = TokenIds(1)
    store = new_store(root, b, args.durability)
    ident = spilld.Identity("chat-wear-8b")
    engine = Engine(shape, turns * per_turn + 64, seed=b)
    history: list[int] = []
    out: list[Wear] = []
    spills = 0
    t0 = time.perf_counter()
    for turn in range(1, turns + 1):
        prompt = history + ids(user)
        engine.feed(prompt[:-1])  # prefill: all but the last prompt token
        await spill(store, engine, ident)
        gen = ids(answer)
        engine.feed(prompt + gen[:-1])  # generation: the last token sampled is never fed
        await spill(store, engine, ident)
        spills += 2
        # the next prompt re-renders this answer but its last tokens (an end-of-turn the template writes its way)
        history = prompt + gen[: answer - args.trim] + ids(args.trim)
        if turn in args.synth_turns:
            out.append(wear_of("synthetic", b, turn, store, engine, spills, t0))
    check_stored(store, engine.tokens, "chat-wear-8b")
    del engine
    gc.collect()
    mx.clear_cache()
    return out


async def shared_arm(b: int, args: argparse.Namespace, shape: Shape, root: str) -> Wear:
    ids = TokenIds(2)
    system = ids(args.system_tokens)
    store = new_store(root, b, args.durability)
    ident = spilld.Identity("chat-wear-shared")
    engine = Engine(shape, args.system_tokens + args.conv_user + args.conv_answer + 64, seed=b + 1)
    finals: list[list[int]] = []
    spills = 0
    t0 = time.perf_counter()
    for i in range(args.conversations):
        prompt = system + ids(args.conv_user)
        if i == 0:  # the system segment: spilled on its own when the memory tier does not have it yet
            engine.feed(system)
            await spill(store, engine, ident)
            spills += 1
        engine.feed(prompt[:-1])
        await spill(store, engine, ident)
        gen = ids(args.conv_answer)
        engine.feed(prompt + gen[:-1])
        await spill(store, engine, ident)
        spills += 2
        finals.append(list(engine.tokens))
    for f in finals:
        check_stored(store, f, "chat-wear-shared")
    w = wear_of("shared", b, args.conversations, store, engine, spills, t0)
    w.extra["all_conversations"] = sum(len(f) for f in finals) * shape.bytes_per_token
    w.cache = unique_positions(finals) * shape.bytes_per_token  # the unique bytes
    del engine
    gc.collect()
    mx.clear_cache()
    return w


def store_part(args: argparse.Namespace, work: str) -> list[Wear]:
    shape = Shape(4, 2, 64) if args.smoke else Shape(32, 8, 128)
    results: list[Wear] = []
    if "synthetic" in args.parts:
        total = (args.synth_tokens // max(args.synth_turns)) * max(args.synth_turns)
        print(
            f"\nsynthetic: {shape.layers} layers of KVCache, {shape.heads} KV heads, head dim {shape.dim}, f16 "
            f"({shape.bytes_per_token // 1024} KiB a token), {total} tokens over {max(args.synth_turns)} turns, "
            f"{args.trim} tokens of each answer not re-rendered; Store.put in this process, durability "
            f"{args.durability}",
            flush=True,
        )
        for b in args.blocks:
            root = os.path.join(work, f"synthetic-B{b}")
            try:
                rows = asyncio.run(synthetic_arm(b, args, shape, root))
            finally:
                shutil.rmtree(root, ignore_errors=True)
            for w in rows:
                print(
                    f"  B={b:<4} after turn {w.turns:>3}: {mib(w.written)} MiB written, {mib(w.disk)} MiB on disk, "
                    f"cache {mib(w.cache)} MiB ({w.wall_s:.1f} s)",
                    flush=True,
                )
            results += rows
    if "shared" in args.parts:
        print(
            f"\nshared: {args.conversations} conversations, a {args.system_tokens}-token system prompt, then "
            f"{args.conv_user} tokens of user prompt and {args.conv_answer} generated each; same shape; Store.put in "
            f"this process, durability {args.durability}",
            flush=True,
        )
        for b in args.blocks:
            root = os.path.join(work, f"shared-B{b}")
            try:
                w = asyncio.run(shared_arm(b, args, shape, root))
            finally:
                shutil.rmtree(root, ignore_errors=True)
            print(f"  B={b:<4}: {mib(w.disk)} MiB on disk, unique {mib(w.cache)} MiB ({w.wall_s:.1f} s)", flush=True)
            results.append(w)
    return results


# --- report ----------------------------------------------------------------------------------------------------------


def verdict(ok: bool) -> str:
    return "met" if ok else "MISSED"


def report(results: list[Wear], blocks: list[int]) -> None:
    wear = [w for w in results if w.part in ("chat", "synthetic")]
    if wear:
        print(
            "\n| part | B | turns | tokens | spills | written MiB | on disk MiB | cache MiB | written / cache "
            "| disk / cache | on disk: tensors, headers + padding MiB | entries | blocks |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for w in wear:
            print(
                f"| {w.part} | {w.block_tokens} | {w.turns} | {w.tokens} | {w.spills} | {mib(w.written)} | "
                f"{mib(w.disk)} | {mib(w.cache)} | **{w.write_amp:.3f}** ({verdict(w.write_amp <= TARGET_WRITTEN)}) | "
                f"**{w.disk_amp:.3f}** ({verdict(w.disk_amp <= TARGET_DISK)}) | {mib(w.extra['disk_tensor_bytes'])}, "
                f"{mib(w.disk - w.extra['disk_tensor_bytes'])} | {w.entries} | {w.blocks} |"
            )
    shared = [w for w in results if w.part == "shared"]
    if shared:
        print(
            "\n| shared | B | conversations | spills | written MiB | on disk MiB | unique MiB "
            "| all conversations hold MiB | disk / unique | on disk: tensors, headers + padding MiB | entries | blocks |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for w in shared:
            print(
                f"| shared | {w.block_tokens} | {w.turns} | {w.spills} | {mib(w.written)} | {mib(w.disk)} | "
                f"{mib(w.cache)} | {mib(w.extra['all_conversations'])} | **{w.disk_amp:.3f}** "
                f"({verdict(w.disk_amp <= TARGET_SHARED)}) | {mib(w.extra['disk_tensor_bytes'])}, "
                f"{mib(w.disk - w.extra['disk_tensor_bytes'])} | {w.entries} | {w.blocks} |"
            )
    # one line per B: every target at a glance, so the default B can be chosen
    cols = sorted({(w.part, w.turns) for w in wear})
    heads = [f"{part} {turns}: written, disk" for part, turns in cols] + (["shared: disk / unique"] if shared else [])
    print("\n| B | " + " | ".join(heads) + " |")
    print("|---|" + "---|" * len(heads))
    for b in blocks:
        cells = []
        for part, turns in cols:
            got = next((x for x in wear if x.part == part and x.turns == turns and x.block_tokens == b), None)
            cells.append("-" if got is None else f"{got.write_amp:.2f}x, {got.disk_amp:.2f}x")
        if shared:
            sh = next((x for x in shared if x.block_tokens == b), None)
            cells.append("-" if sh is None else f"{sh.disk_amp:.3f}x")
        print(f"| {b} | " + " | ".join(cells) + " |")
    print(f"targets: written <= {TARGET_WRITTEN}x, disk <= {TARGET_DISK}x the final cache; shared <= {TARGET_SHARED}x")


def failures(results: list[Wear], args: argparse.Namespace) -> list[str]:
    bad = []
    for w in results:
        if w.part != "chat":
            continue
        if w.extra["dropped"] or w.extra["failed"] or w.extra["cancelled"]:
            bad.append(f"chat B={w.block_tokens} turn {w.turns}: not every spill stored {w.extra}")
    want = {"chat": len(args.chat_turns), "synthetic": len(args.synth_turns), "shared": 1}
    for part in args.parts:
        for b in args.blocks:
            n = sum(1 for w in results if w.part == part and w.block_tokens == b)
            if n != want[part]:
                bad.append(f"{part} B={b}: {n} figures of {want[part]}")
    return bad


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny sizes, seconds (figures mean nothing)")
    p.add_argument("--blocks", type=ints, default=[64, 128, 256], help="block sizes B, comma-separated (0: no blocks)")
    p.add_argument(
        "--parts",
        type=lambda s: s.split(","),
        default=["chat", "synthetic", "shared"],
        help="which parts: chat,synthetic,shared",
    )
    p.add_argument("--durability", choices=["fsync", "none"], default="fsync", help="of every store (default fsync)")
    p.add_argument(
        "--trim", type=int, default=4, help="tokens (chars) of each answer the next prompt does not re-render"
    )
    p.add_argument("--chat-turns", type=ints, default=[12, 40], help="chat checkpoints K (the chat runs to the last)")
    p.add_argument("--user-chars", type=int, default=200, help="chat: characters (tokens) of each user message")
    p.add_argument("--answer-tokens", type=int, default=205, help="chat: tokens generated a turn")
    p.add_argument("--synth-turns", type=ints, default=[12, 40], help="synthetic checkpoints (runs to the last)")
    p.add_argument("--synth-tokens", type=int, default=32768, help="synthetic: tokens at the last turn")
    p.add_argument("--conversations", type=int, default=10)
    p.add_argument("--system-tokens", type=int, default=2000)
    p.add_argument("--conv-user", type=int, default=400, help="shared: user prompt tokens of each conversation")
    p.add_argument("--conv-answer", type=int, default=400, help="shared: tokens generated in each conversation")
    p.add_argument("--dir", default=None, help="work folder (default: a fresh one under /var/tmp, removed at the end)")
    p.add_argument("--json", default=None, help="write every figure here")
    args = p.parse_args()
    if args.smoke:
        args.chat_turns, args.user_chars, args.answer_tokens = [1, 2], 60, 60
        args.synth_turns, args.synth_tokens = [2, 4], 1400
        args.conversations, args.system_tokens, args.conv_user, args.conv_answer = 3, 300, 40, 40
    unknown = set(args.parts) - {"chat", "synthetic", "shared"}
    if unknown:
        p.error(f"unknown parts {sorted(unknown)}")
    args.chat_turns, args.synth_turns = sorted(set(args.chat_turns)), sorted(set(args.synth_turns))
    if 0 in args.blocks and "synthetic" in args.parts and args.synth_tokens > 8192:
        p.error(
            "B=0 (entries whole) in the synthetic part writes O(turns^2): ~160 GiB at 32k tokens; "
            "use --parts chat, or a smaller --synth-tokens"
        )
    work = args.dir or tempfile.mkdtemp(prefix="chat-wear-", dir="/var/tmp")
    os.makedirs(work, exist_ok=True)
    print(f"chat_wear: B = {args.blocks}, parts {args.parts}, durability {args.durability}, work folder {work}")
    t0 = time.perf_counter()
    results: list[Wear] = []
    notes: list[str] = []
    try:
        if "chat" in args.parts:
            rows, notes = chat_part(args, work)
            results += rows
        results += store_part(args, work)
    finally:
        if args.dir is None:
            shutil.rmtree(work, ignore_errors=True)
    report(results, args.blocks)
    for n in notes:
        print(n)
    bad = failures(results, args)
    bad += [n for n in notes if n.endswith("NO")]
    print(f"wall {time.perf_counter() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args),
                    "results": [asdict(w) | {"write_amp": w.write_amp, "disk_amp": w.disk_amp} for w in results],
                    "failures": bad,
                },
                f,
                indent=1,
            )
    for b in bad:
        print(f"FAILED: {b}", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
