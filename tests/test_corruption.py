"""Every corruption is refused with a typed error; nothing wrong is ever returned."""

from __future__ import annotations

import os
import random
import struct
from collections import Counter
from typing import Any

import mlx.core as mx
import msgpack
import pytest
from mlx_lm.models import cache as C

import spilld
import spilld.loader
from spilld import errors
from spilld import format as fmt
from tests.caches import fill
from tests.hostile import wire_align


@pytest.fixture
def sample(tmp_path: Any) -> tuple[str, bytes]:
    caches = [fill(C.KVCache(), 40, seed=1), fill(C.RotatingKVCache(16, keep=2), 30, chunk=4, seed=2)]
    path = str(tmp_path / "good.spilld")
    spilld.save(path, list(range(40)), caches, identity=spilld.Identity("m", "fp", "tok", "ns"))
    with open(path, "rb") as f:
        return path, f.read()


def write(path: str, data: bytes) -> str:
    with open(path, "wb") as f:
        f.write(data)
    return path


def test_each_header_byte_flipped_is_refused(tmp_path: Any, sample: tuple[str, bytes]) -> None:
    _, data = sample
    hl = struct.unpack_from("<I", data, 12)[0]
    bad = str(tmp_path / "bad")
    for i in range(fmt.PREFIX_LEN + hl):
        b = bytearray(data)
        b[i] ^= 0xFF
        write(bad, bytes(b))
        with pytest.raises(errors.FileFormatError):
            spilld.load(bad)


def test_nonzero_padding_is_refused(tmp_path: Any, sample: tuple[str, bytes]) -> None:
    _, data = sample
    hl = struct.unpack_from("<I", data, 12)[0]
    b = bytearray(data)
    b[fmt.PREFIX_LEN + hl + 3] = 1
    with pytest.raises(errors.PaddingNotZero):
        spilld.load(write(str(tmp_path / "bad"), bytes(b)))


def test_random_tensor_bytes_flipped_are_refused(tmp_path: Any, sample: tuple[str, bytes]) -> None:
    _, data = sample
    h = spilld.loader.read_header(sample[0])
    rng = random.Random(7)
    bad = str(tmp_path / "bad")
    for _ in range(200):
        s = rng.choice([s for s in h.slots() if s.nbytes])
        i = h.data_start + s.off + rng.randrange(s.nbytes)
        b = bytearray(data)
        b[i] ^= 1 << rng.randrange(8)
        write(bad, bytes(b))
        with pytest.raises(errors.TensorHashMismatch):
            spilld.load(bad)
    # without verification the same file loads: hashing is what catches it
    assert spilld.load(bad, verify=False).caches


def test_truncation_at_every_page_boundary_is_refused(tmp_path: Any, sample: tuple[str, bytes]) -> None:
    _, data = sample
    bad = str(tmp_path / "bad")
    cuts = sorted({*range(0, len(data), 4096), *range(0, 64), len(data) - 1})
    for n in cuts:
        write(bad, data[:n])
        with pytest.raises(errors.FileFormatError):
            spilld.load(bad)


def test_appended_bytes_are_refused(tmp_path: Any, sample: tuple[str, bytes]) -> None:
    with pytest.raises(errors.LayoutError):
        spilld.load(write(str(tmp_path / "bad"), sample[1] + b"\0"))


def test_bad_magic_and_version(tmp_path: Any, sample: tuple[str, bytes]) -> None:
    _, data = sample
    with pytest.raises(errors.BadMagic):
        spilld.load(write(str(tmp_path / "a"), b"PK\x03\x04" + data[4:]))
    with pytest.raises(errors.TruncatedFile):
        spilld.load(write(str(tmp_path / "b"), b""))
    with pytest.raises(errors.BadMagic):
        spilld.load(write(str(tmp_path / "c"), b'{"not": 1}'))
    b = bytearray(data)
    struct.pack_into("<I", b, 8, 99)
    with pytest.raises(errors.UnsupportedVersion):
        spilld.load(write(str(tmp_path / "d"), bytes(b)))


def _with_header(data: bytes, mutate: Any) -> bytes:
    """Re-encode a file with a changed header and a correct header hash."""
    prefix = fmt.decode_prefix(data[: fmt.PREFIX_LEN], len(data))
    raw = msgpack.unpackb(data[fmt.PREFIX_LEN : fmt.PREFIX_LEN + prefix.header_len], raw=False)
    mutate(raw)
    hb = msgpack.packb(raw, use_bin_type=True)
    head, _ = fmt.encode_prefix(hb, align=wire_align(raw))
    return head + data[prefix.data_start :]


