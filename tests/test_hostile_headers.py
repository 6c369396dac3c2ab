"""Hostile headers of every codec: each mutant either loads exactly the original data or is refused with a
typed error, by the loader, ``spilld verify``, the index scan and the daemon's spill check alike, and a load
never allocates more than the file's tensor bytes plus one capacity step per growing cache.

Two sources of mutants: the checked-in corpus (tests/data/hostile/, scripts/make_hostile_corpus.py), and
hypothesis (>= 2,000 mutants per codec; 20,000 with SPILLD_LONG=1)."""

from __future__ import annotations

import json
import os
import socket
import tempfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import mlx.core as mx
import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import spilld
import spilld.loader
from spilld import errors
from spilld import format as fmt
from spilld import protocol as P
from spilld.codecs.rules import MLX_LM_RULES
from spilld.store import Store
from tests.conftest import LONG
from tests.daemons import Daemon, cleanup, new_root
from tests.golden_cases import GOLDEN
from tests.hostile import (
    CORPUS,
    OK,
    PREFIX_VALUES,
    PREFIX_VERSION,
    Path,
    apply,
    file_outcome,
    get,
    golden,
    join,
    outcome,
    paths,
    spill_blind,
    spill_outcome,
    split,
    values_for,
)

KINDS = list(GOLDEN)
MUTANTS_PER_CODEC = 20_000 if LONG else 2_000
ALLOC_SLACK = 64 * 1024  # mlx's own small buffers beside the tensors (per-sequence offsets, rounding)
GOLDEN_IDENT = spilld.Identity("golden", "fp-golden", "tok-golden", "ns")


def corpus(kind: str) -> list[dict[str, Any]]:
    with open(os.path.join(CORPUS, f"{kind}.msgpack.z"), "rb") as f:
        return list(msgpack.unpackb(zlib.decompress(f.read()), raw=False)["mutants"])


def alloc_bound(header: fmt.Header) -> int:
    """The file's tensor bytes plus one capacity step of rows for each tensor of a cache that grows."""
    bound = header.data_bytes

    def entry(e: fmt.CacheEntry) -> int:
        rule = MLX_LM_RULES.get(e.kind)
        extra = 0
        if rule is not None and rule.step is not None:
            for s in e.tensors:
                rows = s.shape[-2] if len(s.shape) >= 2 else 0
                extra += rule.step * (s.nbytes // rows) if rows else 0
        return extra + sum(entry(c) for c in e.children)

    return bound + sum(entry(e) for e in header.caches) + ALLOC_SLACK


def load_exactly(path: str, scratch: str) -> str:
    """Load an admitted file; its tensors must be the original bytes (a re-save gives the same hashes), and
    the load must stay within ``alloc_bound``. Returns ``ok`` or the typed refusal the loader gave."""
    header = spilld.loader.read_header(path)
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    try:
        got = spilld.load(path)
    except errors.SpillError as exc:
        return exc.code
    peak = mx.get_peak_memory() - before
    assert peak <= alloc_bound(header), f"{path}: a load took {peak} bytes, bound {alloc_bound(header)}"
    again = spilld.save(os.path.join(scratch, "again.spilld"), got.tokens, got.caches, durability="none").header
    assert [s.hash for s in again.slots()] == [s.hash for s in header.slots()]
    return OK


@dataclass
class Seen:
    """Mutants placed in a store folder, to check a scan against what the loader said of each."""

    root: str
    files: dict[str, str] = field(default_factory=dict)  # path -> the header check's outcome
    n: int = 0

    def place(self, data: bytes, wire: Any, code: str) -> None:
        try:
            ident = fmt.header_from_wire(wire).identity
        except errors.SpillError:
            ident = GOLDEN_IDENT
        store = Store(self.root)
        path = store.new_path(ident, ident.namespace)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "wb") as f:
            f.write(data)
        self.files[path] = code

    def check_scan(self) -> None:
        store = Store(self.root)
        store.scan()
        indexed = {e.path for e in store.entries}
        for path, code in self.files.items():
            if code == OK:
                assert path in indexed, path
            elif issubclass(errors.ERRORS_BY_CODE[code], errors.FileFormatError):
                assert not os.path.exists(path), f"{path} ({code}) not quarantined"
            else:  # a valid file this build cannot use (a newer codec version): left alone, not indexed
                assert os.path.exists(path) and path not in indexed, path
        quarantined = sum(
            c != OK and issubclass(errors.ERRORS_BY_CODE[c], errors.FileFormatError) for c in self.files.values()
        )
        assert store.counters.quarantined == quarantined


def check_mutant(wire: Any, body: bytes, version: int, blind: bool, scratch: str, seen: Seen) -> tuple[str, str]:
    """Run one mutant past every user; returns (file outcome, spill outcome) after checking they agree."""
    data = join(wire, body, version)
    path = os.path.join(scratch, "m.spilld")
    with open(path, "wb") as f:
        f.write(data)
    file = file_outcome(path)
    spill = spill_outcome(wire)
    verified = outcome(spilld.loader.verify_file, path)
    assert verified in (OK, "tensor_hash_mismatch") if file == OK else verified == file
    if file == OK:
        loaded = load_exactly(path, scratch)
        assert loaded in (OK, "tensor_hash_mismatch", "codec_provider_mismatch"), loaded
    else:
        assert outcome(spilld.load, path) == file
    # the daemon refuses what a reader refuses, for the same reason; a spill carries no offsets, hashes
    # or prefix, and the daemon lays the file out itself (in its own format version: any version it reads
    # is written as that), so only those may differ
    if spill != OK:
        assert file != OK and (file == spill or blind), (file, spill)
    elif file != OK and not blind:
        laid_out = (errors.LayoutError, errors.TruncatedFile, errors.VersionMismatch)
        assert issubclass(errors.ERRORS_BY_CODE[file], laid_out), file
    if seen.n < 400:  # a scan of every mutant would only repeat the header check; a few hundred per codec
        seen.n += 1
        seen.place(data, wire, file)
    return file, spill


