"""Loading a manifest big enough for the parallel reader: every block read by one task into the preallocated
buffers at its row offsets, the bytes exact, a bad piece a typed error; validated block headers remembered."""

from __future__ import annotations

import contextlib
import gc
import threading
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import mlx.core as mx
import pytest
from mlx_lm.models import cache as C

import spilld
import spilld.loader as L
from spilld import buffers, errors
from spilld.entries import Hit
from spilld.store import Store

IDENT = spilld.Identity("block-load")
ROWS = 1000  # 62 blocks of 16 and a tail of 8


def big(seed: int = 0) -> list[Any]:
    out = []
    for i in range(2):
        c = C.KVCache()
        mx.random.seed(seed + i)
        c.update_and_fetch(*(mx.random.normal((1, 8, ROWS, 256)) for _ in range(2)))  # 2 x 8 MiB f32 a layer
        mx.eval(c.keys, c.values)
        out.append(c)
    return out


def restored(s: Store, tokens: list[int]) -> Any:
    hit = s.lookup(IDENT, "", [*tokens, 1])
    assert isinstance(hit, Hit)
    return s.restore(hit, IDENT)


@pytest.mark.asyncio
async def test_a_large_manifest_loads_exactly_through_the_file_readers(tmp_path: Path) -> None:
    s = Store(tmp_path, disk_cap=2**40, block_tokens=16)
    caches, tokens = big(), list(range(ROWS))
    await s.put(tokens, caches, IDENT)
    assert len(s.blocks) == ROWS // 16
    got = restored(s, tokens)
    assert isinstance(got, spilld.Loaded)
    assert sum(c.keys.nbytes + c.values.nbytes for c in got.caches) >= L.PARALLEL_MIN_BYTES  # the parallel path
    for a, b in zip(caches, got.caches, strict=True):
        assert b.offset == ROWS and b.keys.shape[2] > ROWS  # step capacity kept
        assert mx.array_equal(a.keys[..., :ROWS, :], b.keys[..., :ROWS, :]).item()
        assert mx.array_equal(a.values[..., :ROWS, :], b.values[..., :ROWS, :]).item()


@pytest.mark.asyncio
async def test_blocks_are_read_on_at_most_block_load_threads_and_one_file_on_more(
    tmp_path: Path, monkeypatch: Any
) -> None:
    """Many threads asked for: a manifest's block files are read on at most ``BLOCK_LOAD_THREADS`` (more only wait
    for the GIL), a whole file's tensors on more. Each read is slowed, so that every thread the pool may start is."""
    seen: dict[str, set[int]] = {"blocks": set(), "one": set()}
    arm = ["blocks"]

    def slowed(real: Any) -> Any:
        def run(*a: Any, **k: Any) -> Any:
            seen[arm[0]].add(threading.get_ident())
            time.sleep(0.01)
            return real(*a, **k)

        return run

    monkeypatch.setattr(L._Reader, "read_file", slowed(L._Reader.read_file))
    monkeypatch.setattr(L._Reader, "fill", slowed(L._Reader.fill))
    caches, tokens = big(), list(range(ROWS))
    for name, b in (("blocks", 16), ("one", 0)):
        s = Store(tmp_path / name, disk_cap=2**40, block_tokens=b)
        await s.put(tokens, caches, IDENT)
        hit = s.lookup(IDENT, "", [*tokens, 1])
        assert isinstance(hit, Hit) and hit.entry.path
        arm[0] = name
        got = L.load(hit.entry.path, expect=IDENT, threads=8, blocks=s.block_path)
        assert got.caches[0].offset == ROWS
    assert 1 < len(seen["blocks"]) <= L.BLOCK_LOAD_THREADS
    assert len(seen["one"]) > L.BLOCK_LOAD_THREADS


@contextlib.contextmanager
def spilld_garbage() -> Iterator[list[str]]:
    """The objects of spilld's own (instances of its classes, its functions) that only the cycle collector would
    free, made inside the block: listed as ``module.name`` once it ends. Other threads' garbage is left out."""
    found: list[str] = []
    gc.collect()
    gc.disable()
    try:
        yield found
        gc.set_debug(gc.DEBUG_SAVEALL)
        gc.collect()
        for o in gc.garbage:
            where = o.__module__ if isinstance(o, types.FunctionType) else type(o).__module__
            if where.startswith("spilld"):
                found.append(f"{where}.{getattr(o, '__qualname__', type(o).__qualname__)}")
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()


