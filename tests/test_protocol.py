"""The frame decoder, fed bytes: no sockets. Every limit and malformation gets a typed error."""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from spilld import errors
from spilld import protocol as P
from tests.conftest import LONG


def join(bufs: list[bytes | memoryview]) -> bytes:
    return b"".join(bytes(b) for b in bufs)


def test_roundtrip_every_shape() -> None:
    data = (
        join(P.request(7, "lookup", {"a": 1}))
        + join(P.response(7, {"hit": False}))
        + join(P.notification("put", {"i": 0}, b"\x01" * 100))
    )
    msgs = P.FrameDecoder().feed(data)
    assert [m.kind for m in msgs] == [P.REQUEST, P.RESPONSE, P.NOTIFICATION]
    assert msgs[0].method == "lookup" and msgs[0].msgid == 7 and msgs[0].params == {"a": 1}
    assert msgs[1].result == {"hit": False} and msgs[1].error is None
    assert bytes(msgs[2].payload) == b"\x01" * 100


def test_byte_by_byte_feeding_gives_the_same_frames() -> None:
    data = join(P.request(1, "status", {})) + join(P.notification("put", {"x": 2}, b"abc"))
    dec = P.FrameDecoder()
    out = []
    for i in range(len(data)):
        out += dec.feed(data[i : i + 1])
    assert [m.method for m in out] == ["status", "put"] and bytes(out[1].payload) == b"abc"
    assert dec.buffered == 0


def test_error_responses_carry_stable_codes() -> None:
    [m] = P.FrameDecoder().feed(join(P.response(3, error=P.Busy("full"))))
    with pytest.raises(P.Busy):
        P.raise_for(m.error)
    with pytest.raises(errors.TensorHashMismatch):
        P.raise_for({"code": "tensor_hash_mismatch", "message": "x"})


@pytest.mark.parametrize(
    ("mlen", "plen"), [(P.MAX_MSG_BYTES + 1, 0), (10, P.MAX_PAYLOAD_BYTES + 1), (2**32 - 1, 2**32 - 1)]
)
def test_oversized_lengths_are_refused_before_buffering(mlen: int, plen: int) -> None:
    with pytest.raises(P.FrameTooLarge):
        P.FrameDecoder().feed(struct.pack("<II", mlen, plen))


@pytest.mark.parametrize(
    "body",
    [
        b"\xc1",  # never-used msgpack byte
        msgpack.packb({"not": "an array"}),
        msgpack.packb([]),
        msgpack.packb([9, 1, "x", {}]),
        msgpack.packb([0, "id", "m", {}]),
        msgpack.packb([0, 1, 2, {}]),
        msgpack.packb([0, 1, "m", [1]]),
        msgpack.packb([0, 1, "m" * (P.MAX_METHOD_LEN + 1), {}]),
        msgpack.packb([0, 1, "m"]),
        msgpack.packb([2, "m"]),
        msgpack.packb([1, "x", None, 1]),
        msgpack.packb([0, 1, "m", {"a": [[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]]}]),
        msgpack.packb({1: 2}) + b"",
    ],
)
def test_malformed_messages_are_protocol_errors(body: bytes) -> None:
    with pytest.raises(P.ProtocolError):
        P.FrameDecoder().feed(struct.pack("<II", len(body), 0) + body)


def test_a_flood_of_unread_frames_is_cut_off() -> None:
    one = join(P.notification("put", {}))
    dec = P.FrameDecoder()
    with pytest.raises(P.ProtocolError):
        dec.feed(one * (P.MAX_PENDING_FRAMES + 1))


def test_encoder_refuses_what_the_decoder_would() -> None:
    with pytest.raises(P.FrameTooLarge):
        P.request(1, "spill", {"h": b"x" * (P.MAX_MSG_BYTES + 1)})
    with pytest.raises(P.FrameTooLarge):
        P.notification("put", {}, memoryview(bytearray(P.MAX_PAYLOAD_BYTES + 1)))


@settings(max_examples=20_000 if not LONG else 1_000_000, deadline=None, suppress_health_check=list(HealthCheck))
@given(st.binary(max_size=64))
def test_fuzz_random_bytes_never_crash(data: bytes) -> None:
    dec = P.FrameDecoder(max_msg=256, max_payload=256)
    try:
        for m in dec.feed(data):
            assert m.kind in (P.REQUEST, P.RESPONSE, P.NOTIFICATION)
    except P.ProtocolError:
        pass