@pytest.fixture
def scratch(tmp_path: Any) -> Iterator[str]:
    """Where each mutant is written: memory when the OS offers it (thousands of rewrites of one file)."""
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else str(tmp_path)) as d:
        yield d


# --- the checked-in corpus ------------------------------------------------------------------------


def test_corpus_covers_every_codec() -> None:
    for kind in KINDS:
        ms = corpus(kind)
        assert len(ms) >= 400 and sum(m["file"] != OK for m in ms) >= 300, kind


@pytest.mark.parametrize("kind", KINDS)
def test_corpus_answers_as_recorded(kind: str, scratch: str, tmp_path: Any) -> None:
    _, body = split(golden(kind))
    seen = Seen(os.path.join(scratch, "store"))
    for m in corpus(kind):
        file, spill = check_mutant(m["header"], body, m["prefix_version"], m["blind"], scratch, seen)
        assert (file, spill) == (m["file"], m["spill"]), m["name"]
    seen.check_scan()


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    d = Daemon(new_root()).start()
    try:
        yield d
    finally:
        d.kill()
        cleanup(d.root)


def test_corpus_through_a_real_daemon(daemon: Daemon) -> None:
    """Every corpus header spilled to a real daemon: refused with the recorded code, or accepted (then aborted)."""
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(30)
    sock.connect(daemon.socket)
    dec = P.FrameDecoder()

    pending: list[P.Message] = []

    def call(bufs: list[Any]) -> P.Message:
        sock.sendall(b"".join(bytes(b) for b in bufs))
        while not pending:
            data = sock.recv(65536)
            assert data, "the daemon closed the connection"
            pending.extend(m for m in dec.feed(data) if m.kind == P.RESPONSE)
        return pending.pop(0)

    try:
        assert call(P.request(1, "hello", {"version": 1, "client": "corpus"})).error is None
        msgid = 2
        for kind in KINDS:
            for m in corpus(kind):
                msgid += 1
                got = call(P.request(msgid, "spill", {"header": m["header"]}))
                code = OK if got.error is None else got.error["code"]
                assert code == m["spill"], (kind, m["name"], got.error)
                if got.error is None:
                    msgid += 1
                    assert call(P.request(msgid, "abort", {"spill": got.result["spill"]})).error is None
    finally:
        sock.close()
    status = json.loads(daemon.cli("status", "--socket", daemon.socket, "--json").stdout)
    assert status["store"]["entries"] == 0 and status["queue"]["pending_items"] == 0


# --- hypothesis: random edits of every node, several at once ---------------------------------------


def _values(v: Any) -> st.SearchStrategy[Any]:
    # the fixed hostile values of the corpus, any integer, or a short string (few branches: drawing is the cost)
    return st.one_of(
        st.sampled_from(values_for(v)),
        st.integers(min_value=-(2**64), max_value=2**64),
        st.text(max_size=8),
    )


def _edits(wire: Any) -> st.SearchStrategy[list[tuple[Path, Any]]]:
    # one strategy per node, built once (a flatmap would build and validate new strategies at every draw)
    edits = [st.tuples(st.just(p), _values(get(wire, p))) for p in paths(wire)]
    edits.append(st.tuples(st.just(PREFIX_VERSION), st.sampled_from([*PREFIX_VALUES, fmt.FORMAT_VERSION])))
    return st.lists(st.one_of(edits), min_size=1, max_size=3)


@pytest.mark.parametrize("kind", KINDS)
def test_hypothesis_mutants(kind: str, scratch: str, tmp_path: Any) -> None:
    wire, body = split(golden(kind))
    seen = Seen(os.path.join(scratch, "store"))
    counts = {"mutants": 0, "refused": 0, "loaded": 0}

    @settings(
        max_examples=MUTANTS_PER_CODEC * 11 // 10,  # a few draws are not encodable (an int past 64 bits)
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )
    @given(_edits(wire))
    def run(edits: list[tuple[Path, Any]]) -> None:
        mutant, version = apply(wire, edits)
        try:
            msgpack.packb(mutant, use_bin_type=True)
        except (TypeError, ValueError, OverflowError):
            return  # not encodable (an int past 64 bits): no file or spill can hold it
        file, _ = check_mutant(mutant, body, version, spill_blind(edits), scratch, seen)
        counts["mutants"] += 1
        counts["refused" if file != OK else "loaded"] += 1

    run()
    seen.check_scan()
    print(f"{kind}: {counts['mutants']} mutants, {counts['refused']} refused, {counts['loaded']} admitted")
    assert counts["mutants"] >= MUTANTS_PER_CODEC, counts
    assert counts["refused"] >= counts["mutants"] // 2, counts


def test_the_memory_measure_sees_a_load_grow(tmp_path: Any) -> None:
    """The bound is measured, not assumed: a kv load takes its rows' room to grow (more than its bytes)."""
    path = str(tmp_path / "kv.spilld")
    with open(path, "wb") as f:
        f.write(golden("kv"))
    header = spilld.loader.read_header(path)
    mx.synchronize()
    before = mx.get_active_memory()
    mx.reset_peak_memory()
    got = spilld.load(path)
    peak = mx.get_peak_memory() - before
    assert header.data_bytes < peak <= alloc_bound(header)
    assert got.caches[0].keys.shape[2] == 256  # 9 rows stored, room up to the next step
