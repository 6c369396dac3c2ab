"""``spilld demo``: a newcomer's first minute with spilld, on a tiny local model.

It reaches the daemon (starting one if none answers), builds a tiny random-weight
model, runs a short chat whose every turn is spilled behind the decode loop, then
"restarts the engine" (a fresh model object, no caches in memory) and answers the
next turn twice: from a full prefill, and from the cold tier. It prints what it
measured; nothing is asserted about the timings.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any, cast

from . import errors
from .config import default_dir, default_socket, format_size
from .daemon import is_served
from .lease import FairLock

SYSTEM = (
    "You are a careful assistant for people who run language models on their own machines. "
    "Answer briefly, cite the manual when you can, and never invent a command-line flag. "
)
TURNS = ("How do I keep long prompts warm?", "And after a restart?", "What does the cap do?")
SYSTEM_REPEAT = 16  # about 2,800 tokens of system prompt: the part a cold tier saves
DECODE_TOKENS = 24
PREFILL_STEP = 512
DAEMON_START_TIMEOUT_S = 30.0
STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)  # raised as errors.StopSignal while the demo runs (Ctrl-C: as ever)


def _say(msg: str) -> None:
    print(f"  {msg}", file=sys.stderr, flush=True)  # progress; stdout holds the result (``--json``: JSON only)


@dataclass
class Engine:
    """The smallest mlx-lm style engine: prefill in steps, greedy decode, one lock held per model call."""

    model: Any
    lock: FairLock = field(default_factory=FairLock)  # fair: spilld's waiting step gets its turn between tokens
    last_logits: Any = None  # of the last step: compared across the two ways to answer

    def step(self, tokens: list[int], cache: list[Any]) -> int:
        import mlx.core as mx

        with self.lock:  # the generation lock: spilld's write steps run between these
            self.last_logits = self.model(mx.array([tokens]), cache=cache)[0, -1]
            nxt = mx.argmax(self.last_logits)
            mx.eval(nxt, self.last_logits)
        return cast(int, nxt.item())

    def prefill(self, tokens: list[int], cache: list[Any]) -> int:
        """Feed ``tokens``; returns the first generated token (time to first token ends here)."""
        for i in range(0, len(tokens) - 1, PREFILL_STEP):
            self.step(tokens[i : min(i + PREFILL_STEP, len(tokens) - 1)], cache)
        return self.step(tokens[-1:], cache)

    def decode(self, first: int, cache: list[Any], n: int, on_token: Any = None) -> tuple[list[int], list[float]]:
        out, times, tok = [first], [], first
        for i in range(n):
            t0 = time.perf_counter()
            tok = self.step([tok], cache)
            times.append(time.perf_counter() - t0)
            out.append(tok)
            if on_token is not None:
                on_token(i, out)
        return out, times


def _start_daemon(sock: str, folder: str) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "spilld", "--cap", "1GiB", "--socket", sock, "--dir", folder, "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + DAEMON_START_TIMEOUT_S
    try:
        while not is_served(sock):
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                proc.wait()
                raise errors.SpillError(f"could not start a daemon on {sock} (exit {proc.poll()})")
            time.sleep(0.05)
    except (KeyboardInterrupt, errors.StopSignal):  # stopped while it starts: it goes too (its own session)
        _stop(proc)
        raise
    return proc


@contextlib.contextmanager
def _stop_signals_raise() -> Iterator[None]:
    """SIGTERM and SIGHUP raise ``errors.StopSignal`` in the demo, so its ``finally`` stops the daemon it started
    (in a session of its own: no signal of the demo's reaches it) and removes its temp folder (found in review:
    both were left, and the next demo found the socket in use). Once: one more during that cleanup is ignored.
    The handlers before are put back after; off the main thread (no handler can be set) nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    raised = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal raised
        if not raised:
            raised = True
            raise errors.StopSignal(signum)

    before = {s: signal.signal(s, stop) for s in STOP_SIGNALS}
    try:
        yield
    finally:
        for s, handler in before.items():
            signal.signal(s, handler if handler is not None else signal.SIG_DFL)


def _load(path: str) -> tuple[Any, Any]:
    import mlx_lm

    loaded = mlx_lm.load(path)
    return loaded[0], loaded[1]


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (the daemon drains), then SIGKILL if it overstays; never raises over the demo's own error."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _median_ms(xs: list[float]) -> float:
    return 1e3 * statistics.median(xs) if xs else float("nan")