@settings(max_examples=2_000 if not LONG else 100_000, deadline=None)
@given(
    st.recursive(
        st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8) | st.binary(max_size=8),
        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=4), c, max_size=4),
        max_leaves=20,
    )
)
def test_fuzz_any_msgpack_value_is_a_message_or_a_protocol_error(value: object) -> None:
    body = msgpack.packb(value, use_bin_type=True)
    try:
        P.FrameDecoder().feed(struct.pack("<II", len(body), 0) + body)
    except P.ProtocolError:
        pass


def test_a_payload_not_admitted_is_read_through_a_small_buffer_and_thrown_away() -> None:
    seen: list[tuple[object, int]] = []
    sizes: list[int] = []

    def admit(raw: object, n: int) -> bool:
        seen.append((raw, n))
        return n < 1000

    dec = P.FrameDecoder(admit_payload=admit, admit_msg=sizes.append)
    big = b"\x07" * (P.DISCARD_CHUNK * 3 + 5)
    data = join(P.notification("put", {"i": 1}, big)) + join(P.notification("put", {"i": 2}, b"ok"))
    out: list[P.Message] = []
    pos, largest = 0, 0
    while pos < len(data):  # as the daemon's socket feeds it: into the buffer the decoder lends
        buf = dec.get_buffer()
        largest = max(largest, len(buf)) if dec._raw is not None and dec._raw is not P._UNSET else largest
        n = min(len(buf), len(data) - pos)
        buf[:n] = data[pos : pos + n]
        pos += n
        out += dec.buffer_updated(n)
    assert [m.params["i"] for m in out] == [1, 2]
    assert out[0].discarded == len(big) and out[0].payload == b"" and bytes(out[1].payload) == b"ok"
    assert largest <= P.DISCARD_CHUNK  # never a buffer for the refused payload itself
    assert [n for _, n in seen] == [len(big), 2] and len(sizes) == 2  # every message asked before its buffer


def _traced_peak(fn: object) -> int:
    import tracemalloc

    tracemalloc.start()
    try:
        fn()  # type: ignore[operator]
    except errors.SpillError:
        pass
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


@pytest.mark.parametrize("empty", [b"\x80", b"\x90"], ids=["maps", "arrays"])
def test_a_message_of_empty_containers_is_refused_before_it_expands(empty: bytes) -> None:
    """msgpack makes a 64-72 byte object of each one-byte empty map or array: a 4 MiB message of them was ~300 MiB
    of objects, against the 12x its size the daemon counted for it (found in review). The decoder now refuses more
    containers than ``container_limit`` of the message's size, so what it makes stays within MAX_EXPANSION x."""
    from spilld.unpack import MAX_EXPANSION

    n = P.MAX_MSG_BYTES - 32
    body = b"\x94\x02\xa4note\xdd" + struct.pack(">I", n) + empty * n  # [2, "note", [{}, {}, ...]] (4 long)
    body = body[: P.MAX_MSG_BYTES]
    dec = P.FrameDecoder()
    peak = _traced_peak(lambda: dec.feed(P.FRAME_HEAD.pack(len(body), 0) + body))
    with pytest.raises(P.ProtocolError, match="maps and arrays"):
        P.FrameDecoder().feed(P.FRAME_HEAD.pack(len(body), 0) + body)
    assert peak < MAX_EXPANSION * len(body), (peak, len(body))


@pytest.mark.parametrize(
    "item",
    [b"\xf6", b"\xd0\x80", b"\xa2\xc4\x80", b"\xa2ab", b"\xd4\x01\x01", b"\xcd\x01\x01", b"\xc0"],
    ids=["negative-fixint", "int8", "ucs2-char", "two-chars", "fixext1", "uint16", "nil"],
)
def test_a_message_of_small_scalars_stays_within_max_expansion(item: bytes) -> None:
    """Found in review: CPython caches the ints -5..256 only, so each negative fixint (-32..-6, one byte) became
    a new int and a list slot: 40.8x its size, against the 24x the daemon counted a message. Every scalar msgpack
    has, packed as densely as it goes, stays within MAX_EXPANSION x."""
    from spilld.unpack import MAX_EXPANSION

    n = (P.MAX_MSG_BYTES - 32) // len(item)
    body = b"\x94\x02\xa4note\xdd" + struct.pack(">I", n) + item * n
    dec = P.FrameDecoder()
    peak = _traced_peak(lambda: dec.feed(P.FRAME_HEAD.pack(len(body), 0) + body))
    assert peak < MAX_EXPANSION * len(body), (peak / len(body), len(body))