def test_a_data_start_of_the_other_alignment_is_refused(tmp_path: Any, sample: tuple[str, bytes]) -> None:
    _, data = sample
    prefix = fmt.decode_prefix(data[: fmt.PREFIX_LEN], len(data))
    hb = data[fmt.PREFIX_LEN : fmt.PREFIX_LEN + prefix.header_len]
    assert msgpack.unpackb(hb, raw=False)["align"] == fmt.COMPACT_ALIGN
    head, start = fmt.encode_prefix(hb, align=fmt.ALIGN)  # the header says packed, the prefix page-aligned
    with pytest.raises(errors.LayoutError, match="does not follow"):
        spilld.load(write(str(tmp_path / "x"), head + b"\0" * (len(data) - prefix.data_start)))
    assert start != prefix.data_start


def test_absurd_lengths_are_refused_before_allocating(tmp_path: Any, sample: tuple[str, bytes]) -> None:
    _, data = sample
    for field_off, value, err in [
        (12, 2**32 - 1, errors.HeaderTooLarge),
        (12, fmt.MAX_HEADER_BYTES + 1, errors.HeaderTooLarge),  # one over the limit
        (12, fmt.MAX_HEADER_BYTES, errors.TruncatedFile),  # at it: taken, then found longer than the file
        (16, 2**63, errors.LayoutError),
    ]:
        b = bytearray(data)
        if field_off == 16:
            struct.pack_into("<Q", b, 16, value)
        else:
            struct.pack_into("<I", b, 12, value)
            struct.pack_into("<Q", b, 16, fmt.align_up(fmt.PREFIX_LEN + value))
        with pytest.raises(err):
            spilld.load(write(str(tmp_path / "x"), bytes(b)))


@pytest.mark.parametrize(
    ("mutate", "err"),
    [
        (lambda h: h["caches"][0]["tensors"][0].update(shape=[1] * (fmt.MAX_RANK + 1)), errors.RankTooLarge),
        (lambda h: h["caches"][0]["tensors"][0].update(shape=[fmt.MAX_DIM + 1, 1, 1, 1]), errors.DimensionTooLarge),
        (
            lambda h: h["caches"][0]["tensors"][0].update(shape=[2**20, 2**20, 2, 1], bytes=2**41),
            errors.TotalSizeTooLarge,
        ),
        (
            lambda h: h["caches"][0]["tensors"].extend([h["caches"][0]["tensors"][0]] * fmt.MAX_TENSORS),
            errors.TooManyTensors,
        ),
        (lambda h: h.update(tokens=b"\0" * 4 * (fmt.MAX_TOKENS + 1)), errors.TooManyTokens),
        (
            lambda h: h["caches"][0]["tensors"][1].update(off=h["caches"][0]["tensors"][1]["off"] + fmt.ALIGN),
            errors.LayoutError,
        ),
        (lambda h: h["caches"][0]["tensors"][1].update(off=0), errors.LayoutError),
        (lambda h: h.update(align=7), errors.FieldInvalid),
        (lambda h: h.update(align=True), errors.HeaderMalformed),
        (lambda h: h.update(align=fmt.ALIGN), errors.LayoutError),  # a packed file's tensors, said page-aligned
        (lambda h: h.pop("align"), errors.HeaderMalformed),  # required in v3
        (
            lambda h: h["caches"][0]["tensors"][0].update(bytes=h["caches"][0]["tensors"][0]["bytes"] - 4),
            errors.LayoutError,
        ),
        (lambda h: h["caches"][0]["tensors"][0].update(dtype="float128"), errors.HeaderMalformed),
        (lambda h: h["caches"][0].update(offset="ten"), errors.HeaderMalformed),
        (lambda h: h["caches"][0].update(min_reusable=10**6), errors.HeaderMalformed),
        (lambda h: h["caches"][0]["tensors"][0].update(hash=b"short"), errors.HeaderMalformed),
        (lambda h: h.pop("identity"), errors.HeaderMalformed),
        (lambda h: h.update(format=4), errors.VersionMismatch),  # 4 is the unknown one now
        (
            lambda h: h.update(
                checkpoint={
                    "key": "k",
                    "cache_ns": "",
                    "original_prompt_tokens": 3,
                    "generated_tokens": 1,
                    "pending_token": 5,
                    "seed": 1,
                    "seed_was_explicit": False,
                }
            ),
            errors.CheckpointInconsistent,
        ),
        (lambda h: h["caches"][0].update(children=[_nest(fmt.MAX_NESTING + 1)]), errors.NestingTooDeep),
        (lambda h: h["caches"][0].update(kind="mystery"), errors.KindNotInProvider),
        (lambda h: h["caches"][0].update(v=9), errors.CodecVersionUnsupported),
        (lambda h: h["caches"][0]["tensors"].pop(), errors.FileFormatError),
    ],
)
def test_hostile_headers(tmp_path: Any, sample: tuple[str, bytes], mutate: Any, err: type[Exception]) -> None:
    path = write(str(tmp_path / "x"), _with_header(sample[1], mutate))
    with pytest.raises(err):
        spilld.load(path)