@pytest.mark.asyncio
async def test_a_load_leaves_no_reference_cycle_behind(tmp_path: Path) -> None:
    """A load's pieces go when it returns, not at the next full collection (a 1 GiB load has 8,256 of them)."""
    s = Store(tmp_path, disk_cap=2**40, block_tokens=16)
    tokens = list(range(ROWS))
    await s.put(tokens, big(), IDENT)
    assert isinstance(restored(s, tokens), spilld.Loaded)  # the first: whatever is made once per process
    with spilld_garbage() as found:
        got = restored(s, tokens)
        assert isinstance(got, spilld.Loaded)
        del got
    assert found == []


@pytest.mark.asyncio
async def test_a_put_of_blocks_leaves_no_reference_cycle_behind(tmp_path: Path) -> None:
    """What a spill makes (its cut, its manifest, the writes' tasks) goes when it is stored."""
    s = Store(tmp_path, disk_cap=2**40, block_tokens=16)
    caches = big()
    await s.put(list(range(ROWS)), caches, IDENT)  # the first: whatever is made once per process
    with spilld_garbage() as found:
        await s.put(list(range(1, ROWS + 1)), caches, IDENT)
    assert found == []


async def with_a_flipped_byte(root: Path, seed: int, block: int) -> tuple[Store, list[int], str]:
    """A store of one entry of ``big(seed)`` whose block ``block`` has its last byte flipped; the block's path."""
    s = Store(root, disk_cap=2**40, block_tokens=16)
    tokens = list(range(ROWS))
    await s.put(tokens, big(seed), IDENT)
    victim = s.blocks[block].path
    with open(victim, "r+b") as f:
        f.seek(-1, 2)
        last = f.read(1)
        f.seek(-1, 2)
        f.write(bytes([last[0] ^ 0xFF]))
    return s, tokens, victim


@pytest.mark.asyncio
async def test_a_flipped_byte_in_one_block_fails_the_parallel_read(tmp_path: Path) -> None:
    s, tokens, victim = await with_a_flipped_byte(tmp_path, 3, 30)
    hit = s.lookup(IDENT, "", [*tokens, 1])
    assert isinstance(hit, Hit)
    with pytest.raises(errors.TensorHashMismatch) as got:
        s.read_hit(hit, IDENT)
    assert got.value.path == victim


@pytest.mark.asyncio
@pytest.mark.parametrize("threads", [1, 2])
async def test_a_failed_load_leaves_no_reference_cycle_behind(tmp_path: Path, threads: int) -> None:
    """Found in review: a load that failed (a flipped byte, an EIO) kept every buffer it had allocated until the
    cycle collector ran: the failed task's future held the error, whose traceback's frames held that future and the
    buffers (12-50 MiB after failed loads of an 8 MiB entry), on one thread or on a pool."""
    s, _, _ = await with_a_flipped_byte(tmp_path, 5, 3)
    (entry,) = s.entries
    for _ in range(2):  # the first: whatever is made once per process
        with spilld_garbage() as found, pytest.raises(errors.TensorHashMismatch):
            spilld.load(entry.path, blocks=s.block_path, threads=threads)
    assert found == []


@pytest.mark.asyncio
async def test_a_block_header_is_remembered_only_for_the_same_file(tmp_path: Path) -> None:
    s = Store(tmp_path, disk_cap=2**40, block_tokens=16)
    tokens = list(range(64))
    caches = [C.KVCache()]
    caches[0].update_and_fetch(mx.ones((1, 1, 64, 8)), mx.ones((1, 1, 64, 8)))
    await s.put(tokens, caches, IDENT)
    L._block_headers.clear()
    restored(s, tokens)
    seen = len(L._block_headers)
    assert seen == 4  # every block's validated header, once
    restored(s, tokens)
    assert len(L._block_headers) == seen  # read again: remembered, not parsed again
    path = s.blocks[0].path
    data = Path(path).read_bytes()
    Path(path).unlink()
    Path(path).write_bytes(data)  # the same bytes in a new file: another inode, another entry
    restored(s, tokens)
    assert len(L._block_headers) == seen + 1