def _chat(engine: Engine, tok: Any, client: Any) -> tuple[list[int], list[float], list[float]]:
    """Three turns on one growing cache, spilled write-behind; returns (tokens so far, idle ms, spilling ms)."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(engine.model)
    history: list[int] = []  # exactly the tokens in ``cache``
    unfed: list[int] = []  # the last answer token, fed at the start of the next turn
    idle_ms: list[float] = []
    busy_ms: list[float] = []
    outcomes = []
    for i, turn in enumerate(TURNS):
        text = (SYSTEM * SYSTEM_REPEAT if i == 0 else "") + f"<user>{turn}\n<assistant>"
        new = unfed + tok.encode(text, add_special_tokens=False)
        first = engine.prefill(new, cache)
        history += new

        def spill_often(k: int, out: list[int], fed: list[int] = history) -> None:
            if k % 4 == 0:  # a snapshot every 4 tokens, so writes overlap the decode
                outcomes.append(client.spill(fed + out[:-1], cache, live=True))

        out, times = engine.decode(first, cache, DECODE_TOKENS, spill_often if i == 1 else None)
        (busy_ms if i == 1 else idle_ms).extend(times)
        history += out[:-1]
        unfed = out[-1:]
        outcomes.append(client.spill(history, cache, live=True, droppable=False))
    for f in outcomes:
        f.result(timeout=60)  # live snapshots read the cache until they settle
    client.barrier("demo").result(timeout=60)  # every spill above settled at the daemon
    return history + unfed, idle_ms, busy_ms


def _max_gap(a: Any, b: Any) -> float:
    import mlx.core as mx

    return cast(float, mx.abs(a - b).max().item())


def _answer_twice(engine: Engine, client: Any, prompt: list[int]) -> dict[str, Any]:
    """The first token of ``prompt`` from a full prefill, then from the cold tier plus the rest.

    The two answers' logits are compared too (they differ only by rounding: the prefill runs in other chunks),
    beside a control: the cold tier's answer with one restored value changed, which must move them much more.
    """
    from mlx_lm.models.cache import make_prompt_cache

    t0 = time.perf_counter()
    cold_first = engine.prefill(prompt, make_prompt_cache(engine.model))
    ttft_prefill = time.perf_counter() - t0
    cold_logits = engine.last_logits

    t0 = time.perf_counter()
    loaded = client.load(prompt)
    restored = len(loaded.tokens) if loaded is not None else 0
    cache = loaded.caches if loaded is not None else make_prompt_cache(engine.model)
    warm_first = engine.prefill(prompt[restored:], cache)
    ttft_tier = time.perf_counter() - t0
    warm_logits = engine.last_logits
    control = float("nan")
    if loaded is not None and (bad := client.load(prompt)) is not None:
        first = bad.caches[0]  # the first restored token's values in the first layer, moved by 1.0
        first.values[..., 0, :] = first.values[..., 0, :] + 1.0
        engine.prefill(prompt[restored:], bad.caches)
        control = _max_gap(engine.last_logits, cold_logits)
    return {
        "prompt_tokens": len(prompt),
        "restored_tokens": restored,
        "ttft_without_tier_ms": round(1e3 * ttft_prefill, 1),
        "ttft_with_tier_ms": round(1e3 * ttft_tier, 1),
        "same_first_token": cold_first == warm_first,
        "logits_max_diff": _max_gap(warm_logits, cold_logits),
        "control_logits_max_diff": control,
    }


def run_demo(sock: str | None = None, folder: str | None = None, *, as_json: bool = False) -> dict[str, Any]:
    """Run the demo; returns the figures it printed. SIGTERM or SIGHUP ends it with ``errors.StopSignal``, the
    daemon it started stopped and its temp folder removed."""
    with _stop_signals_raise():
        figures = _run(sock or default_socket(), folder)
    _print(figures, as_json)
    return figures


def _run(sock: str, folder: str | None) -> dict[str, Any]:
    from .client import Client
    from .identity import model_identity
    from .lease import ThreadLockLease
    from .tinymodel import write_tiny_model

    started: subprocess.Popen[bytes] | None = None
    workdir = tempfile.mkdtemp(prefix="spilld-demo-")
    t_start = time.perf_counter()
    try:
        if is_served(sock):
            _say(f"using the daemon on {sock}")
        else:
            _say(f"no daemon on {sock}: starting one for this demo (it stops at the end)")
            started = _start_daemon(sock, folder or default_dir())
        _say("building a tiny random-weight model (nothing is downloaded)")
        model_dir = write_tiny_model(os.path.join(workdir, "model"))
        model, tok = _load(model_dir)
        engine = Engine(model)
        client = Client(
            sock, identity=model_identity(model, tok, model_id="spilld-demo"), lease=ThreadLockLease(engine.lock)
        )
        try:
            _say(f"chatting: {len(TURNS)} turns, each spilled write-behind")
            history, idle_ms, busy_ms = _chat(engine, tok, client)
            _say("restarting the engine (no cache in memory) and asking the next question twice")
            del model, engine
            model, tok = _load(model_dir)
            prompt = history + tok.encode("<user>Thanks!\n<assistant>", add_special_tokens=False)
            figures = _answer_twice(Engine(model), client, prompt)
            store = client.status().get("store", {})
        finally:
            client.close(30)
        figures |= {
            "decode_idle_ms_per_token": round(_median_ms(idle_ms), 2),
            "decode_spilling_ms_per_token": round(_median_ms(busy_ms), 2),
            "entries": store.get("entries"),  # (a manifest's blocks are files of their own: not counted here)
            "bytes_on_disk": store.get("bytes"),
            "demo_seconds": round(time.perf_counter() - t_start, 1),
        }
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        if started is not None:
            _stop(started)
    return figures


def _print(f: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(f))
        return
    speedup = f["ttft_without_tier_ms"] / max(f["ttft_with_tier_ms"], 1e-3)
    rows = [
        ("time to first token, full prefill", f"{f['ttft_without_tier_ms']:.1f} ms ({f['prompt_tokens']} tokens)"),
        ("time to first token, cold tier", f"{f['ttft_with_tier_ms']:.1f} ms ({f['restored_tokens']} restored), {speedup:.1f}x"),
        ("same first token", "yes" if f["same_first_token"] else "NO"),
        ("next-token logits, largest gap", f"{f['logits_max_diff']:.1e} (one restored value moved: {f['control_logits_max_diff']:.1e})"),
        ("decode, idle", f"{f['decode_idle_ms_per_token']:.2f} ms/token"),
        ("decode, while spilling", f"{f['decode_spilling_ms_per_token']:.2f} ms/token"),
        ("entries on disk (all models)", f"{f['entries']} ({format_size(int(f['bytes_on_disk'] or 0))})"),
    ]  # fmt: skip
    print()
    for name, value in rows:
        print(f"  {name:<34} {value}")
    print(f"\n  done in {f['demo_seconds']:.0f} s. Next: `spilld status`, and the README's engine section.")