def _nest(depth: int) -> dict[str, Any]:
    e: dict[str, Any] = {
        "kind": "list",
        "v": 1,
        "offset": None,
        "min_reusable": 0,
        "trimmable": True,
        "fields": {},
        "tensors": [],
        "children": [],
    }
    if depth:
        e["children"] = [_nest(depth - 1)]
    return e


def test_hostile_msgpack_is_refused(tmp_path: Any) -> None:
    for hb in [b"\xc1", b"\x91" * 5000 + b"\xc0", msgpack.packb([1, 2, 3]), msgpack.packb({"format": 1})]:
        head, _ = fmt.encode_prefix(hb)
        with pytest.raises(errors.HeaderMalformed):
            spilld.load(write(str(tmp_path / "x"), head))


def test_foreign_identity_is_refused_before_reading_tensors(tmp_path: Any, sample: tuple[str, bytes]) -> None:
    path, _ = sample
    for field in ("model_id", "config_fingerprint", "tokenizer_hash", "namespace"):
        want = {field: "other"}
        with pytest.raises(errors.IdentityMismatch, match=field):
            spilld.load(path, expect=want)
    assert spilld.load(path, expect=spilld.Identity("m", "fp", "tok", "ns")).tokens == list(range(40))
    assert spilld.load(path, expect={"model_id": "m"}).caches


def test_foreign_codec_provider_allocates_nothing(tmp_path: Any, sample: tuple[str, bytes], monkeypatch: Any) -> None:
    path = write(str(tmp_path / "x"), _with_header(sample[1], lambda h: h.update(codec_provider="someone-else/9")))
    calls = []
    real = mx.zeros
    monkeypatch.setattr(mx, "zeros", lambda *a, **k: calls.append(a) or real(*a, **k))
    with pytest.raises(errors.CodecProviderMismatch):
        spilld.load(path)
    assert calls == []


def test_errors_name_the_file(tmp_path: Any) -> None:
    path = write(str(tmp_path / "named.spilld"), b"garbage" * 10)
    with pytest.raises(errors.BadMagic) as info:
        spilld.load(path)
    assert "named.spilld" in str(info.value) and info.value.code == "bad_magic"


# Every code released so far: a code crosses sockets and lands in logs and dashboards, so none may disappear.
RELEASED_CODES = frozenset(
    {
        "activation_error", "already_running", "bad_file", "bad_layout", "bad_magic", "bad_params", "busy",
        "checkpoint_inconsistent", "codec_provider_mismatch", "codec_version_unsupported", "connection_lost",
        "dimension_too_large", "disk_full", "error", "frame_too_large", "header_hash_mismatch", "header_malformed",
        "header_too_large", "identity_mismatch", "io_error", "nesting_too_deep", "not_reusable", "padding_not_zero",
        "peer_refused", "plan_drift", "protocol_error", "rank_too_large", "save_aborted", "shm_refused",
        "tensor_hash_mismatch", "timeout", "too_many_tensors", "too_many_tokens", "total_size_too_large", "truncated",
        "unknown_cache_kind", "unknown_method", "unsupported_cache", "unsupported_protocol", "unsupported_version",
        "block_invalid", "block_key_mismatch", "block_missing", "capacity_too_large", "dtype_not_allowed",
        "duplicate_hello", "field_invalid", "foreign_daemon", "held_block_gone", "index_out_of_range", "io_timeout",
        "kind_not_in_provider", "not_admitted", "offset_beyond_tokens", "offset_mismatch", "quantization_invalid",
        "shape_mismatch", "shed", "slot_size_mismatch", "tensor_count_mismatch", "tensor_rank_mismatch",
        "unusable_folder", "version_mismatch", "write_budget_spent", "lease_refused", "not_started",
        "not_a_daemon", "closed",
    }
)  # fmt: skip


