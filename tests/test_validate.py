"""The headers observed to get through (issue 11), each refused by every user of the validator alike:
the loader, ``spilld verify``, the index scan (quarantined) and the daemon (at spill time, before a byte)."""

from __future__ import annotations

import ast
import copy
import os
import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import mlx.core as mx
import msgpack
import pytest
from mlx_lm.models import cache as C

import spilld
import spilld.loader
from spilld import errors
from spilld import format as fmt
from spilld import protocol as P
from spilld.codecs import default_provider
from spilld.codecs.base import grown
from spilld.codecs.rules import CAPACITY_STEP, GROWTH_MAX_BYTES, MAX_ARRAY_SLOTS, MLX_LM_RULES
from spilld.loader import alloc_shape
from spilld.store import Store
from spilld.validate import validate_header
from tests.caches import fill, kv
from tests.daemons import Daemon, cleanup, new_root
from tests.hostile import wire_align

IDENT = spilld.Identity("m", "fp", "tok", "ns")
TOKENS = list(range(100, 108))
Wire = dict[str, Any]


def sample_file(path: str) -> bytes:
    """One kv cache of [1, 4, 8, 64] float16 (8 rows) and one quantized cache of 5 rows, 8 tokens."""
    kv = fill(C.KVCache(), 8, heads=4, dim=64, dtype=mx.float16)
    q = fill(C.QuantizedKVCache(group_size=32, bits=4), 5, dim=32)
    spilld.save(path, TOKENS, [kv, q], identity=IDENT)
    with open(path, "rb") as f:
        return f.read()


def split(data: bytes) -> tuple[Wire, bytes]:
    """A file's header as msgpack decodes it, and its data region."""
    prefix = fmt.decode_prefix(data[: fmt.PREFIX_LEN], len(data))
    wire = msgpack.unpackb(data[fmt.PREFIX_LEN : fmt.PREFIX_LEN + prefix.header_len], raw=False)
    return wire, data[prefix.data_start :]


def join(wire: Wire, body: bytes, version: int = fmt.FORMAT_VERSION) -> bytes:
    """A file with this header (its hash right: only what it says is wrong) over this data region."""
    hb = msgpack.packb(wire, use_bin_type=True)
    head, _ = fmt.encode_prefix(hb, align=wire_align(wire))
    head = bytearray(head)
    fmt.PREFIX.pack_into(head, 0, fmt.MAGIC, version, len(hb), len(head), int.from_bytes(fmt.xxh3(hb), "big"))
    return bytes(head) + body


@dataclass
class Case:
    """One observed hostile header: how to make it from the sample, and the refusal every user gives."""

    name: str
    mutate: Callable[[Wire], None]
    err: type[errors.SpillError]
    keep_data: bool = True


def _zero_rows(w: Wire) -> None:
    kv = w["caches"][0]
    kv["offset"] = 0
    for s in kv["tensors"]:
        s.update(shape=[1, 64, 0, 16384], bytes=0, off=0, hash=fmt.xxh3(b""))
    w["caches"] = [kv]  # a 16 KiB file: prefix, header, padding and no tensor bytes


def _rank3(w: Wire) -> None:
    w["caches"][0]["tensors"][0]["shape"] = [4, 8, 64]  # same bytes, one dimension less


CASES = [
    Case("kv_shape_1x64x0x16384_in_16KiB", _zero_rows, errors.ShapeMismatch, keep_data=False),
    Case("quantized_offset_4194304", lambda w: w["caches"][1].update(offset=4_194_304), errors.OffsetBeyondTokens),
    Case(
        "quantized_offset_4194304_no_tokens",
        lambda w: (w["caches"][1].update(offset=4_194_304), w.update(tokens=b"")),
        errors.OffsetMismatch,
    ),
    Case("format_4_under_prefix_3", lambda w: w.update(format=4), errors.VersionMismatch),
    Case(
        "slot_bytes_999_for_1x4x8x64_f16",
        lambda w: w["caches"][0]["tensors"][0].update(bytes=999),
        errors.SlotSizeMismatch,
    ),
    Case("kind_nonsense", lambda w: w["caches"][0].update(kind="nonsense"), errors.KindNotInProvider),
    Case("kv_one_tensor", lambda w: w["caches"][0]["tensors"].pop(), errors.TensorCountMismatch),
    Case("kv_rank3_tensor", _rank3, errors.TensorRankMismatch),
    Case("kv_offset_5_with_8_rows", lambda w: w["caches"][0].update(offset=5), errors.OffsetMismatch),
    Case("align_7", lambda w: w.update(align=7), errors.FieldInvalid),
]
IDS = [c.name for c in CASES]


