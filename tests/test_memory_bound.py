"""The daemon's memory is bounded by --cap, counted honestly: declared bytes, parsed headers and big messages count;
a spill larger than the cap is refused at once; a silent open spill is aborted; per-connection limits on tokens and
tensors; payloads get no buffer unless the accounting admitted their bytes. Real daemon subprocess, real socket."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from spilld import protocol as P
from spilld.daemon import ingest
from tests.daemons import Daemon, cleanup, new_root, serving
from tests.hostile_memory import kv_header
from tests.wire import Wire, frames

MiB = 1024 * 1024


def start(*args: str) -> Daemon:
    return Daemon(new_root(), list(args)).start()


@pytest.fixture
def small() -> Iterator[Daemon]:
    d = start("--cap", "64MiB", "--idle-timeout", "2")
    try:
        yield d
    finally:
        d.kill()
        cleanup(d.root)


def status(d: Daemon) -> dict[str, Any]:
    return dict(json.loads(d.cli("status", "--socket", d.socket, "--json").stdout))


def rss(d: Daemon) -> int:
    assert d.proc is not None
    with open(f"/proc/{d.proc.pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_a_spill_larger_than_the_cap_is_refused_at_once(small: Daemon) -> None:
    w = Wire(small.socket)
    w.hello()
    giant = kv_header(4500, heads=64, dim=256)  # 281 MiB declared against a 64 MiB cap
    r = w.call("spill", {"header": giant, "droppable": False})
    assert r.error is not None and r.error["code"] == "busy" and "larger than the cap allows" in r.error["message"]
    assert status(small)["ingest"]["receiving"] == 0
    other = Wire(small.socket)
    other.hello()
    r = other.call("spill", {"header": kv_header(8192), "droppable": False})  # 32 MiB: others are served
    assert r.error is None and r.result["bytes"] == 32 * MiB


def test_a_silent_open_spill_is_aborted_and_its_room_freed(small: Daemon) -> None:
    loris = Wire(small.socket)
    loris.hello()
    sid = loris.call("spill", {"header": kv_header(10240), "droppable": False}).result["spill"]  # 40 MiB held
    loris.send(P.notification("put", {"spill": sid, "index": 0, "offset": 0}, b"\0" * 4096))
    good = Wire(small.socket)
    good.hello()
    r = good.call("spill", {"header": kv_header(10240), "droppable": False})
    assert r.error is not None and r.error["code"] == "busy"  # the queue's room is held for the silent one
    t0 = time.monotonic()
    while True:  # both connections stay busy (the idle timeout is 2 s): only the loris's spill is silent
        st = loris.call("status", {}).result["ingest"]
        assert good.call("status", {}).error is None
        if st["expired"]:
            break
        assert time.monotonic() - t0 < 10
        time.sleep(0.2)
    assert time.monotonic() - t0 >= 1.5
    assert (st["open_spills"], st["receiving"], st["reserved"]) == (0, 0, 0)
    assert good.call("spill", {"header": kv_header(10240), "droppable": False}).error is None  # room is back
    r = loris.call("commit", {"spill": sid})
    assert r.error is not None and r.error["code"] == "timeout" and "received nothing" in r.error["message"]


def test_open_tokens_per_connection_are_bounded() -> None:
    d = start("--cap", "1GiB")
    try:
        per = ingest.MAX_OPEN_TOKENS // 2 - 1000
        w = Wire(d.socket)
        w.hello()
        for _ in range(2):
            assert w.call("spill", {"header": kv_header(8, tokens=per)}).error is None
        r = w.call("spill", {"header": kv_header(8, tokens=4000)})
        assert r.error is not None and r.error["code"] == "busy" and "tokens" in r.error["message"]
        other = Wire(d.socket)
        other.hello()
        assert other.call("spill", {"header": kv_header(8, tokens=4000)}).error is None  # per connection
    finally:
        d.kill()
        cleanup(d.root)


def test_open_tensors_per_connection_are_bounded() -> None:
    d = start("--cap", "1GiB")
    try:
        entries = ingest.MAX_OPEN_TENSORS // 4  # two tensors an entry: half the limit a spill
        w = Wire(d.socket)
        w.hello()
        for _ in range(2):
            assert w.call("spill", {"header": kv_header(1, heads=1, dim=1, entries=entries)}).error is None
        r = w.call("spill", {"header": kv_header(1, heads=1, dim=1)})
        assert r.error is not None and r.error["code"] == "busy" and "tensors" in r.error["message"]
    finally:
        d.kill()
        cleanup(d.root)


def test_parsed_headers_count_against_the_cap() -> None:
    small = start("--cap", "64MiB")  # the default idle timeout: every connection stays while the test runs
    try:
        parsed_headers_count(small)
    finally:
        small.kill()
        cleanup(small.root)


def parsed_headers_count(small: Daemon) -> None:
    w = Wire(small.socket)
    w.hello()
    tokens = 500_000
    assert w.call("spill", {"header": kv_header(8, tokens=tokens)}).error is None
    held = w.call("status", {}).result["ingest"]["receiving"]
    assert held >= tokens * ingest.PARSED_BYTES_PER_TOKEN  # the 32 KiB of tensors are the least of it
    admitted, keep = 1, []
    while True:  # more such spills, over other connections: refused once the budget (cap / 2) is spent
        assert admitted < 50, "never refused"
        other = Wire(small.socket)
        keep.append(other)  # open: a closed connection's spills are let go
        other.hello()
        try:
            other.send(P.request(7, "spill", {"header": kv_header(8, tokens=tokens)}))
        except BrokenPipeError:  # refused (and closed) at its frame head, while the rest was being sent
            pass
        _, error = other.answer(7)
        if error is not None:
            break
        admitted += 1
    # refused as a spill (a response) or, when even its 2 MB message does not fit, as a message (then closed)
    assert error["code"] == "busy" and "retry later" in error["message"]
    budget = 64 * MiB // ingest.RECEIVING_SHARE
    assert admitted == max(1, budget // held)  # (one is always taken when nothing else is held)


def test_big_messages_count_while_they_are_received(small: Daemon) -> None:
    # each such message counts MAX_EXPANSION (24) x its size (its decoded form) from its frame head
    size = P.MAX_MSG_BYTES
    need = size * ingest.DECODED_BYTES_PER_MSG_BYTE
    fits = max(1, 64 * MiB // ingest.RECEIVING_SHARE // need)  # (one is always taken when nothing else is held)
    held = []
    for _ in range(fits):
        w = Wire(small.socket)
        w.hello()
        w.sock.sendall(P.FRAME_HEAD.pack(size, 0) + b"\x94" * 1024)  # a message begun, never finished
        held.append(w)
    time.sleep(0.3)
    assert status(small)["ingest"]["buffers"] == fits * need
    late = Wire(small.socket)
    late.hello()
    late.sock.sendall(P.FRAME_HEAD.pack(size, 0))
    msgs = late.until_closed()
    assert msgs[-1].kind == P.NOTIFICATION and msgs[-1].params["code"] == "busy"
    for w in held:
        w.close()
    time.sleep(0.5)
    assert status(small)["ingest"]["buffers"] == 0


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc/PID/status")
def test_payloads_get_no_buffer_unless_admitted(small: Daemon) -> None:
    before = rss(small)
    conns = []
    for _ in range(6):  # puts for a spill that does not exist, 48 MiB of each 64 MiB payload sent
        s = socket.socket(socket.AF_UNIX)
        s.connect(small.socket)
        s.sendall(frames(P.request(1, "hello", {"version": 1})))
        head = P.notification("put", {"spill": 99, "index": 0, "offset": 0}, b"")
        body = bytes(head[0])[P.FRAME_HEAD.size :]
        s.sendall(P.FRAME_HEAD.pack(len(body), P.MAX_PAYLOAD_BYTES) + body)
        chunk = b"\1" * MiB
        for _ in range(48):
            s.sendall(chunk)
        conns.append(s)
    time.sleep(0.5)
    assert rss(small) - before < 32 * MiB  # thrown away through a small buffer, not 6 x 48 MiB held
    st = status(small)
    assert st["clients"] == 6  # every one of them still connected (the status request not counted)
    for s in conns:
        s.close()
    w = Wire(small.socket)
    w.hello()
    w.send(P.request(5, "status", {}, b"a payload where none belongs"))
    msgs = w.until_closed()
    assert msgs[-1].kind == P.NOTIFICATION and msgs[-1].params["code"] == "protocol_error"


@pytest.mark.asyncio
async def test_a_put_past_the_rows_a_spill_sends_gets_no_buffer() -> None:
    """With held rows a tensor is sent (and counted) without its first rows: a payload up to the whole tensor's
    size was given a buffer all the same, then refused (found in review: up to 64 MiB a frame never counted). The
    payload admission and the put's own check are now one rule, ``Incoming.next_within``."""
    from spilld.daemon.connection import Incoming

    header = ingest.accept_header(kv_header(64, heads=2, dim=8))
    sp = Incoming(header, True, "", held_rows=48)
    whole, sent = header.slots()[0].nbytes, sp.expect[0]
    assert sent == whole // 4  # 16 of 64 rows, each head's in turn
    assert not sp.next_within(0, 0, whole) and not sp.next_within(0, 0, sent + 1)
    assert sp.next_within(0, 0, sent)
    sp.claim(0, 0, sent - 2)
    assert sp.next_within(0, sent - 2, 2) and not sp.next_within(0, 0, 2) and not sp.next_within(2, 0, 1)