def test_the_largest_headers_spilld_writes_are_within_the_container_limit() -> None:
    """The bound refuses nothing spilld makes: every golden header, and a spill header of MAX_OPEN_TENSORS kv
    tensors (one container per ~30 bytes: a tensor's map and its shape), decode through the bounded decoder."""
    from spilld.daemon.ingest import MAX_OPEN_TENSORS
    from spilld.saver import plan
    from spilld.unpack import container_limit, unpack
    from tests.golden_cases import GOLDEN, GOLDEN_TOKENS

    for make in GOLDEN.values():
        wire = msgpack.packb(plan(GOLDEN_TOKENS, make())[0].to_wire(), use_bin_type=True)
        assert unpack(wire) == msgpack.unpackb(wire, raw=False)
    slot = {"off": 0, "bytes": 2 * 8 * 128, "shape": [1, 8, 1, 128], "dtype": "float16", "hash": b"\0" * 8}
    entry = {"kind": "kv", "v": 1, "offset": 1, "min_reusable": 0, "trimmable": True, "fields": {}, "children": []}
    caches = [{**entry, "tensors": [slot, slot]} for _ in range(MAX_OPEN_TENSORS // 2)]
    big = msgpack.packb({"format": 3, "tokens": b"\0\0\0\0", "caches": caches}, use_bin_type=True)
    assert len(big) <= P.MAX_MSG_BYTES and 4 * len(caches) + 2 <= container_limit(len(big))
    assert unpack(big)["caches"][-1]["tensors"][1]["shape"] == [1, 8, 1, 128]


def test_the_container_bound_at_and_one_over_and_where_counting_starts() -> None:
    """docs/format.md §10 ("containers"): a message of ``COUNT_FROM_BYTES`` or more holds at most one map or array
    per ``BYTES_PER_CONTAINER`` bytes plus ``CONTAINER_SLACK``; a shorter one is not counted. Found in review: no
    test hit the bound at its edge, nor where counting starts."""
    from spilld.unpack import COUNT_FROM_BYTES, TooManyContainers, container_limit, unpack

    def message(size: int, containers: int) -> bytes:
        """An array of ``containers - 1`` empty maps padded with nil to ``size`` bytes (array 32 heads: 5 bytes)."""
        items = containers - 1
        body = b"\xdd" + struct.pack(">I", items + (size - 5 - items)) + b"\x80" * items + b"\xc0" * (size - 5 - items)
        assert len(body) == size
        return body

    n = COUNT_FROM_BYTES
    assert (n, container_limit(n)) == (64 * 1024, 64 * 1024 // 16 + 64)  # the values the doc gives
    assert len(unpack(message(n, container_limit(n)))) == n - 5
    with pytest.raises(TooManyContainers):
        unpack(message(n, container_limit(n) + 1))
    assert len(unpack(message(n - 1, container_limit(n - 1) + 1000))) == n - 6  # below the size counted from


def test_the_nesting_check_walks_into_containers_only_and_keeps_its_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in review: the check of a message's nesting walked every item in Python, on the event loop: 0.75 s for a
    4 MiB spill header of 4 M small ints. It picks a container's containers by C calls now, and visits only them;
    the limit is the same (items of a container at ``MAX_NESTING`` are one level too deep)."""
    from spilld import protocol

    def nest(n: int, leaf: object = 1) -> object:
        for _ in range(n):
            leaf = [leaf]
        return leaf

    limit = protocol.MAX_NESTING
    assert protocol._depth_ok(nest(limit)) and protocol._depth_ok(nest(limit, []))
    assert not protocol._depth_ok(nest(limit + 1)) and not protocol._depth_ok({"k": nest(limit)})
    assert protocol._depth_ok((1, {"k": nest(limit - 2)}))
    calls = 0
    real = protocol._depth_ok

    def counting(obj: object, depth: int = 0) -> bool:
        nonlocal calls
        calls += 1
        return real(obj, depth)

    monkeypatch.setattr(protocol, "_depth_ok", counting)
    assert protocol._depth_ok([-20] * 100_000 + [[1, 2], {"a": []}])
    assert calls == 4  # the list, [1, 2], {"a": []} and []: never one of the ints
