"""Shared memory cannot hurt the daemon: a bad segment fails its spill only, a segment truncated while the daemon
reads it fails that spill without a signal, and a client killed at any point of a spill leaves nothing behind (no
mapping, no fd, no held bytes). Real daemon subprocess, real Unix socket, real POSIX segments."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import gc
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import termios
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing import resource_tracker, shared_memory
from typing import Any

import mlx.core as mx
import msgpack
import pytest
from mlx_lm.models import cache as C

import spilld
from spilld import errors, loader, saver
from spilld import protocol as P
from tests.caches import fill, live, same
from tests.daemons import Daemon, serving
from tests.wire import Wire

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /dev/shm and /proc")


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    with serving("--cap", "256MiB") as d:
        yield d


def seg_name(i: int = 0) -> str:
    return f"spilld-{secrets.token_hex(4)}-{i}"


def segment(data: bytes, name: str | None = None) -> shared_memory.SharedMemory:
    seg = shared_memory.SharedMemory(name=name or seg_name(), create=True, size=len(data))
    assert seg.buf is not None
    seg.buf[: len(data)] = data
    return seg


def drop(seg: shared_memory.SharedMemory) -> None:
    seg.close()
    try:
        seg.unlink()
    except FileNotFoundError:
        pass


def small_header(ntok: int = 8) -> tuple[dict[str, Any], list[int]]:
    """A KV spill of two 8 KiB tensors: its wire header and each tensor's size."""
    header, _ = saver.plan(
        list(range(ntok)), [fill(C.KVCache(), ntok, heads=2, dim=128)], identity=spilld.Identity("s")
    )
    return header.to_wire(), [s.nbytes for s in header.slots()]