@pytest.fixture(scope="module")
def sample(tmp_path_factory: Any) -> bytes:
    return sample_file(str(tmp_path_factory.mktemp("sample") / "good.spilld"))


def hostile(sample: bytes, case: Case) -> tuple[Wire, bytes]:
    wire, body = split(sample)
    wire = copy.deepcopy(wire)
    case.mutate(wire)
    return wire, join(wire, body if case.keep_data else b"")


def write(path: str, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return path


def test_the_sample_is_valid_for_every_user(sample: bytes, tmp_path: Any) -> None:
    path = write(str(tmp_path / "x.spilld"), sample)
    assert spilld.load(path).tokens == TOKENS and spilld.loader.verify_file(path).tokens == TOKENS
    validate_header(fmt.header_from_wire(split(sample)[0]))


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_refused_by_the_loader_and_verify(sample: bytes, case: Case, tmp_path: Any) -> None:
    _, data = hostile(sample, case)
    path = write(str(tmp_path / "x.spilld"), data)
    for user in (spilld.load, spilld.loader.verify_file, spilld.loader.read_header):
        with pytest.raises(case.err) as info:
            user(path)
        assert info.value.code == case.err.code and "x.spilld" in str(info.value)
        assert isinstance(info.value, errors.FileFormatError)  # so a scan quarantines it


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_quarantined_by_a_scan(sample: bytes, case: Case, tmp_path: Any) -> None:
    _, data = hostile(sample, case)
    store = Store(tmp_path / "store")
    path = store.new_path(IDENT, IDENT.namespace)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write(path, data)
    assert store.scan() == 0
    assert store.counters.quarantined == 1 and not os.path.exists(path)


@pytest.mark.parametrize("case", CASES, ids=IDS)
def test_refused_by_the_daemons_check(sample: bytes, case: Case) -> None:
    wire, _ = hostile(sample, case)
    with pytest.raises(case.err):
        validate_header(fmt.header_from_wire(wire))


# --- end to end: a real daemon answers the spill with the code, stores nothing, serves others ------


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    d = Daemon(new_root()).start()
    try:
        yield d
    finally:
        d.kill()
        cleanup(d.root)


def _call(sock: socket.socket, dec: P.FrameDecoder, bufs: list[Any]) -> P.Message:
    sock.sendall(b"".join(bytes(b) for b in bufs))
    while True:
        data = sock.recv(65536)
        assert data, "the daemon closed the connection"
        if msgs := dec.feed(data):
            return msgs[0]


def test_a_real_daemon_refuses_each_at_spill_time(sample: bytes, daemon: Daemon) -> None:
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(30)
    sock.connect(daemon.socket)
    dec = P.FrameDecoder()
    try:
        assert _call(sock, dec, P.request(1, "hello", {"version": 1, "client": "hostile"})).error is None
        for i, case in enumerate(CASES):
            wire, _ = hostile(sample, case)
            got = _call(sock, dec, P.request(2 + i, "spill", {"header": wire}))
            assert got.error is not None and got.error["code"] == case.err.code, (case.name, got.error)
        # the same connection still spills a good header
        good = _call(sock, dec, P.request(99, "spill", {"header": split(sample)[0]}))
        assert good.error is None and good.result["bytes"] == fmt.header_from_wire(split(sample)[0]).data_bytes
    finally:
        sock.close()


# --- the validator and the rules stay pure, and agree with mlx-lm -----------------------------------

PURE = ["spilld/validate.py", "spilld/codecs/rules.py", "spilld/format.py", "spilld/errors.py"]


@pytest.mark.parametrize("name", PURE)
def test_the_validator_imports_no_engine(name: str) -> None:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(os.path.join(root, name)) as f:
        tree = ast.parse(f.read())
    mods = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    mods |= {n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.level == 0}
    assert not {m for m in mods if m.split(".")[0] in ("mlx", "mlx_lm", "numpy", "torch")}


def test_rules_cover_every_codec_and_match_mlx_lm() -> None:
    prov = default_provider()
    assert sorted(MLX_LM_RULES) == prov.kinds
    for kind in prov.kinds:
        codec = prov.for_entry(fmt.CacheEntry(kind, 1, None, 0, False))
        assert codec.rule is MLX_LM_RULES[kind] and codec.reads == codec.rule.reads
        if codec.rule.step is not None:
            assert codec.cache_type().step == codec.rule.step == CAPACITY_STEP


# --- the two limits the validator adds ----------------------------------------------------------------


def test_capacity_step_is_the_most_a_load_grows() -> None:
    slot = fmt.Slot(0, 2 * 9 * 4 * 4, (1, 2, 9, 4), "float32")
    assert alloc_shape(slot, 9 + CAPACITY_STEP, "f")[2] == 9 + CAPACITY_STEP
    assert alloc_shape(slot, None, "f") == [1, 2, 9, 4]
    with pytest.raises(errors.CapacityTooLarge):
        alloc_shape(slot, 9 + CAPACITY_STEP + 1, "f")
    with pytest.raises(errors.CapacityTooLarge):  # zero rows never buy a step of the other dimensions
        alloc_shape(fmt.Slot(0, 0, (1, 64, 0, 16384), "float16"), CAPACITY_STEP, "f")


def test_a_capacity_step_adds_at_most_the_tensors_bytes_or_growth_max_bytes() -> None:
    """Found in review: a hostile file of one row of [1, 8192, 1, 8192] float32 (sparse: 16 KiB on disk) was
    allocated at 257 rows, 64 GiB, before any hash was read. A codec asks no such step (``grown``: the stored
    rows are loaded), and the loader refuses one asked (``CapacityTooLarge``)."""
    wide = fmt.Slot(0, 8192 * 8192 * 4, (1, 8192, 1, 8192), "float32")
    assert grown([wide], CAPACITY_STEP) is None
    with pytest.raises(errors.CapacityTooLarge):
        alloc_shape(wide, 1 + CAPACITY_STEP, "f")
    row = GROWTH_MAX_BYTES // CAPACITY_STEP  # a step of rows of this size adds GROWTH_MAX_BYTES exactly
    at = fmt.Slot(0, row, (1, 1, 1, row), "uint8")
    assert grown([at], CAPACITY_STEP) == CAPACITY_STEP
    assert alloc_shape(at, 1 + CAPACITY_STEP, "f")[2] == 1 + CAPACITY_STEP
    over = fmt.Slot(0, row + 17, (1, 1, 1, row + 17), "uint8")  # a step of 255 rows adds more than 1 MiB
    assert grown([over], CAPACITY_STEP) is None and grown([at, over], CAPACITY_STEP) is None
    with pytest.raises(errors.CapacityTooLarge):
        alloc_shape(over, 1 + CAPACITY_STEP, "f")
    big = fmt.Slot(0, 300 * (row + 1), (1, 1, 300, row + 1), "uint8")  # a step under its own bytes: taken
    assert grown([big], CAPACITY_STEP) == 512 and alloc_shape(big, 512, "f")[2] == 512


def test_a_caches_tensors_grow_together_or_not_at_all(tmp_path: Any) -> None:
    """Found in review: a KVCache whose value rows are wider than its key rows (16 heads, 128 and 256 wide, one
    token) loaded with keys grown to 256 rows and values not; mlx-lm's next update checks the keys' capacity only,
    and dropped the new value row. Rows that differ between a cache's tensors buy no step either. And a step past
    ``MAX_DIM`` (a zero-byte tensor of 2**31 - 100 rows) is never asked (found in review: an OverflowError)."""
    from mlx_lm.models.cache import KVCache

    cache = KVCache()
    cache.update_and_fetch(mx.ones((1, 16, 1, 128), mx.float16), mx.ones((1, 16, 1, 256), mx.float16))
    spilld.save(tmp_path / "a.spilld", [1], [cache], durability="none")
    (got,) = spilld.load(tmp_path / "a.spilld").caches
    assert got.keys.shape[2] == got.values.shape[2] == 1  # the values may not grow a step: neither does
    got.update_and_fetch(mx.full((1, 16, 1, 128), 2.0, mx.float16), mx.full((1, 16, 1, 256), 3.0, mx.float16))
    assert got.offset == 2 and got.values.shape[2] >= 2 and float(got.values[0, 0, 1, 0]) == 3.0
    k, v = fmt.Slot(0, 4096, (1, 16, 1, 128), "float16"), fmt.Slot(0, 8192, (1, 16, 2, 128), "float16")
    assert grown([k, v], CAPACITY_STEP) is None
    huge = fmt.Slot(0, 0, (1, 0, fmt.MAX_DIM - 99, 64), "float16")
    assert grown([huge], CAPACITY_STEP) is None


def test_max_array_slots(sample: bytes) -> None:
    wire, _ = split(sample)
    arrays = {
        "kind": "arrays",
        "v": 1,
        "offset": None,
        "min_reusable": 0,
        "trimmable": False,
        "fields": {"slots": [False] * MAX_ARRAY_SLOTS, "left_padding": False, "lengths": False},
        "tensors": [],
        "children": [],
    }
    wire["caches"] = [arrays]
    validate_header(fmt.header_from_wire(wire))
    arrays["fields"]["slots"].append(False)
    with pytest.raises(errors.FieldInvalid):
        validate_header(fmt.header_from_wire(wire))


def _ring_states() -> Iterator[tuple[str, Any]]:
    """mlx-lm's rings in the states its updates leave them: prefills of several tokens and decode steps, before and
    after they wrap, with and without sink rows (``keep``), single and batched (left padding)."""
    for keep in (0, 4):
        ring = C.RotatingKVCache(max_size=16, keep=keep)
        for n, s in enumerate([5, 1, 1, 12, 1, 1, 1, 20, *([1] * 20)]):
            ring.update_and_fetch(*kv(s, batch=1, heads=2, dim=16))
            yield f"rotating keep {keep} step {n}", ring
    batch = C.BatchRotatingKVCache(max_size=16, left_padding=[3, 0])
    for n, s in enumerate([10, *([1] * 12), 7, *([1] * 20)]):
        batch.update_and_fetch(*kv(s, batch=2, heads=2, dim=16))
        yield f"batch_rotating step {n}", batch


def test_every_state_of_mlx_lms_rings_passes_and_a_ring_state_none_reaches_is_refused(tmp_path: Any) -> None:
    """Found in review: a full ring's ``idx`` at or below its ``keep`` (the next decode step overwrote a sink row),
    and a batch ring flagged ``rotated`` before it filled (its padding mask moved onto real tokens), both passed.
    Every state mlx-lm's own updates reach passes; each hostile twin of one is refused."""
    seen = set()
    for i, (what, ring) in enumerate(_ring_states()):
        good = str(tmp_path / f"{i}.spilld")
        spilld.save(good, [], [ring], identity=IDENT, durability="none")
        spilld.loader.read_header(good)  # as mlx-lm left it
        with open(good, "rb") as fh:
            wire, body = split(fh.read())
        fields, pos = wire["caches"][0]["fields"], wire["caches"][0]["offset"]
        rows = min(pos, ring.keys.shape[2])
        if "keep" in fields and rows == ring.max_size and fields["idx"] != rows:
            seen.add("wrapped, idx inside")
            fields["idx"] = fields["keep"]  # the sink row the next step would overwrite
        elif "rotated" in fields and not fields["rotated"] and pos < ring.max_size:
            seen.add("not full, not rotated")
            fields["rotated"] = True
        elif fields.get("rotated") and fields["idx"] != rows:
            seen.add("rotated")
            fields["rotated"] = False  # its idx inside it: the rows would be taken as in order
        else:
            continue
        bad = write(str(tmp_path / f"{i}-bad.spilld"), join(wire, body))
        with pytest.raises((errors.IndexOutOfRange, errors.FieldInvalid)):
            spilld.loader.read_header(bad)
        assert what
    assert seen == {"wrapped, idx inside", "not full, not rotated", "rotated"}, seen


def test_unknown_field_keys_of_any_type_are_refused(sample: bytes) -> None:
    wire, _ = split(sample)
    wire["caches"][1]["fields"]["x"] = 1
    with pytest.raises(errors.FieldInvalid):
        validate_header(fmt.header_from_wire(wire))
    del wire["caches"][1]["fields"]["x"]
    wire["caches"][1]["fields"][b"raw"] = 1  # msgpack map keys may be bytes too: a name must be text, from the parser
    with pytest.raises(errors.HeaderMalformed, match=r"cache\.fields key"):
        fmt.header_from_wire(wire)


def _single_ring() -> Any:
    return fill(C.RotatingKVCache(max_size=32, keep=4), 20, heads=2, dim=16, dtype=mx.float16)


def _batch_ring() -> Any:
    ring = C.BatchRotatingKVCache(max_size=32, left_padding=[2, 0])
    ring.update_and_fetch(*kv(20, batch=2))
    return ring


@pytest.mark.parametrize("idx", [0, 1, 19])
@pytest.mark.parametrize("make", [_single_ring, _batch_ring], ids=["rotating", "batch_rotating"])
def test_a_ring_that_has_not_wrapped_must_write_at_its_end(tmp_path: Any, make: Callable[[], Any], idx: int) -> None:
    """Found in review: an unwrapped rotating ring (offset < max_size: every token held, in order) with ``idx`` below
    its rows passed, and a load cut back to fewer tokens trimmed mlx-lm's ``_idx`` below zero: the next token was
    written nowhere and the attention kept a row of the cut tokens. mlx-lm's own rings (the batch one too) write at
    their end until they wrap, so ``idx`` must equal their rows."""
    good = str(tmp_path / "good.spilld")
    spilld.save(good, list(range(20)), [make()], identity=IDENT)
    spilld.loader.read_header(good)  # as mlx-lm wrote it: idx 20
    with open(good, "rb") as f:
        wire, body = split(f.read())
    assert wire["caches"][0]["fields"]["idx"] == 20
    wire["caches"][0]["fields"]["idx"] = idx
    bad = write(str(tmp_path / "bad.spilld"), join(wire, body))
    with pytest.raises(errors.IndexOutOfRange):
        spilld.loader.read_header(bad)


def _ring_file(path: str, ring: Any, tokens: int) -> tuple[Wire, bytes]:
    spilld.save(path, list(range(tokens)), [ring], identity=IDENT, durability="none")
    with open(path, "rb") as f:
        return split(f.read())


def test_ring_rules_give_the_codes_format_md_names(tmp_path: Any) -> None:
    """docs/format.md §5.1 rule 7, code by code (found in review: the rule named only ``offset_mismatch`` and
    ``index_out_of_range``, while a ring's ``keep`` above its ``max_size`` and a batch ring ``rotated`` before it
    is full are ``field_invalid``): each breach of a ring's rule, made from a file mlx-lm's own ring wrote."""
    ring = C.RotatingKVCache(max_size=16, keep=4)
    ring.update_and_fetch(*kv(5, batch=1, heads=2, dim=16))
    batch = C.BatchRotatingKVCache(max_size=16, left_padding=[3, 0])
    batch.update_and_fetch(*kv(10, batch=2, heads=2, dim=16))
    files = {
        "ring": _ring_file(str(tmp_path / "r.spilld"), ring, 5),
        "batch": _ring_file(str(tmp_path / "b.spilld"), batch, 10),
    }
    cases: list[tuple[str, dict[str, Any], type[errors.SpillError]]] = [
        ("ring", {"keep": 17}, errors.FieldInvalid),  # keep > max_size
        ("ring", {"keep": 17, "idx": 99}, errors.FieldInvalid),  # checked before the rows and idx
        ("ring", {"idx": 6}, errors.IndexOutOfRange),  # idx > rows
        ("ring", {"idx": 4}, errors.IndexOutOfRange),  # not wrapped: idx = rows
        ("ring", {"max_size": 4, "keep": 0}, errors.OffsetMismatch),  # trimmable must be offset < max_size
        ("batch", {"rotated": True}, errors.FieldInvalid),  # pos 10 < max_size 16
        ("batch", {"pos": 9}, errors.OffsetMismatch),  # offset = pos
        ("batch", {"idx": 9}, errors.IndexOutOfRange),  # not rotated: idx = rows
    ]
    for n, (which, fields, err) in enumerate(cases):
        wire, body = copy.deepcopy(files[which][0]), files[which][1]
        wire["caches"][0]["fields"].update(fields)
        bad = write(str(tmp_path / f"bad{n}.spilld"), join(wire, body))
        with pytest.raises(errors.SpillError) as got:
            spilld.loader.read_header(bad)
        assert type(got.value) is err, (which, fields, got.value)