def test_only_spill_and_lookup_take_big_params(small: Daemon) -> None:
    """A big message is counted only until its handler starts; a drain, barrier or commit then waits for a long
    time holding its params. So only spill and lookup (whose tokens make them big) may send big params: a drain
    padded with 1 MiB is refused at once (found in review: up to 64 such requests a connection, held uncounted)."""
    w = Wire(small.socket)
    w.hello()
    w.send(P.request(5, "drain", {"timeout": 600.0, "pad": b"\0" * MiB}))
    _, error = w.answer(5)
    assert error is not None and error["code"] == "bad_params" and "only spill and lookup" in error["message"]
    w.send(P.request(6, "lookup", {"identity": {"model_id": "m"}, "tokens": b"\0\0\0\0" * (MiB // 4)}))  # big, fine
    result, error = w.answer(6)
    assert error is None and result["reason"] == "no_entry"
    assert status(small)["ingest"]["buffers"] == 0
    w.close()


@pytest.mark.asyncio
async def test_small_puts_are_held_as_few_chunks_not_an_object_each() -> None:
    """Found in review: a spill's cost counts tensor bytes, and a client sending 1-byte puts made the daemon hold
    66 bytes of objects per byte (60x --cap). Small puts are copied onto a chunk of at most COALESCED_CHUNK_BYTES;
    large ones are kept as they came, without a copy."""
    from spilld.daemon.connection import COALESCE_BELOW, COALESCED_CHUNK_BYTES, Incoming
    from spilld.daemon.ingest import accept_header

    rows = 2048  # a tensor of 8 x 2048 x 128 float16: 4 MiB
    sp = Incoming(accept_header(kv_header(rows)), droppable=True, key="")
    data = os.urandom(sp.expect[0])
    pos = 0
    for n in [1] * 5000 + [COALESCE_BELOW - 1] * 40:  # ~2.5 MiB of small puts
        sp.put(0, pos, data[pos : pos + n])
        pos += n
    big = memoryview(data)[pos : pos + COALESCE_BELOW]
    sp.put(0, pos, big)
    pos += COALESCE_BELOW
    sp.put(0, pos, data[pos:])  # the rest, in one put
    assert len(sp.chunks[0]) <= pos // COALESCED_CHUNK_BYTES + 3
    assert any(c is big for c in sp.chunks[0])  # a large put is not copied
    assert b"".join(bytes(c) for c in sp.chunks[0]) == data


def test_a_small_put_shm_that_does_not_end_its_tensor_fails_its_spill(small: Daemon) -> None:
    from spilld.daemon.connection import MIN_SHM_PUT_BYTES

    w = Wire(small.socket)
    w.hello()
    sid = w.call("spill", {"header": kv_header(64)}).result["spill"]
    name = "spilld-0000abcd-1"
    w.send(P.notification("put_shm", {"spill": sid, "index": 0, "offset": 0, "shm": name, "length": 1}))
    n = w.note("spill_error")
    assert n.params["code"] == "bad_params" and str(MIN_SHM_PUT_BYTES) in n.params["message"]
    assert w.note("shm_free").params["names"] == [name]
    w.close()


def test_a_put_payload_stays_counted_until_read_whatever_ends_its_spill(small: Daemon) -> None:
    """Found in review: an abort read just before a put's payload released the spill's count while the payload went
    on filling its buffer (up to 64 MiB a connection) uncounted. The count now goes when the payload is read."""
    w = Wire(small.socket)
    w.hello()
    rows = 4096  # 8 heads x 128 dims x f16: 8 MiB a tensor
    sid = w.call("spill", {"header": kv_header(rows)}).result["spill"]
    tensor = 8 * rows * 128 * 2
    head = frames(P.request(7, "abort", {"spill": sid}))
    put = frames(P.notification("put", {"spill": sid, "index": 0, "offset": 0}, b"\0" * tensor))
    w.sock.sendall(head + put[:-1])  # the abort, then all of the payload but its last byte
    assert w.response(7).result["aborted"] is True
    mon = Wire(small.socket)
    mon.hello()
    assert mon.call("status", {}).result["ingest"]["receiving"] >= tensor  # still counted: its buffer is filling
    w.sock.sendall(put[-1:])
    deadline = time.monotonic() + 10
    while mon.call("status", {}).result["ingest"]["receiving"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert mon.call("status", {}).result["ingest"]["receiving"] == 0  # read: let go


def test_a_headers_free_text_counts_against_the_cap(small: Daemon) -> None:
    """Found in review: a spill's meta (and identity, and key) was not counted: open spills of a few tensor bytes
    each and 3.8 MiB of meta held 17 MB apiece, past the cap, for the idle timeout."""
    w = Wire(small.socket)
    w.hello()
    header = kv_header(16) | {"meta": {"note": "x" * 3_800_000}}
    r = w.call("spill", {"header": header})
    assert r.error is None, r.error
    assert w.call("status", {}).result["ingest"]["receiving"] >= 3_800_000
    refused = None
    for i in range(32):  # the receiving budget (half of 64 MiB) is spent by text, not by tensors
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # refused while it was still sent
            w.send(P.request(1000 + i, "spill", {"header": header}))
        _, error = w.answer(1000 + i)  # a big message that does not fit: busy, and the connection closes
        if error is not None:
            refused = error
            break
    assert refused is not None and refused["code"] == "busy" and i < 16, (i, refused)


def _other_provider(fields: dict[str, Any]) -> Callable[[dict[str, Any]], None]:
    def mutate(h: dict[str, Any]) -> None:
        h["codec_provider"] = "another/1"  # no rules here: its caches' kinds and fields are taken as sent
        h["caches"][0].update(kind="k" * 100_000, fields=fields)

    return mutate


EMOJI_TEXT = "\U0001f600" + "x" * 3_000_000  # one wide character: CPython stores every one at 4 bytes


@pytest.mark.parametrize(
    "mutate",
    [
        lambda h: h.update(meta={"note": "x" * 3_000_000}),
        lambda h: h.update(meta={"note": EMOJI_TEXT}),
        lambda h: h.update(meta={"\u00e9" * 1_000_000: "\u4e2d" + "x" * 1_000_000}),
        lambda h: h.update(
            attachments=[{"schema": EMOJI_TEXT[: 10**6], "metadata": {"k": EMOJI_TEXT[: 10**6]}, "tensors": []}]
        ),
        lambda h: h.update(codec_provider=EMOJI_TEXT),
        lambda h: h.update(
            checkpoint={
                "key": "\U0001f600" * 4096,
                "cache_ns": "\U0001f600" * 4096,
                "original_prompt_tokens": 16,
                "generated_tokens": 0,
                "pending_token": None,
                "seed": 0,
                "seed_was_explicit": False,
            }
        ),
        _other_provider({"f" * 100_000: EMOJI_TEXT[: 10**6]}),
        _other_provider({"f": [-20] * 1_000_000}),  # each a new int (CPython keeps -5..256 only): 40 bytes a byte
    ],
    ids=["ascii-meta", "emoji-meta", "wide-meta-key", "attachment", "provider", "checkpoint", "fields", "field-ints"],
)
def test_a_headers_values_are_counted_at_what_they_hold_in_memory(mutate: Callable[[dict[str, Any]], None]) -> None:
    """docs/format.md §10 ("the cap rule"): a spill's parsed header is counted at what CPython's objects take, from
    its ``spill`` to its end. Found in review: its text was counted at its length in characters, but CPython stores
    every character of a str at the width of its widest one (one emoji: 3 MB of meta held 12 MB, counted 3 MB), and
    its codec provider, its caches' kinds and the fields of a provider without rules here (taken as sent) were not
    counted at all (a 4 MiB spill of a list of 4 M small ints held 160 MB, counted as 3 KB), each for as long as
    the spill stayed open."""
    import tracemalloc

    import msgpack

    from spilld.unpack import unpack

    header = kv_header(16)
    mutate(header)
    wire = msgpack.packb(header, use_bin_type=True)
    assert len(wire) <= P.MAX_MSG_BYTES  # what a client can send
    del header
    tracemalloc.start()
    try:
        parsed = ingest.accept_header(unpack(wire))
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
    assert ingest.parsed_bytes(parsed, "") >= held, (ingest.parsed_bytes(parsed, ""), held)


def test_a_headers_cache_entries_and_attachments_count_against_the_cap(small: Daemon) -> None:
    """Found in review: entries and attachments without tensors (an empty cache has none) were counted as nothing:
    50,000 empty entries in one open spill held 15.7 MiB counted as 0, for the idle timeout."""
    from spilld.daemon.ingest import PARSED_BYTES_PER_ENTRY

    w = Wire(small.socket)
    w.hello()
    empty = {"kind": "kv", "v": 1, "offset": 0, "min_reusable": 0, "trimmable": True, "fields": {}, "tensors": []}
    header = kv_header(1, heads=1, dim=1, tokens=0)
    header["caches"] = [dict(empty, children=[]) for _ in range(10_000)]
    header["attachments"] = [{"schema": "s" * 32, "metadata": {}, "tensors": []} for _ in range(5_000)]
    r = w.call("spill", {"header": header})
    assert r.error is None, r.error
    assert w.call("status", {}).result["ingest"]["receiving"] >= 15_000 * PARSED_BYTES_PER_ENTRY


class _ParseGate:
    """``ingest.parsed_bytes`` held at its start until ``go_on`` is set, the threads it ran on recorded."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.where: list[threading.Thread] = []
        self.parsing, self.go_on = threading.Event(), threading.Event()
        real = ingest.parsed_bytes

        def measured(*args: Any) -> int:
            self.where.append(threading.current_thread())
            self.parsing.set()
            self.go_on.wait(20)
            return real(*args)

        monkeypatch.setattr(ingest, "parsed_bytes", measured)

    async def reached(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.parsing.wait, 20)


@contextlib.asynccontextmanager
async def _in_process(tmp_path: Path, gate: _ParseGate | _DecodeGate, **over: Any) -> AsyncIterator[Any]:
    """A daemon on this test's loop (its connections can be looked at), and a client identity for it."""
    from spilld.config import Config
    from spilld.daemon.server import Daemon as InProcess

    daemon = InProcess(Config(dir=str(tmp_path / "store"), socket=str(tmp_path / "s.sock"), **over))
    await daemon.start()
    try:
        yield daemon
    finally:
        gate.go_on.set()
        await daemon.stop()


@pytest.mark.asyncio
async def test_a_spills_header_is_parsed_and_measured_off_the_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: parsing a spill's header and measuring what it holds walk all of it in Python on the event
    loop; a 4 MiB header of small ints (a provider without rules here: its fields taken as sent) took 1.5 s there,
    in which no other client was answered. Both run on a compute thread now for a big message, counted until then."""
    from mlx_lm.models.cache import KVCache

    import spilld
    from tests.caches import fill

    gate = _ParseGate(monkeypatch)
    async with _in_process(tmp_path, gate) as daemon:
        ident, sock = spilld.Identity(model_id="m"), daemon.cfg.socket
        async with (
            spilld.AsyncClient(sock, identity=ident) as client,
            spilld.AsyncClient(sock, identity=ident) as probe,
        ):
            n = 30_000  # a header of over BIG_MSG_BYTES: counted while it is received, decoded and parsed
            spill = client.spill(list(range(70_000, 70_000 + n)), [fill(KVCache(), n, heads=1, dim=4)], droppable=False)
            await gate.reached()
            st = await probe.status()  # answered while the header is parsed: the loop is free
            gate.go_on.set()
            assert (await spill).stored
            assert st["ingest"]["buffers"] >= ingest.BIG_MSG_BYTES, st["ingest"]  # still counted meanwhile
            assert (await probe.status())["ingest"]["buffers"] == 0
            assert gate.where and all(t is not threading.current_thread() for t in gate.where)


@pytest.mark.asyncio
async def test_a_client_gone_while_its_spills_header_is_parsed_leaves_nothing_held(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found when the parse moved off the loop (the kill test of test_shm_safety): a connection lost while its
    spill's header was parsed got that spill opened after its cleanup, its room held forever."""
    from mlx_lm.models.cache import KVCache

    import spilld
    from tests.caches import fill

    gate = _ParseGate(monkeypatch)
    async with _in_process(tmp_path, gate) as daemon:
        ident, sock = spilld.Identity(model_id="m"), daemon.cfg.socket
        async with spilld.AsyncClient(sock, identity=ident) as probe:
            before = set(daemon.connections)
            client = await spilld.AsyncClient.open(sock, identity=ident)
            (conn,) = daemon.connections - before
            n = 30_000  # a big header: parsed off the loop
            spill = client.spill(list(range(1, n + 1)), [fill(KVCache(), n, heads=1, dim=4)], droppable=False)
            await gate.reached()
            conn.transport.abort()  # lost mid-parse, as a write to a killed client ends it
            await conn.closed
            gate.go_on.set()
            assert not (await spill).stored
            await client.close(timeout=5)
            held = lambda st: (st["open_spills"], st["receiving"], st["reserved"], st["buffers"])  # noqa: E731
            for _ in range(100):  # (its handler ends once its parse has: the message is counted until then)
                if held(st := (await probe.status())["ingest"]) == (0, 0, 0, 0):
                    break
                await asyncio.sleep(0.05)
            assert held(st) == (0, 0, 0, 0), st


class _DecodeGate:
    """``protocol.decode`` of a big message part held at its start until ``go_on`` is set, its threads recorded."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.where: list[threading.Thread] = []
        self.decoding, self.go_on = threading.Event(), threading.Event()
        real = P.decode

        def held(data: Any) -> Any:
            if len(data) >= P.OFF_LOOP_MSG_BYTES:
                self.where.append(threading.current_thread())
                self.decoding.set()
                self.go_on.wait(20)
            return real(data)

        monkeypatch.setattr(P, "decode", held)

    async def reached(self) -> None:
        await asyncio.get_running_loop().run_in_executor(None, self.decoding.wait, 20)


def _big_lookup(msgid: int) -> bytes:
    """A lookup padded with 20,000 small arrays (~340 KiB): a message counted and decoded off the loop."""
    from spilld import format as fmt

    ident = {"model_id": "m", "config_fingerprint": "", "tokenizer_hash": ""}
    params = {"identity": ident, "tokens": fmt.encode_tokens([1, 2, 3]), "pad": [[1] * 15] * 20_000}
    return frames(P.request(msgid, "lookup", params))


async def _answers(r: asyncio.StreamReader, want: set[int], timeout: float) -> dict[int, P.Message]:
    dec, got = P.FrameDecoder(), {}
    while not want <= got.keys():
        data = await asyncio.wait_for(r.read(1 << 20), timeout)
        assert data, f"closed; answers so far {got}"
        got |= {m.msgid: m for m in dec.feed(data) if m.kind == P.RESPONSE}
    return got


@pytest.mark.asyncio
async def test_a_big_message_is_decoded_off_the_loop_and_nothing_after_it_is_read_meanwhile(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: a big message's msgpack part was decoded, and its nesting checked, on the event loop; 4 MiB of
    small arrays (one per 16 bytes, as the container bound allows) held it 0.5 s, every client waiting. It is decoded
    on a compute thread now, its bytes counted meanwhile, and the connection reads nothing more until it is done, so
    its frames are still taken in order."""
    from tests.hostile_memory import AsyncWire

    gate = _DecodeGate(monkeypatch)
    async with _in_process(tmp_path, gate) as daemon:
        sock = daemon.cfg.socket
        probe = await AsyncWire.open(sock, "probe")
        r, w = await asyncio.open_unix_connection(sock)
        w.write(frames(P.request(1, "hello", {"version": P.PROTOCOL_VERSION})))
        await _answers(r, {1}, 5)
        w.write(_big_lookup(2) + frames(P.request(3, "status", {})))
        await gate.reached()
        st, err = await asyncio.wait_for(probe.call("status", {}), 5)  # answered while it is decoded: the loop is free
        assert err is None and st["ingest"]["buffers"] >= ingest.BIG_MSG_BYTES, st["ingest"]  # counted meanwhile
        with pytest.raises(TimeoutError):
            await _answers(r, {3}, 0.5)  # the status behind it is not read yet
        gate.go_on.set()
        got = await _answers(r, {2, 3}, 10)
        assert got[2].error is None and got[2].result["hit"] is False and got[3].error is None
        st, _ = await probe.call("status", {})
        assert st["ingest"]["buffers"] == 0, st["ingest"]
        w.close()
        probe.close()
    assert gate.where and all(t is not threading.current_thread() for t in gate.where)


@pytest.mark.asyncio
async def test_a_client_gone_while_its_big_message_is_decoded_is_counted_until_the_decode_ends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The objects of a message being decoded on a worker thread are still made when its client goes: its count is
    let go once the decode ends, never before, and nothing of it is dispatched."""
    from tests.hostile_memory import AsyncWire

    gate = _DecodeGate(monkeypatch)
    async with _in_process(tmp_path, gate) as daemon:
        sock = daemon.cfg.socket
        probe = await AsyncWire.open(sock, "probe")
        before = set(daemon.connections)
        r, w = await asyncio.open_unix_connection(sock)
        w.write(frames(P.request(1, "hello", {"version": P.PROTOCOL_VERSION})))
        await _answers(r, {1}, 5)
        (conn,) = daemon.connections - before
        w.write(_big_lookup(2))
        await gate.reached()
        conn.transport.abort()
        await conn.closed
        st, _ = await probe.call("status", {})
        assert st["ingest"]["buffers"] >= ingest.BIG_MSG_BYTES, st["ingest"]  # still being decoded
        gate.go_on.set()
        for _ in range(100):
            st, _ = await probe.call("status", {})
            if st["ingest"]["buffers"] == 0:
                break
            await asyncio.sleep(0.05)
        assert st["ingest"]["buffers"] == 0 and st["lookups"] == 0, st
        w.close()
        probe.close()


@pytest.mark.asyncio
async def test_a_client_is_not_timed_out_while_the_daemon_decodes_its_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: the connection's timer ran on while its whole big message waited for a compute thread, so a
    slow decode (the threads busy with other clients' headers) cut the client off as silent, or as a message "not
    received" in time. Nothing is read meanwhile: the wait is the daemon's, and the request is answered."""
    gate = _DecodeGate(monkeypatch)
    async with _in_process(tmp_path, gate, request_timeout=0.5, idle_timeout=0.5) as daemon:
        r, w = await asyncio.open_unix_connection(daemon.cfg.socket)
        w.write(frames(P.request(1, "hello", {"version": P.PROTOCOL_VERSION})))
        await _answers(r, {1}, 5)
        w.write(_big_lookup(2))
        await gate.reached()
        await asyncio.sleep(1.5)  # three timeouts of the decode's wait
        gate.go_on.set()
        got = await _answers(r, {2}, 10)
        assert got[2].error is None and got[2].result["hit"] is False
        assert daemon.ingest.buffers == 0
        w.close()


def test_a_message_of_4_mib_of_small_arrays_keeps_other_clients_answered(small: Daemon) -> None:
    """End to end: another client's ``status`` round trip while a 4 MiB message of small arrays (one per 16 bytes,
    the container bound) is received and decoded. Measured here: 0.52 s with the decode on the loop, 0.05 s off it."""
    import msgpack

    k = (P.MAX_MSG_BYTES - 64) // 16
    body = msgpack.packb([P.REQUEST, 2, "lookup", {"pad": [[1] * 15] * k}], use_bin_type=True)
    hostile, probe = Wire(small.socket), Wire(small.socket)
    hostile.hello()
    probe.hello()
    slowest, stop = [0.0], threading.Event()

    def probing() -> None:
        while not stop.is_set():
            t = time.perf_counter()
            assert probe.call("status", {}).error is None
            slowest[0] = max(slowest[0], time.perf_counter() - t)
            time.sleep(0.005)

    th = threading.Thread(target=probing)
    th.start()
    try:
        time.sleep(0.2)
        hostile.sock.sendall(P.FRAME_HEAD.pack(len(body), 0) + body)
        assert hostile.response(2).error["code"] == "bad_params"  # (no identity)
        time.sleep(0.2)
    finally:
        stop.set()
        th.join()
    assert slowest[0] < 0.25, slowest[0]


@pytest.mark.asyncio
async def test_a_small_spill_message_is_counted_until_its_header_is_parsed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: a spill's message under BIG_MSG_BYTES was counted nowhere, yet its handler held it while it
    waited for a compute thread to parse it, behind every other spill: 20 clients pipelining 64 spills of 64 KiB of
    empty maps each held 3 GB with --cap 64MiB. It is counted now, at MAX_UNCOUNTED_EXPANSION x its size, from its
    dispatch until its header is parsed; one that does not fit is answered busy at once."""
    import msgpack

    from spilld.unpack import MAX_UNCOUNTED_EXPANSION
    from tests.hostile_memory import AsyncWire

    header = kv_header(2, heads=1, dim=8) | {"meta": {"pad": "x" * 40_000}}
    size = len(msgpack.packb([P.REQUEST, 2, "spill", {"header": header}], use_bin_type=True))
    assert size < ingest.BIG_MSG_BYTES
    gate = _ParseGate(monkeypatch)
    async with _in_process(tmp_path, gate, cap=4 * MiB) as daemon:  # budget 2 MiB: one such message (2.9 MB) alone
        probe = await AsyncWire.open(daemon.cfg.socket, "probe")
        r, w = await asyncio.open_unix_connection(daemon.cfg.socket)
        w.write(frames(P.request(1, "hello", {"version": P.PROTOCOL_VERSION})))
        await _answers(r, {1}, 5)
        w.write(frames(*[P.request(i, "spill", {"header": header}) for i in (2, 3, 4)]))
        await gate.reached()  # the first one's header is being parsed
        got = await _answers(r, {3, 4}, 5)  # the others are refused at once: no room for them
        assert [got[i].error["code"] for i in (3, 4)] == ["busy", "busy"], got
        st, _ = await probe.call("status", {})
        assert st["ingest"]["buffers"] == size * MAX_UNCOUNTED_EXPANSION, st["ingest"]
        gate.go_on.set()
        got = await _answers(r, {2}, 10)
        assert got[2].error is None and got[2].result["spill"] == 1, got[2]
        st, _ = await probe.call("status", {})
        assert st["ingest"]["buffers"] == 0 and st["ingest"]["open_spills"] == 1, st["ingest"]
        w.close()
        probe.close()


async def _lookups_on(
    socket_path: str, sends: list[list[dict[str, Any]]]
) -> list[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    """A connection (said hello) per entry of ``sends``, each pipelining its lookups' params (msgids from 2 on),
    one connection after the other."""
    conns = []
    for lookups in sends:
        r, w = await asyncio.open_unix_connection(socket_path)
        w.write(frames(P.request(1, "hello", {"version": P.PROTOCOL_VERSION})))
        await _answers(r, {1}, 5)
        w.write(frames(*[P.request(i, "lookup", p) for i, p in enumerate(lookups, 2)]))
        await w.drain()
        conns.append((r, w))
    return conns


@contextlib.asynccontextmanager
async def _held_lookups(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cap: int) -> AsyncIterator[Any]:
    """An in-process daemon whose lookups wait (as for a busy compute thread) until the event it yields is set;
    each of its connections counts as a client of its own (in-process, every one has this test's pid)."""
    from spilld.daemon import connection

    go_on = asyncio.Event()
    monkeypatch.setattr(connection, "peer_pid", lambda sock: None)
    async with _in_process(tmp_path, _ParseGate(monkeypatch), cap=cap) as daemon:
        real = daemon.store.lookup_async

        async def held(*args: Any, **kw: Any) -> Any:
            await go_on.wait()
            return await real(*args, **kw)

        monkeypatch.setattr(daemon.store, "lookup_async", held)
        try:
            yield daemon, go_on
        finally:
            go_on.set()


def _lookup_params(ntokens: int) -> tuple[dict[str, Any], int]:
    """A lookup's params of ``ntokens`` tokens, and what it is counted as while served."""
    import msgpack

    import spilld
    from spilld import format as fmt
    from spilld.daemon import budget

    ident = spilld.Identity("m", "c", "t", "").to_wire()
    params = {"identity": ident, "tokens": fmt.encode_tokens(list(range(ntokens)))}
    return params, budget.lookup_bytes(len(msgpack.packb([P.REQUEST, 2, "lookup", params], use_bin_type=True)))


@pytest.mark.asyncio
async def test_lookups_being_served_hold_at_most_their_share_of_the_cap(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: a lookup's message was counted nowhere, yet it is held until answered, behind every lookup
    waiting for a compute thread: 400 clients pipelining lookups of 15,000 tokens made a daemon at --cap 64MiB peak
    at 250 MB. Lookups are counted from their dispatch until answered, within --cap / LOOKUP_SHARE; one that does
    not fit is answered busy at once (a miss to an engine), and one alone always goes in. (Each lookup here is its
    own client's first: larger than a client's share, LOOKUP_CLIENT_SHARE, which the next test hits.)"""
    from spilld.daemon import budget
    from tests.hostile_memory import AsyncWire

    async with _held_lookups(tmp_path, monkeypatch, MiB) as (daemon, go_on):
        params, each = _lookup_params(15_000)
        assert each > daemon.looking.share
        fit = 1 + (MiB // budget.LOOKUP_SHARE - each) // each  # the first always, then while the share holds
        assert 1 < fit < 6
        probe = await AsyncWire.open(daemon.cfg.socket, "probe")
        conns = await _lookups_on(daemon.cfg.socket, [[params]] * 6)
        got = [await _answers(r, {2}, 5) for r, _ in conns[fit:]]  # at once: the others still wait
        assert all(g[2].error["code"] == "busy" and "the daemon holds" in g[2].error["message"] for g in got), got
        st, _ = await probe.call("status", {})
        assert st["lookup_bytes"] == fit * each, st["lookup_bytes"]
        go_on.set()
        got = [await _answers(r, {2}, 10) for r, _ in conns[:fit]]
        assert all(g[2].error is None and g[2].result["hit"] is False for g in got), got
        st, _ = await probe.call("status", {})
        assert st["lookup_bytes"] == 0
        alone, _ = _lookup_params(300_000)  # more than the share
        r, w = conns[0]
        w.write(frames(P.request(9, "lookup", alone)))
        got = await _answers(r, {9}, 10)
        assert got[9].error is None, got[9]
        for _, w in conns:
            w.close()
        probe.close()


@pytest.mark.asyncio
async def test_one_client_holds_at_most_its_share_of_the_lookup_budget(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: one client pipelining lookups could fill the whole lookup budget, and another engine's
    lookups, one at a time, were answered busy (the next test, against a real daemon). Beyond its first lookup, a
    client holds at most 1 / LOOKUP_CLIENT_SHARE of the budget; the next one is busy for it alone, and another
    client's lookup goes in beside them."""
    from spilld.daemon import budget
    from tests.hostile_memory import AsyncWire

    cap = 4 * MiB
    async with _held_lookups(tmp_path, monkeypatch, cap) as (daemon, go_on):
        params, each = _lookup_params(1_000)
        share = cap // budget.LOOKUP_SHARE // budget.LOOKUP_CLIENT_SHARE
        assert daemon.looking.share == share
        fit = 1 + (share - each) // each
        assert 2 < fit < 8
        probe = await AsyncWire.open(daemon.cfg.socket, "probe")
        [(r, w)] = await _lookups_on(daemon.cfg.socket, [[params] * 8])
        refused = set(range(2 + fit, 10))
        got = await _answers(r, refused, 5)  # at once: the others still wait
        assert all("its share" in got[i].error["message"] for i in refused), got
        assert not got.keys() & set(range(2, 2 + fit)), got
        [(r2, w2)] = await _lookups_on(daemon.cfg.socket, [[params]])  # another client: it goes in
        st, _ = await probe.call("status", {})
        assert st["lookup_bytes"] == (fit + 1) * each, st["lookup_bytes"]
        go_on.set()
        got = await _answers(r, set(range(2, 2 + fit)), 10) | await _answers(r2, {2}, 10)
        assert all(m.error is None for m in got.values()), got
        st, _ = await probe.call("status", {})
        assert st["lookup_bytes"] == 0 and not daemon.looking.clients
        w.close()
        w2.close()
        probe.close()


def test_a_client_flooding_lookups_does_not_make_anothers_busy() -> None:
    """Found in review: lookups were refused busy against one budget for all clients, so one that flooded it made
    another's busy (a miss, and a warning in its engine's log each time). Against a real daemon (--cap 1MiB) a
    process keeping 32 lookups in flight on each of 4 connections, each a quarter of the budget, made 195 of 200
    lookups of another client busy. Each client (a process, whatever its connections) now holds at most its share
    beyond its first lookup: none of the other's lookups is busy."""
    import subprocess
    import sys

    from spilld import format as fmt

    with serving("--cap", "1MiB") as d:
        flood = subprocess.Popen(
            [sys.executable, "-m", "tests.lookup_flood", d.socket, "12200", "32", "4"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert flood.stdout is not None and flood.stdout.readline().strip() == "ready"
            w = Wire(d.socket)
            w.hello(client="polite")
            params = {"identity": {"model_id": "polite"}, "tokens": fmt.encode_tokens(list(range(64)))}
            answers = []
            for _ in range(100):
                answers.append(w.call("lookup", params))
                time.sleep(0.005)
            assert flood.poll() is None  # still flooding
            busy = [m.error for m in answers if m.error is not None]
            assert not busy, f"{len(busy)} of 100 busy: {busy[0]}"
        finally:
            flood.kill()
            flood.wait()