def bad_segment(kind: str, size: int) -> tuple[str, list[str]]:
    """A segment name the daemon must refuse, and the /dev/shm files to remove afterwards."""
    name = seg_name()
    path = f"/dev/shm/{name}"
    if kind == "missing":
        return name, []
    if kind == "bad_name":
        return "../etc/passwd", []
    if kind == "fifo":
        os.mkfifo(path, 0o600)
        return name, [path]
    if kind == "symlink":
        target = segment(b"x" * size)
        resource_tracker.unregister(target._name, "shared_memory")  # type: ignore[attr-defined]
        target.close()
        os.symlink(f"/dev/shm/{target.name}", path)
        return name, [path, f"/dev/shm/{target.name}"]
    seg = segment(b"x" * (size // 2 if kind == "too_small" else size), name)
    resource_tracker.unregister(seg._name, "shared_memory")  # type: ignore[attr-defined]
    seg.close()
    if kind == "wrong_mode":
        os.chmod(path, 0o644)
    elif kind == "foreign":
        os.chown(path, 65534, 65534)
    return name, [path]


KINDS = ["missing", "bad_name", "fifo", "symlink", "too_small", "wrong_mode", "foreign"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_bad_segment_fails_its_spill_only(daemon: Daemon, kind: str) -> None:
    if kind == "foreign" and os.getuid() != 0:
        pytest.skip("making a segment of another uid needs root")
    wire_header, sizes = small_header()
    name, paths = bad_segment(kind, sizes[0])
    try:
        w = Wire(daemon.socket)
        w.hello()
        bad = w.call("spill", {"header": wire_header, "droppable": False}).result["spill"]
        good = w.call("spill", {"header": wire_header, "droppable": False}).result["spill"]
        w.send(P.notification("put_shm", {"spill": bad, "index": 0, "offset": 0, "shm": name, "length": sizes[0]}))
        for i, n in enumerate(sizes):
            w.send(P.notification("put", {"spill": good, "index": i, "offset": 0}, os.urandom(n)))
        assert w.call("commit", {"spill": good}).result["outcome"] == "stored"  # the other spill is untouched
        r = w.call("commit", {"spill": bad})
        assert r.error is not None and r.error["code"] == "shm_refused", r.error
        assert "Error(" not in r.error["message"] and "segment" in r.error["message"]
        assert w.note("shm_free").params["names"] == [name[:64]]  # handed back, even refused
        assert w.call("status", {}).error is None  # the connection goes on
        w.close()
    finally:
        for p in paths:
            os.unlink(p)
    assert daemon.proc is not None and daemon.proc.poll() is None


def test_a_segment_truncated_while_read_fails_that_spill_and_never_signals_the_daemon(daemon: Daemon) -> None:
    cache = fill(C.KVCache(), 4096, heads=8, dim=128, dtype=mx.float16)  # two 8 MiB tensors
    tokens = list(range(4096))
    header, _ = saver.plan(tokens, [cache], identity=spilld.Identity("t"))
    sizes = [s.nbytes for s in header.slots()]
    data = [bytes(memoryview(a)) for a in (cache.keys, cache.values)]  # keys, values: 4096 rows each
    assert [len(d) for d in data] == sizes
    w = Wire(daemon.socket)
    w.hello()
    outcomes: list[str] = []
    for rnd in range(16):
        tokens[0] = rnd  # one entry each
        header.tokens = list(tokens)
        seg = segment(data[0])
        sid = w.call("spill", {"header": header.to_wire(), "droppable": False}).result["spill"]
        cut = threading.Thread(target=os.ftruncate, args=(seg._fd, 0))  # type: ignore[attr-defined]
        if rnd == 0:
            cut.run()  # before the put: always refused
        params = {"spill": sid, "index": 0, "offset": 0, "shm": seg.name, "length": sizes[0]}
        w.send(P.notification("put_shm", params))
        if rnd:
            time.sleep(random.Random(rnd).choice([0, 0, 0.0002, 0.0005, 0.001, 0.003]))
            cut.start()  # while the daemon reads it (or just before, or just after)
            cut.join()
        w.send(P.notification("put", {"spill": sid, "index": 1, "offset": 0}, data[1]))
        r = w.call("commit", {"spill": sid})
        drop(seg)
        if r.error is not None:
            assert r.error["code"] == "shm_refused", r.error
            outcomes.append("refused")
            continue
        assert r.result["outcome"] == "stored"
        outcomes.append("stored")
        got = loader.load(r.result["path"])  # stored means exactly the bytes sent, never zeros
        assert same(live(got.caches[0]), live(cache))
    assert daemon.proc is not None and daemon.proc.poll() is None, daemon.read_log()
    assert outcomes[0] == "refused" and w.call("status", {}).error is None
    assert "Traceback" not in daemon.read_log()


CHILD = textwrap.dedent(
    """
    import os, random, secrets, socket, sys, time
    from multiprocessing import shared_memory
    import msgpack
    from spilld import protocol as P

    path, header_file, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    with open(header_file, "rb") as f:
        header, sizes = msgpack.unpackb(f.read())
    rng = random.Random(seed)
    segs = [shared_memory.SharedMemory(name=f"spilld-{secrets.token_hex(4)}-{i}", create=True, size=max(sizes))
            for i in range(4)]
    s = socket.socket(socket.AF_UNIX)
    s.connect(path)
    send = lambda parts: s.sendall(b"".join(bytes(b) for b in parts))
    send(P.request(1, "hello", {"version": 1, "client": "doomed"}))
    print("ready", flush=True)
    sid, msgid = 0, 1
    while True:
        msgid += 1
        send(P.request(msgid, "spill", {"header": header, "droppable": rng.random() < 0.5}))
        sid += 1
        for i, n in enumerate(sizes):
            if rng.random() < 0.7:
                seg = segs[rng.randrange(len(segs))]
                send(P.notification("put_shm", {"spill": sid, "index": i, "offset": 0, "shm": seg.name, "length": n}))
            else:
                send(P.notification("put", {"spill": sid, "index": i, "offset": 0}, b"z" * n))
            time.sleep(rng.random() * 0.01)
        if rng.random() < 0.3:
            msgid += 1
            send(P.request(msgid, "commit", {"spill": sid}))
    """
)


def held(st: dict[str, Any]) -> dict[str, int]:
    """What ``status`` says open spills hold (absent before the daemon told it)."""
    ingest = st.get("ingest", {})
    return {k: ingest.get(k, -1) for k in ("open_spills", "receiving", "reserved")}


def daemon_fds(pid: int) -> list[str]:
    out = []
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except FileNotFoundError:  # closed meanwhile
            pass
    return out


def shm_maps(pid: int) -> list[str]:
    with open(f"/proc/{pid}/maps") as f:
        return [line for line in f if "/dev/shm/" in line]


def test_clients_killed_mid_spill_leave_nothing_behind(daemon: Daemon, tmp_path: Any) -> None:
    cache = fill(C.KVCache(), 512, heads=8, dim=128, dtype=mx.float16)  # two 1 MiB tensors
    header, _ = saver.plan(list(range(512)), [cache], identity=spilld.Identity("k"))
    header_file = tmp_path / "header.msgpack"
    header_file.write_bytes(msgpack.packb([header.to_wire(), [s.nbytes for s in header.slots()]]))
    assert daemon.proc is not None
    pid = daemon.proc.pid
    time.sleep(0.3)
    baseline = len(daemon_fds(pid))
    env = os.environ | {"PYTHONPATH": os.getcwd()}
    rng = random.Random(7)
    kills = 0
    for rnd in range(8):
        kids = [
            subprocess.Popen(
                [sys.executable, "-c", CHILD, daemon.socket, str(header_file), str(rnd * 10 + k)],
                stdout=subprocess.PIPE,
                env=env,
            )
            for k in range(3)
        ]
        for kid in kids:
            assert kid.stdout is not None and kid.stdout.readline().strip() == b"ready"
        time.sleep(rng.random() * 0.4)  # somewhere in a spill: a spill, a put, a segment read, a commit
        for kid in kids:
            kid.send_signal(signal.SIGKILL)
            kid.wait()
            kids_left = kid.stdout
            assert kids_left is not None
            kids_left.close()
            kills += 1
    assert kills == 24
    deadline = time.monotonic() + 30
    while True:
        st = json.loads(daemon.cli("status", "--socket", daemon.socket, "--json").stdout)
        fds = daemon_fds(pid)
        clean = (
            st["clients"] == 0  # none but the status request itself, which is not counted
            and held(st) == {"open_spills": 0, "receiving": 0, "reserved": 0}
            and st["queue"]["pending_items"] == 0
            and len(fds) <= baseline
            and not shm_maps(pid)
        )
        if clean or time.monotonic() > deadline:
            break
        time.sleep(0.2)
    assert not shm_maps(pid), shm_maps(pid)
    assert not [f for f in fds if "/dev/shm" in f] and len(fds) <= baseline, (baseline, fds)
    assert held(st) == {"open_spills": 0, "receiving": 0, "reserved": 0}, st
    assert st["clients"] == 0 and st["queue"]["pending_items"] == 0, st
    log = daemon.read_log()
    assert "Traceback" not in log and "BufferError" not in log


def test_a_pool_reserves_its_pages_when_made() -> None:
    """``ShmPool.make`` gives every segment its pages (``posix_fallocate``): a full /dev/shm fails there, with an
    error, not later with SIGBUS when a copy first touches a page."""
    from spilld.shm import ShmPool

    pool = ShmPool(segments=2, size=1 << 20)
    try:
        pool.make()
        for name in pool._segments:
            st = os.stat(f"/dev/shm/{name}")
            assert st.st_size == 1 << 20 and st.st_blocks * 512 >= 1 << 20, (name, st.st_blocks)
    finally:
        pool.close()


def test_a_pool_closed_while_a_copy_holds_a_segment_keeps_no_descriptor_of_it() -> None:
    """Found in review: a connection lost while a copy into a segment ran closed the pool while the copy's view was
    still exported; the standard library's close raised before closing the segment's fd, and each such drop kept an
    unlinked 32 MiB segment's pages until the process ended. The fd goes now; the mapping when the view does."""
    from spilld.shm import ShmPool

    def open_segments(prefix: str) -> list[str]:
        out = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # (the listing's own fd, gone once listed)
                out.append(os.readlink(f"/proc/self/fd/{fd}"))
        return [t for t in out if f"/dev/shm/{prefix}" in t]

    pool = ShmPool(segments=2, size=1 << 20)
    pool.make()
    prefix = pool._prefix
    got = pool.try_take()
    assert got is not None and len(open_segments(prefix)) == 4  # each: its fd, and its mapping's own copy
    name, buf = got
    view = buf[:16]  # a copy in flight: its view exported
    view[:4] = b"\x01\x02\x03\x04"
    pool.close()
    assert open_segments(prefix) == [f"/dev/shm/{name} (deleted)"]  # the mapping's own, while the view lives
    assert not any(n.startswith(prefix) for n in os.listdir("/dev/shm"))  # unlinked, every one
    head = bytes(view[:4])  # (not inside an assert: pytest keeps what an assert evaluates, a view included)
    assert head == b"\x01\x02\x03\x04"  # the copy's mapping still valid until it lets it go
    view.release()
    del buf, got
    gc.collect()
    assert open_segments(prefix) == []


@pytest.mark.asyncio
async def test_the_pool_is_made_off_the_loop_and_a_full_dev_shm_sends_inline(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The first spill through shared memory makes the pool on a worker thread (a few hundred ms the engine's
    loop must not wait for). When /dev/shm has no room (ENOSPC from the reservation), the spill goes inline and
    is stored, and no segment is left behind."""
    import errno

    from spilld import shm as shm_mod
    from spilld.client import AsyncClient

    made_on: list[str] = []
    real_make = shm_mod.ShmPool.make

    def make(self: Any) -> None:
        made_on.append(threading.current_thread().name)
        real_make(self)

    monkeypatch.setattr(shm_mod.ShmPool, "make", make)
    cs = [fill(C.KVCache(), 64, seed=i) for i in range(2)]
    c = await AsyncClient.open(daemon.socket, identity=spilld.Identity("shm-pool"), shm=True)
    try:
        assert (await c.spill(list(range(64)), cs, droppable=False)).stored
    finally:
        await c.close()
    assert made_on and made_on[0] != threading.main_thread().name, made_on

    def no_room(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shm_mod.os, "posix_fallocate", no_room)
    before = set(os.listdir("/dev/shm"))
    c = await AsyncClient.open(daemon.socket, identity=spilld.Identity("shm-pool"), shm=True)
    try:
        assert (await c.spill(list(range(100, 164)), cs, droppable=False)).stored
        assert not c.use_shm  # from now on, inline
        got = await c.load([*range(100, 164), 1])
        assert got is not None and same([live(x) for x in got.caches], [live(x) for x in cs])
    finally:
        await c.close()
    assert {n for n in set(os.listdir("/dev/shm")) - before if n.startswith("spilld-")} == set()


@pytest.mark.parametrize(
    "name", ["spilld-0123abcd-1\n", "spilld-0123abcd-\u0661\u0662", "spilld-0123abcd-1/../x", "xspilld-0123abcd-1"]
)
def test_a_segment_name_is_refused_unless_it_is_one_a_pool_gives(name: str) -> None:
    """Found in review: ``$`` also matched before a final newline and ``\\d`` took any script's digits."""
    from spilld import shm

    shm.check_name("spilld-0123abcd-12")
    with pytest.raises(errors.ShmRefused):
        shm.check_name(name)


@pytest.mark.asyncio
async def test_a_spill_aborted_while_its_segment_copies_run_keeps_its_room_until_they_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found in review: an abort (or a lost connection) gave a spill's room back at once, while its segment copies
    still filled the buffers they had been given: every spill admitted next could hold one more such buffer beyond
    the daemon's bound. The room now stays counted until the last copy ends."""
    from spilld import shm
    from tests.hostile_memory import in_process

    started, go = threading.Event(), threading.Event()

    def slow_read(name: str, into: memoryview) -> None:
        started.set()
        go.wait(10)
        into[:] = b"\0" * len(into)

    monkeypatch.setattr(shm, "read_segment", slow_read)
    async with in_process("abort-during-copy") as (daemon, wire):
        try:
            header, sizes = small_header()
            r, err = await wire.call("spill", {"header": header, "droppable": False})
            assert err is None, err
            sid = r["spill"]
            wire.send(
                P.notification(
                    "put_shm", {"spill": sid, "index": 0, "offset": 0, "shm": seg_name(), "length": sizes[0]}
                )
            )
            assert await asyncio.to_thread(started.wait, 10)
            r, err = await wire.call("abort", {"spill": sid})
            assert err is None and r["aborted"]
            assert daemon.ingest.receiving > 0  # its copy still fills a buffer of its own
            go.set()
            deadline = asyncio.get_running_loop().time() + 10
            while daemon.ingest.receiving and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
            assert (daemon.ingest.receiving, daemon.ingest.reserved) == (0, 0)
        finally:
            go.set()


@pytest.mark.asyncio
async def test_a_segment_copy_never_waits_behind_file_calls_a_hung_disk_holds(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in review: the daemon's segment copies ran on the loop's default executor, where the store's file calls
    run too. A hung disk's calls (here, a ``touch``'s mtime) are given up at their deadline but their threads stay
    stuck; once they held every thread, a ``put_shm``'s copy never began: its spill's commit never answered, and the
    room the spill held (kept while a copy is under way, never expired) never came back."""
    from spilld.store import store as store_mod
    from tests.hostile_memory import in_process

    hung = threading.Event()
    real_set_mtime = store_mod._set_mtime

    def hung_set_mtime(path: str, when: float) -> None:
        hung.wait(60)  # a hung disk's utime: past the deadline, still stuck
        real_set_mtime(path, when)

    monkeypatch.setattr(store_mod, "_set_mtime", hung_set_mtime)
    default_threads = min(32, (os.cpu_count() or 1) + 4)  # the default executor's (ThreadPoolExecutor's rule)
    seg = None
    async with in_process("hung-touches", io_timeout=0.2) as (daemon, wire):
        try:
            header, sizes = small_header()
            r, err = await wire.call("spill", {"header": header, "droppable": False})
            assert err is None, err
            for i, n in enumerate(sizes):
                wire.send(P.notification("put", {"spill": r["spill"], "index": i, "offset": 0}, b"\0" * n))
            r, err = await wire.call("commit", {"spill": r["spill"]})
            assert err is None and r["outcome"] == "stored", (r, err)
            for _ in range(default_threads):  # each answered at the deadline, its thread left stuck
                assert (await wire.call("touch", {"path": r["path"]}))[1] is None
            header, sizes = small_header(9)
            seg = segment(os.urandom(sizes[0]))
            sid = await send_small_spill(wire, header, sizes, seg.name)
            r, err = await asyncio.wait_for(wire.call("commit", {"spill": sid}), 10)  # answered: never for ever
            # (the store's own file calls wait behind the hung ones, so the disk's verdict may be its deadline)
            assert err is None and (r["outcome"] == "stored" or r["code"] == "io_timeout"), (r, err)
            assert (daemon.ingest.receiving, daemon.ingest.reserved) == (0, 0)
        finally:
            hung.set()
            if seg is not None:
                drop(seg)


def untracked(data: bytes, name: str | None = None) -> shared_memory.SharedMemory:
    """A segment nothing of this process unlinks (its resource tracker forgets it): a dead client's."""
    seg = segment(data, name)
    resource_tracker.unregister(seg._name, "shared_memory")  # type: ignore[attr-defined]
    return seg


async def send_small_spill(wire: Any, header: dict[str, Any], sizes: list[int], segment: str) -> int:
    """Open a spill of ``small_header``'s two tensors and send them: the first from ``segment``, the second inline;
    its id."""
    r, err = await wire.call("spill", {"header": header, "droppable": False})
    assert err is None, err
    sid: int = r["spill"]
    put = {"spill": sid, "index": 0, "offset": 0, "shm": segment, "length": sizes[0]}
    wire.send(P.notification("put_shm", put))
    wire.send(P.notification("put", {"spill": sid, "index": 1, "offset": 0}, b"\0" * sizes[1]))
    return sid


def unread(sock: Any) -> int:
    """Bytes waiting in ``sock``'s receive buffer (closed with some, the socket resets its peer's connection)."""
    return int.from_bytes(fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0" * 4), sys.byteorder)


def gone_within(paths: list[str], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while any(os.path.exists(p) for p in paths) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(os.path.exists(p) for p in paths)


def test_the_pool_a_client_handed_over_is_unlinked_when_its_connection_ends(daemon: Daemon) -> None:
    """Found in review: a client killed with its process group (a closed terminal's SIGHUP, a container's or a
    cgroup's kill) took Python's resource tracker with it, and its whole pool, 256 MiB of reserved pages, stayed in
    /dev/shm for good. A client hands its pool over (``shm_pool``): the daemon unlinks those segments, used or not,
    once the connection ends; never a segment it was not handed, nor anything but a regular file of ours."""
    wire_header, sizes = small_header()
    prefix = f"spilld-{secrets.token_hex(4)}"
    pool = [untracked(b"\0" * sizes[0], f"{prefix}-{i}") for i in range(3)]
    other = untracked(b"\0" * 16)  # never handed over
    fifo = f"{prefix}-3"
    os.mkfifo(f"/dev/shm/{fifo}", 0o600)  # handed over, but not a segment
    kept = [f"/dev/shm/{other.name}", f"/dev/shm/{fifo}"]
    try:
        w = Wire(daemon.socket)
        w.hello()
        w.send(P.notification("shm_pool", {"names": [s.name for s in pool] + [fifo, "../x", 7]}))
        sid = w.call("spill", {"header": wire_header, "droppable": False}).result["spill"]
        pool[0].buf[: sizes[0]] = os.urandom(sizes[0])
        put = {"spill": sid, "index": 0, "offset": 0, "shm": pool[0].name, "length": sizes[0]}
        w.send(P.notification("put_shm", put))
        w.send(P.notification("put", {"spill": sid, "index": 1, "offset": 0}, os.urandom(sizes[1])))
        assert w.call("commit", {"spill": sid}).result["outcome"] == "stored"
        assert all(os.path.exists(f"/dev/shm/{s.name}") for s in pool)  # the connection goes on: kept
        w.close()  # the client vanishes: nothing of its own unlinks its pool
        assert gone_within([f"/dev/shm/{s.name}" for s in pool])
        time.sleep(0.2)
        assert all(os.path.exists(p) for p in kept)
    finally:
        for seg in [*pool, other]:
            seg.close()
        for p in [f"/dev/shm/{s.name}" for s in [*pool, other]] + [f"/dev/shm/{fifo}"]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
    assert daemon.proc is not None and daemon.proc.poll() is None


def spill_from(w: Wire, header: dict[str, Any], sizes: list[int], name: str) -> P.Message:
    """Open a spill of ``small_header``'s two tensors, send the first from segment ``name`` and the second inline,
    and commit it: the commit's answer."""
    sid = w.call("spill", {"header": header, "droppable": False}).result["spill"]
    w.send(P.notification("put_shm", {"spill": sid, "index": 0, "offset": 0, "shm": name, "length": sizes[0]}))
    w.send(P.notification("put", {"spill": sid, "index": 1, "offset": 0}, os.urandom(sizes[1])))
    return w.call("commit", {"spill": sid})


def test_a_client_cannot_name_another_connections_segments(daemon: Daemon) -> None:
    """Found in review: the daemon took any well-formed segment name, so a client could name a segment of another
    client's pool: the daemon read what that engine was sending into this client's spill and stored it, and a pool
    handed over with another's names had the daemon unlink that client's segments when it ended. A connection names
    only its own pool's segments (``shm_refused``, the connection goes on); another's pool is never unlinked."""
    wire_header, sizes = small_header()
    a_seg, b_seg = untracked(os.urandom(sizes[0])), untracked(b"\0" * sizes[0])
    a_path, b_path = f"/dev/shm/{a_seg.name}", f"/dev/shm/{b_seg.name}"
    try:
        a, b = Wire(daemon.socket), Wire(daemon.socket)
        a.hello()
        b.hello()
        a.send(P.notification("shm_pool", {"names": [a_seg.name]}))
        assert a.call("status", {}).error is None  # (its pool handed over before b's)
        b.send(P.notification("shm_pool", {"names": [b_seg.name, a_seg.name]}))  # a's name among its own
        r = spill_from(b, wire_header, sizes, a_seg.name)
        assert r.error is not None and r.error["code"] == "shm_refused", r.error or r.result
        assert "another connection" in r.error["message"], r.error
        assert b.note("shm_free").params["names"] == [a_seg.name]  # handed back to b, as a refused segment is
        assert spill_from(b, wire_header, sizes, b_seg.name).result["outcome"] == "stored"  # b goes on
        r = spill_from(b, wire_header, sizes, seg_name())  # nobody's, but not in the pool b handed over
        assert r.error is not None and r.error["code"] == "shm_refused" and "shm_pool" in r.error["message"], r.error
        b.close()
        assert gone_within([b_path])  # b's own pool is unlinked as it ends
        assert os.path.exists(a_path)  # a's is not
        assert spill_from(a, wire_header, sizes, a_seg.name).result["outcome"] == "stored"  # a never noticed
        a.close()
        assert gone_within([a_path])
    finally:
        for seg in (a_seg, b_seg):
            seg.close()
        for p in (a_path, b_path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)
    assert daemon.proc is not None and daemon.proc.poll() is None


def test_a_client_that_hands_over_no_pool_owns_the_segments_it_names_first(daemon: Daemon) -> None:
    """A client that predates ``shm_pool`` still sends put_shms; each name is bound to the first connection that
    names it, until that connection ends, and no other may name it meanwhile (nor hand it over as its pool)."""
    wire_header, sizes = small_header()
    seg = untracked(os.urandom(sizes[0]))
    path = f"/dev/shm/{seg.name}"
    try:
        a, b = Wire(daemon.socket), Wire(daemon.socket)
        a.hello()
        b.hello()
        assert spill_from(a, wire_header, sizes, seg.name).result["outcome"] == "stored"
        r = spill_from(b, wire_header, sizes, seg.name)
        assert r.error is not None and r.error["code"] == "shm_refused", r.error or r.result
        assert "another connection" in r.error["message"], r.error
        b.send(P.notification("shm_pool", {"names": [seg.name]}))  # not b's to hand over: ignored
        assert spill_from(a, wire_header, sizes, seg.name).result["outcome"] == "stored"  # a's still
        b.close()
        time.sleep(0.2)
        assert os.path.exists(path)  # b's end unlinks nothing of a's; nor does a's (it handed no pool over)
        a.close()
        c = Wire(daemon.socket)
        c.hello()
        deadline = time.monotonic() + 10
        while (r := spill_from(c, wire_header, sizes, seg.name)).error is not None and time.monotonic() < deadline:
            time.sleep(0.05)  # a's end lets the name go (as soon as the daemon has seen it)
        assert r.error is None and r.result["outcome"] == "stored", r.error
        assert os.path.exists(path)
        c.close()
    finally:
        seg.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
    assert daemon.proc is not None and daemon.proc.poll() is None


GROUP_KILLED = textwrap.dedent(
    """
    import asyncio, sys
    from mlx_lm.models import cache as C
    import spilld
    from spilld.client import AsyncClient
    from tests.caches import fill

    async def main():
        c = await AsyncClient.open(sys.argv[1], identity=spilld.Identity("group-killed"), shm=True)
        assert (await c.spill(list(range(64)), [fill(C.KVCache(), 64)], droppable=False)).stored
        print(c._pool._prefix, flush=True)
        await asyncio.sleep(3600)

    asyncio.run(main())
    """
)


def test_a_client_killed_with_its_process_group_leaves_no_segment_behind(daemon: Daemon) -> None:
    """The real client, its pool made and used, killed with its resource tracker (SIGKILL to its process group)."""
    env = os.environ | {"PYTHONPATH": os.getcwd()}
    kid = subprocess.Popen(
        [sys.executable, "-c", GROUP_KILLED, daemon.socket], stdout=subprocess.PIPE, env=env, start_new_session=True
    )
    assert kid.stdout is not None
    prefix = kid.stdout.readline().decode().strip()
    try:
        assert prefix.startswith("spilld-")
        mine = [n for n in os.listdir("/dev/shm") if n.startswith(prefix + "-")]
        assert len(mine) > 1  # the whole pool, most of it never used
    finally:
        os.killpg(kid.pid, signal.SIGKILL)
        kid.wait()
        kid.stdout.close()
    assert gone_within([f"/dev/shm/{n}" for n in mine]), [n for n in os.listdir("/dev/shm") if n.startswith(prefix)]


@pytest.mark.asyncio
async def test_a_pool_is_unlinked_only_once_the_copies_of_its_connection_end(monkeypatch: pytest.MonkeyPatch) -> None:
    """A committed spill's copy goes on after its connection ends (it opens the segment by name): the pool it was
    handed over in is unlinked only once that copy is done."""
    from spilld import shm
    from tests.hostile_memory import in_process

    started, go = threading.Event(), threading.Event()
    real_read = shm.read_segment

    def slow_read(name: str, into: memoryview) -> None:
        started.set()
        go.wait(10)
        real_read(name, into)

    monkeypatch.setattr(shm, "read_segment", slow_read)
    header, sizes = small_header()
    seg = untracked(os.urandom(sizes[0]))
    path = f"/dev/shm/{seg.name}"
    try:
        async with in_process("copy-then-gone") as (daemon, wire):
            wire.send(P.notification("shm_pool", {"names": [seg.name]}))
            sid = await send_small_spill(wire, header, sizes, seg.name)
            wire.send(P.request(99, "commit", {"spill": sid}))
            await wire.w.drain()
            assert await asyncio.to_thread(started.wait, 10)
            # the client vanishes with an answer unread (a status's): the daemon's read fails at once (ECONNRESET),
            # while a clean EOF would let the commit end before the connection does
            wire.w.transport.pause_reading()  # type: ignore[attr-defined]
            wire.send(P.request(100, "status", {}))
            await wire.w.drain()
            sock = wire.w.transport.get_extra_info("socket")
            deadline = asyncio.get_running_loop().time() + 10
            while unread(sock) == 0 and asyncio.get_running_loop().time() < deadline:  # the answer is here, unread
                await asyncio.sleep(0.01)
            wire.w.transport.abort()
            deadline = asyncio.get_running_loop().time() + 10
            while daemon.connections and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
            assert not daemon.connections
            await asyncio.sleep(0.1)
            assert os.path.exists(path)  # its copy still to come
            go.set()
            deadline = asyncio.get_running_loop().time() + 10
            while os.path.exists(path) and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
            assert not os.path.exists(path)
            while daemon.queue.stored < 1 and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
            assert daemon.queue.stored == 1  # the committed spill was read whole, then stored
    finally:
        go.set()
        seg.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


OUTLIVES_ITS_POOL = textwrap.dedent(
    """
    import asyncio, sys
    from mlx_lm.models import cache as C
    import spilld
    from spilld.client import AsyncClient
    from tests.caches import fill

    async def main():
        c = await AsyncClient.open(sys.argv[1], identity=spilld.Identity("outlives"), shm=True)
        assert (await c.spill(list(range(64)), [fill(C.KVCache(), 64)], droppable=False)).stored
        print(c._pool._prefix, flush=True)
        sys.stdin.readline()  # (on the loop: the lost connection is seen only after the daemon unlinked the pool)
        await c.close()

    asyncio.run(main())
    """
)


def test_a_client_whose_pool_the_daemon_unlinked_closes_and_exits_quietly(daemon: Daemon) -> None:
    """The daemon stops (its connections end) and unlinks the pool it was handed; the client, still running, closes
    after it: its own unlink finds each segment gone, and Python's resource tracker must not try again at exit (it
    printed a warning and an error for each segment on the engine's stderr)."""
    env = os.environ | {"PYTHONPATH": os.getcwd()}
    kid = subprocess.Popen(
        [sys.executable, "-c", OUTLIVES_ITS_POOL, daemon.socket],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )  # fmt: skip
    assert kid.stdout is not None
    prefix = kid.stdout.readline().decode().strip()
    assert prefix.startswith("spilld-")
    daemon.stop()
    assert gone_within([f"/dev/shm/{n}" for n in os.listdir("/dev/shm") if n.startswith(prefix + "-")])
    _, err = kid.communicate(b"\n", timeout=60)
    assert kid.returncode == 0 and err == b"", err.decode()[-2000:]


@pytest.mark.asyncio
async def test_a_spill_whose_connection_drops_between_two_segments_fails_as_connection_lost(
    daemon: Daemon, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: a lost connection closes the pool while a tensor larger than a segment is being sent; the
    next ``try_take`` found a free name whose segment was gone and raised ``KeyError``, so the spill settled failed
    with ``KeyError('spilld-...-1')`` instead of ``ConnectionLost``. A closed pool has no segment to give."""
    from spilld import client as client_mod
    from spilld.client import AsyncClient
    from spilld.queue import Outcome
    from spilld.shm import ShmPool

    monkeypatch.setattr(client_mod, "ShmPool", lambda: ShmPool(segments=4, size=64 * 1024))
    c = await AsyncClient.open(daemon.socket, identity=spilld.Identity("dropped-mid-tensor"), shm=True)
    try:
        send = c._send

        async def send_then_lose(bufs: list[bytes | memoryview], wrote: Callable[[], None] | None = None) -> None:
            await send(bufs, wrote)
            if b"put_shm" in bytes(bufs[0]):  # the reader saw the connection end while this send waited
                c._fail_all(P.ConnectionLost("the daemon closed the connection"))

        monkeypatch.setattr(c, "_send", send_then_lose)
        cache = fill(C.KVCache(), 256, heads=2, dim=128)  # 128 KiB tensors: two segments each
        settled = await asyncio.wait_for(c.spill(list(range(256)), [cache], droppable=False), 30)
        assert settled.outcome is Outcome.FAILED and isinstance(settled.error, errors.ConnectionLost), settled
    finally:
        await c.close()