def _spilld_error_classes() -> list[type[errors.SpillError]]:
    """Every ``SpillError`` subclass that spilld defines, wherever it lives (each module imported first)."""
    import importlib
    import pkgutil

    for m in pkgutil.walk_packages(spilld.__path__, "spilld."):
        if not m.name.endswith("__main__"):
            importlib.import_module(m.name)
    out, todo = [], [errors.SpillError]
    while todo:
        cls = todo.pop()
        out.append(cls)
        todo += cls.__subclasses__()
    return [c for c in out if c.__module__.split(".")[0] == "spilld"]  # not the ones tests define


def test_every_error_class_has_its_own_stable_code_that_rebuilds_it() -> None:
    classes = _spilld_error_classes()
    assert len(classes) >= len(RELEASED_CODES)
    inherited = [c.__name__ for c in classes if "code" not in vars(c)]
    assert inherited == []  # a subclass that inherits its parent's code cannot be told apart on the wire
    codes = Counter(c.code for c in classes)
    assert [code for code, n in codes.items() if n > 1] == []
    assert sorted(RELEASED_CODES - set(codes)) == []  # no released code was renamed or removed
    assert sorted(set(codes) - RELEASED_CODES) == []  # and a new one joins the list above as it ships
    for cls in classes:
        e = errors.error_from_code(cls.code, "boom")
        assert type(e) is cls and str(e) == "boom", cls
    assert type(errors.error_from_code("no-such-code", "x")) is errors.SpillError


def test_a_process_that_imported_only_errors_rebuilds_every_code() -> None:
    """A client process never imports the daemon or the service: the code registry must not fill by side effects."""
    import json
    import subprocess
    import sys

    code = (
        "import json, spilld.errors as e; "
        "print(json.dumps({c: f'{k.__module__}.{k.__qualname__}' for c, k in e.ERRORS_BY_CODE.items()}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    fresh = json.loads(out.stdout)
    want = {c.code: f"{c.__module__}.{c.__qualname__}" for c in _spilld_error_classes()}
    assert fresh == want


def test_loads_leave_no_fd_open(sample: tuple[str, bytes], tmp_path: Any) -> None:
    from tests.conftest import open_fds

    before = open_fds()
    for _ in range(5):
        spilld.load(sample[0])
        with pytest.raises(errors.FileFormatError):
            spilld.load(write(str(tmp_path / "t"), sample[1][:5000]))
    assert open_fds() == before


@pytest.mark.parametrize("rows", [40, 8192])  # 10 KiB of tensors: packed; 2 MiB: page-aligned
def test_file_is_aligned_by_its_size_and_ends_at_last_tensor(rows: int, tmp_path: Any) -> None:
    path = str(tmp_path / "f.spilld")
    spilld.save(path, list(range(rows)), [fill(C.KVCache(), rows, seed=1), fill(C.KVCache(), rows, seed=2)])
    h = spilld.loader.read_header(path)
    align = fmt.COMPACT_ALIGN if h.data_bytes < fmt.COMPACT_BELOW else fmt.ALIGN
    assert (h.data_bytes < fmt.COMPACT_BELOW) == (rows == 40) and h.align == align
    # the data starts at the first multiple of the alignment after the header: a packed file wastes no page
    assert h.data_start == fmt.align_up(fmt.PREFIX_LEN + len(fmt.pack_header(h)), align)
    assert all(s.off % align == 0 for s in h.slots())
    last = max(s.off + s.nbytes for s in h.slots())
    assert h.data_start + last == os.path.getsize(path)
    assert (h.data_start + last < fmt.ALIGN) == (rows == 40)


def test_a_header_of_empty_containers_is_refused_before_it_expands(tmp_path: Any) -> None:
    """A header with a right hash and a key the parser ignores, holding a million empty maps: refused as
    `header_malformed` by the bounded decoder, its objects never made (found in review: ~72 bytes each, so a
    64 MiB header would have been ~4.6 GiB at every read of the file)."""
    import tracemalloc

    wire = {"format": fmt.FORMAT_VERSION, "junk": [{} for _ in range(1 << 20)]}
    hb = msgpack.packb(wire, use_bin_type=True)
    head, _ = fmt.encode_prefix(hb, version=fmt.FORMAT_VERSION, align=fmt.COMPACT_ALIGN)
    path = tmp_path / "x.spilld"
    path.write_bytes(head + bytes(4096))
    tracemalloc.start()
    try:
        with pytest.raises(errors.HeaderMalformed, match="maps and arrays"):
            spilld.loader.read_header(path)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 * len(hb), (peak, len(hb))