@pytest.mark.asyncio
async def test_a_load_holds_no_fd_per_block(tmp_path: Path) -> None:
    """300 blocks read by a process allowed 64 open files (macOS's default is 256): each block's file is open only
    while its header or its bytes are read."""
    import subprocess
    import sys

    s = Store(tmp_path, disk_cap=2**40, block_tokens=16)
    tokens = list(range(300 * 16 + 5))
    c = C.KVCache()
    c.update_and_fetch(mx.ones((1, 1, len(tokens), 8)), mx.ones((1, 1, len(tokens), 8)))
    manifest = (await s.put(tokens, [c], IDENT)).path
    assert len(s.blocks) == 300
    code = (
        "import resource, sys, spilld; from spilld.codecs import default_provider; default_provider(); "
        # mlx-lm raises the soft limit when imported (above): lowered once it is
        "resource.setrlimit(resource.RLIMIT_NOFILE, (64, resource.getrlimit(resource.RLIMIT_NOFILE)[1])); "
        "got = spilld.load(sys.argv[1]); assert got.caches[0].offset == int(sys.argv[2]); print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code, manifest, str(len(tokens))], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_a_client_that_finds_a_bad_block_has_the_daemon_move_the_block_aside() -> None:
    from spilld.client import Client
    from spilld.control import Control
    from tests.daemons import Daemon, cleanup, new_root

    d = Daemon(new_root(), ["--cap", "64MiB", "--durability", "none", "--block-tokens", "16"]).start()
    try:
        with Client(d.socket, identity=IDENT, name="bad-block") as client:
            shared = list(range(40))
            convs = [[*shared, 1000 + i, 7, 8] for i in range(2)]  # two conversations naming the same 2 blocks
            for i, t in enumerate(convs):
                c = C.KVCache()
                mx.random.seed(i)
                c.update_and_fetch(*(mx.random.normal((1, 2, len(t), 8)) for _ in range(2)))
                assert client.spill(t, [c], droppable=False).result(60).stored
            st = client.status()["store"]
            assert (st["entries"], st["blocks"]) == (2, 2)
            on_disk = sorted(str(p) for p in Path(d.dir).rglob("*.spilld-block"))
            with Control(d.socket, name="lookup") as c:  # the reply names the entry's block files: a client
                params = {"identity": IDENT.to_wire(), "tokens": spilld.format.encode_tokens([*convs[0], 5])}
                reply = c.call("lookup", params)  # reads them without listing the folder
            assert reply["hit"] and sorted(reply["blocks"]) == on_disk
            block = on_disk[0]
            data = bytearray(Path(block).read_bytes())
            data[-1] ^= 0xFF
            Path(block).write_bytes(bytes(data))
            assert client.load([*convs[0], 5]) is None  # the client's own read found it: a miss
            st = client.status()["store"]
            assert st["quarantined"] == 1 and st["entries"] == 0 and st["blocks"] == 0
            assert not Path(block).exists() and any(Path(d.dir, ".quarantine").iterdir())
    finally:
        d.stop()
        cleanup(d.root)


def _bf16(seed: int) -> list[Any]:
    c = C.KVCache()
    mx.random.seed(seed)
    c.update_and_fetch(*(mx.random.normal((1, 8, ROWS, 256)).astype(mx.bfloat16) for _ in range(2)))
    mx.eval(c.keys, c.values)
    return [c]


@pytest.mark.asyncio
@pytest.mark.parametrize("block_tokens", [0, 16])
@pytest.mark.parametrize("zero_filled", [False, True])
async def test_unfilled_buffers_hold_the_rows_read_and_zeros_after(
    tmp_path: Path, block_tokens: int, zero_filled: bool, monkeypatch: Any
) -> None:
    """Buffers allocated without a zero fill (and, where mlx cannot, zero-filled ones) hold exactly the bytes read
    and zeros in the step capacity's rows; float32 and bfloat16 (allocated as uint16, then viewed); one file and
    blocks with a tail."""
    if zero_filled:
        monkeypatch.setattr(buffers, "_unfilled_works", False)
    s = Store(tmp_path, disk_cap=2**40, block_tokens=block_tokens)
    tokens = list(range(ROWS))
    for caches in (big(5), _bf16(7)):
        await s.put(tokens, caches, IDENT)
        got = restored(s, tokens)
        assert isinstance(got, spilld.Loaded)
        for a, b in zip(caches, got.caches, strict=True):
            assert b.keys.dtype == a.keys.dtype and b.offset == ROWS and b.keys.shape[2] > ROWS
            for x, y in ((a.keys, b.keys), (a.values, b.values)):
                assert mx.array_equal(x[..., :ROWS, :], y[..., :ROWS, :]).item()
                assert not mx.any(y[..., ROWS:, :]).item()
    assert buffers._unfilled_works is (not zero_filled)


def test_an_unfilled_buffer_is_one_mlx_allocated_and_evaluated() -> None:
    arr = buffers.unfilled([2, 3, 4096, 64], "bfloat16")
    assert arr is not None and arr.dtype == mx.bfloat16 and arr.shape == (2, 3, 4096, 64)
    assert buffers.unfilled([4, 4], "float16") is None  # small: mx.zeros is cheaper than the round trip


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return ""
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else ""


def _huge_kib_at(addr: int) -> int:
    """AnonHugePages of the mapping of this process that holds ``addr``."""
    found, huge = False, 0
    for line in Path("/proc/self/smaps").read_text().splitlines():
        head = line.split()[0] if line else ""
        if "-" in head and all(c in "0123456789abcdef-" for c in head):
            lo, hi = (int(x, 16) for x in head.split("-"))
            if found:
                break
            found = lo <= addr < hi
        elif found and line.startswith("AnonHugePages:"):
            huge = int(line.split()[1])
    return huge


@pytest.mark.skipif(_thp_mode() != "madvise", reason="only THP in madvise mode shows what the loader asked for")
def test_a_large_buffer_gets_huge_pages() -> None:
    """With THP in ``madvise`` mode, a buffer of HUGE_PAGE_MIN_BYTES or more gets huge pages because the loader
    asked for them where it allocated it (in ``always`` mode it would get them anyway; in ``never`` nobody can)."""
    import numpy as np

    from spilld import dtypes

    arr = buffers.unfilled([1, 8, 8192, 256], "float32")  # 64 MiB
    assert arr is not None and arr.nbytes >= 4 * buffers.HUGE_PAGE_MIN_BYTES
    flat = np.frombuffer(dtypes.buffer(arr).cast("B"), dtype=np.uint8)
    assert buffers.advise_huge(flat.ctypes.data, flat.nbytes)
    flat[:] = 1  # the reads' page faults
    huge = 2 * 2**20
    assert _huge_kib_at(-(-flat.ctypes.data // huge) * huge) >= 2048  # its first whole 2 MiB: madvise split it off


@pytest.mark.asyncio
async def test_a_load_without_verification_reads_the_same_bytes(tmp_path: Path) -> None:
    s = Store(tmp_path, disk_cap=2**40, block_tokens=16, verify=False)
    caches, tokens = big(9), list(range(ROWS))
    await s.put(tokens, caches, IDENT)
    got = restored(s, tokens)
    assert isinstance(got, spilld.Loaded)
    for a, b in zip(caches, got.caches, strict=True):
        assert mx.array_equal(a.keys[..., :ROWS, :], b.keys[..., :ROWS, :]).item()


@pytest.mark.asyncio
async def test_a_block_header_taken_as_expected_is_the_validators_or_none(tmp_path: Path) -> None:
    """A load takes a block's header without running the validator only when its bytes are exactly what this
    build writes for that block: for every byte of a block's prefix and header changed (the header hash made
    right again, or left wrong), ``Expected.header`` answers None or exactly what the validator reads."""
    import msgpack

    from spilld import assemble
    from spilld import format as fmt
    from spilld.validate import header_from_bytes
    from tests.blocks_corpus import blocks_on_disk, key_of

    s = Store(tmp_path, block_tokens=16, durability="none")
    caches = [C.QuantizedKVCache(group_size=32, bits=4), C.KVCache()]
    for c in caches:
        c.update_and_fetch(mx.random.normal((1, 2, 40, 64)), mx.random.normal((1, 2, 40, 64)))
    await s.put(list(range(40)), caches, IDENT)
    (m,) = [e for e in s.entries]
    manifest = L.read_header(m.path)
    assert manifest.blocks is not None
    expected = assemble.Expected(manifest)
    on_disk = {key_of(p): p for p in blocks_on_disk(str(tmp_path))}
    paths = [on_disk[k] for k in manifest.blocks.keys]
    for i, p in enumerate(paths):  # as written: taken, and the same header the validator reads
        data = Path(p).read_bytes()
        prefix = fmt.decode_prefix(data[: fmt.PREFIX_LEN], len(data))
        got = expected.header(i, prefix, data[: prefix.data_start], len(data))
        assert got is not None and got == header_from_bytes(data[: prefix.data_start], len(data))
        assert expected.header(1 - i, prefix, data[: prefix.data_start], len(data)) is None  # another block's
    data = Path(paths[1]).read_bytes()
    prefix = fmt.decode_prefix(data[: fmt.PREFIX_LEN], len(data))
    taken = 0
    for at in range(prefix.data_start):
        for resign in (False, True):
            b = bytearray(data)
            b[at] ^= 0x01
            h_end = fmt.PREFIX_LEN + prefix.header_len
            if resign:
                if not fmt.PREFIX_LEN <= at < h_end:
                    continue
                b[24:32] = int.from_bytes(fmt.xxh3(bytes(b[fmt.PREFIX_LEN : h_end])), "big").to_bytes(8, "little")
            try:
                pre = fmt.decode_prefix(bytes(b[: fmt.PREFIX_LEN]), len(b))
            except errors.FileFormatError:
                continue  # refused before any header is read, on either path
            head = bytes(b[: pre.data_start])
            got = expected.header(1, pre, head, len(b))
            if got is not None:  # only a tensor hash or the time changed: the validator reads the same
                taken += 1
                assert got == header_from_bytes(head, len(b)), at
                wire = msgpack.unpackb(head[fmt.PREFIX_LEN : h_end], raw=False)
                assert got.created_at_ms == wire["created_at_ms"]
    assert taken > 0  # the re-signed hash and time bytes: taken, with the file's own values
    for other in (data + b"\0", data[:-1]):  # a file longer or shorter than its layout: the validator's to name
        pre = fmt.decode_prefix(other[: fmt.PREFIX_LEN], len(other))
        assert expected.header(1, pre, other[: pre.data_start], len(other)) is None


@pytest.mark.asyncio
async def test_a_restore_runs_the_validator_on_its_manifest_not_on_blocks_this_build_wrote(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tests.blocks_corpus import as_version, blocks_on_disk

    s = Store(tmp_path, block_tokens=16, durability="none")
    caches = big(1)
    tokens = list(range(caches[0].offset))
    await s.put(tokens, caches, IDENT)
    validated: list[str] = []
    real = L.header_from_bytes
    monkeypatch.setattr(
        L, "header_from_bytes", lambda raw, size, path=None: validated.append(path) or real(raw, size, path)
    )
    L._block_headers.clear()  # a fresh process: no block header read yet
    assert restored(s, tokens).tokens == tokens
    assert validated == [m.path for m in s.entries]  # the manifest; each block's header was what it must be
    first = sorted(blocks_on_disk(str(tmp_path)))[0]
    as_version(first, first, 2)  # a block as a v2 build wrote it: not this build's bytes, so validated
    L._block_headers.clear()
    validated.clear()
    assert restored(s, tokens).tokens == tokens
    assert validated == [m.path for m in s.entries] + [first]


@pytest.mark.asyncio
async def test_an_empty_tail_before_a_state_cache_restores_however_many_heads_come_first(tmp_path: Path) -> None:
    """Found in review: an entry of whole blocks (its positional tail has no rows) with a state cache after many KV
    layers: each empty tail tensor became a view per head, 70 layers x 2 x 8 heads = 1,120 empty views first in one
    vectored read, which read nothing and was taken for the file's end: the good manifest quarantined (corrupt)."""
    size, n, layers = 16, 32, 70

    def kv(seed: int) -> C.KVCache:
        mx.random.seed(seed)
        c = C.KVCache()
        c.update_and_fetch(mx.random.normal((1, 8, n, 4)), mx.random.normal((1, 8, n, 4)))
        return c

    state = C.ArraysCache(2)
    state.cache = [mx.random.normal((1, 3, 16)), mx.random.normal((1, 4, 8, 8))]
    caches: list[Any] = [*(kv(i) for i in range(layers)), state]
    mx.eval([x for c in caches for x in c.state])
    tokens = list(range(100, 100 + n))  # two whole blocks: an empty tail
    s = Store(tmp_path, block_tokens=size, durability="none", disk_cap=2**40)
    await s.put(tokens, caches, IDENT)
    hit = s.lookup(IDENT, "", [*tokens, 7])
    assert isinstance(hit, Hit) and hit.matched == n
    got = s.restore(hit, IDENT)
    assert isinstance(got, spilld.Loaded), got
    kvs = zip(caches[:-1], got.caches[:-1], strict=True)
    assert all(mx.array_equal(a.keys[..., :n, :], b.keys[..., :n, :]).item() for a, b in kvs)
    assert all(mx.array_equal(x, y).item() for x, y in zip(state.cache, got.caches[-1].cache, strict=True))
    assert s.stats()["quarantined"] == 0
