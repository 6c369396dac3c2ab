"""The daemon as a good citizen of the machine: folders it did not make keep their modes, one daemon per folder
and per socket, a start that is healthy or refused, a client that talks only to its own user's daemon, and an
event loop that answers while a big evict runs."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.models import cache as C

import spilld
from spilld import errors, fileio
from spilld.client import AsyncClient
from spilld.config import Config
from spilld.daemon import is_served
from spilld.entries import identity_fingerprint
from spilld.lockfile import LOCK_NAME, SOCKET_LOCK_SUFFIX, FileLock
from spilld.service import lifecycle
from spilld.service.sdnotify import Notifier
from spilld.store import Store
from tests.caches import fill, live, same
from tests.daemons import Daemon, cleanup, new_root

IDENT = spilld.Identity("m", "cfg", "tok", "")
EVICT_ENTRIES = 10_000  # the figure: a big evict while requests keep being answered
ANSWERED_AT_LEAST = 2  # ... this many status calls between two of its batches, and as many while it unlinks
NOBODY = 65534


@pytest.fixture
def root() -> Iterator[str]:
    r = new_root()
    try:
        yield r
    finally:
        cleanup(r)


def refused(d: Daemon, code: int) -> str:
    """Start a daemon that must refuse: its exit code, and the one line it printed (never a traceback)."""
    d.start(wait=False)
    assert d.proc is not None
    rc = d.proc.wait(60)
    out = d.read_log()
    assert rc == code, out
    assert "Traceback" not in out, out
    lines = [ln for ln in out.splitlines() if ln.startswith("spilld: ")]
    assert len(lines) == 1, out
    return lines[0]


def mode(path: str) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


# --- 1. never change what we did not create -----------------------------------------------------------


def test_a_socket_folder_we_make_is_0700_and_one_that_exists_keeps_its_mode(root: str) -> None:
    made = Daemon(root).start()
    try:
        assert mode(os.path.dirname(made.socket)) == 0o700  # ours: made by spilld
        assert mode(made.socket) == 0o600
    finally:
        made.stop()
    shared = os.path.join(root, "shared")
    os.mkdir(shared)
    os.chmod(shared, 0o755)
    d = Daemon(shared)
    os.makedirs(os.path.dirname(d.socket))
    os.chmod(os.path.dirname(d.socket), 0o755)
    d.start()
    try:
        assert mode(os.path.dirname(d.socket)) == 0o755  # not ours: left as it was
    finally:
        assert d.stop() == 0


@pytest.mark.parametrize("how", ["open", "sticky-not-ours"])
def test_a_socket_folder_others_can_write_is_refused_and_left_alone(root: str, how: str) -> None:
    d = Daemon(root)
    run = os.path.dirname(d.socket)
    os.makedirs(run)
    os.chmod(run, 0o777 if how == "open" else 0o1777)
    if how == "sticky-not-ours":
        if os.getuid() != 0:
            pytest.skip("needs root to give a folder to another user")
        os.chown(run, NOBODY, -1)
    line = refused(d, 2)
    assert run in line and ("writable by other users" in line or "belongs to uid" in line), line
    assert mode(run) == (0o777 if how == "open" else 0o1777)
    assert not os.path.exists(d.socket)


def test_a_sticky_socket_folder_others_can_write_is_refused_even_when_ours(root: str) -> None:
    """Like /tmp for root (found in review: root's daemon served on /tmp/x.sock, which the README says is refused):
    the sticky bit keeps our names from removal, not from being created first by another user."""
    d = Daemon(root)
    run = os.path.dirname(d.socket)
    os.makedirs(run)
    os.chmod(run, 0o1777)
    line = refused(d, 2)
    assert run in line and "writable by other users" in line, line
    assert mode(run) == 0o1777 and not os.path.exists(d.socket)


def test_something_that_is_not_a_socket_at_the_path_is_never_replaced(root: str) -> None:
    d = Daemon(root)
    os.makedirs(os.path.dirname(d.socket), mode=0o700)
    Path(d.socket).write_text("a user's file")
    line = refused(d, 2)
    assert "not a socket" in line
    assert Path(d.socket).read_text() == "a user's file"


@pytest.mark.parametrize("at", ["socket", "folder"])
def test_a_file_at_a_lock_name_that_no_spilld_wrote_is_never_overwritten(root: str, at: str) -> None:
    """Found in review: a user's own file at ``<socket>.lock`` was emptied and given the daemon's pid. A file at a
    lock's name that is neither empty nor a pid is refused (exit 2) and left as it was."""
    from spilld.lockfile import LOCK_NAME, SOCKET_LOCK_SUFFIX

    d = Daemon(root)
    if at == "socket":
        os.makedirs(os.path.dirname(d.socket), mode=0o700)
        lock = Path(d.socket + SOCKET_LOCK_SUFFIX)
    else:
        os.makedirs(d.dir, mode=0o700)
        lock = Path(d.dir) / LOCK_NAME
    lock.write_text("my own notes, not spilld's\n")
    line = refused(d, 2)
    assert "not a spilld lock file" in line, line
    assert lock.read_text() == "my own notes, not spilld's\n"
    lock.write_text("12345\n")  # one a spilld left (its pid): taken
    d.start()
    d.stop()
    assert lock.read_text().strip().isdigit()


SYSTEM_PYTHON = "/usr/bin/python3"  # one another user may run (the test's own may sit in root's home)


@pytest.mark.skipif(
    os.getuid() != 0 or not os.access(SYSTEM_PYTHON, os.X_OK), reason="needs root to run a listener as another user"
)
def test_a_client_refuses_a_daemon_of_another_user_before_sending_a_byte() -> None:
    folder = tempfile.mkdtemp(prefix="sd-", dir="/tmp")
    os.chmod(folder, 0o777)
    path = os.path.join(folder, "s.sock")
    listener = (
        "import socket,sys;s=socket.socket(socket.AF_UNIX);s.bind(sys.argv[1]);s.listen();print('up',flush=True);"
        "c,_=s.accept();c.settimeout(5);print(len(c.recv(1)),flush=True)"
    )
    proc = subprocess.Popen(
        [SYSTEM_PYTHON, "-c", listener, path], stdout=subprocess.PIPE, text=True, user=NOBODY, group=NOBODY
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"

        async def go() -> None:
            with pytest.raises(errors.ForeignDaemon, match=f"uid {NOBODY}"):
                await asyncio.wait_for(AsyncClient.open(path, identity=IDENT), 10)

        asyncio.run(go())
        assert proc.stdout.readline().strip() == "0"  # the listener read end-of-file: not one byte came
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(folder, ignore_errors=True)


# --- 2. one daemon per folder and per socket ---------------------------------------------------------------


def test_a_client_polling_status_logs_one_connection_line_not_one_a_poll(root: str) -> None:
    """A monitor that runs `spilld status` every few seconds (found in review: an info line per connection, so
    the daemon's log grew without end under any poll)."""
    d = Daemon(root).start()
    try:
        for _ in range(4):
            assert d.cli("status", "--socket", d.socket).returncode == 0
        with socket.socket(socket.AF_UNIX) as s:  # a connection that never says hello: nothing logged
            s.connect(d.socket)
    finally:
        assert d.stop() == 0
    lines = [json.loads(ln) for ln in d.read_log().splitlines() if ln.startswith("{")]
    connected = [ln for ln in lines if " connected: " in ln["msg"]]
    assert [ln["client_name"] for ln in connected] == ["spilld status"], connected


def test_a_second_daemon_on_the_same_folder_exits_5_naming_the_first(root: str) -> None:
    first = Daemon(root).start()
    other = new_root()
    try:
        second = Daemon(other, ["--dir", first.dir])  # another socket, the same folder
        line = refused(second, 5)
        assert f"pid {first.proc.pid}" in line and first.dir in line, line  # type: ignore[union-attr]
        assert first.proc is not None and first.proc.poll() is None
    finally:
        first.stop()
        cleanup(other)


def test_a_second_daemon_on_the_same_socket_exits_5_naming_the_first(root: str) -> None:
    first = Daemon(root).start()
    other = new_root()
    try:
        second = Daemon(other, ["--socket", first.socket])  # another folder, the same socket
        line = refused(second, 5)
        assert f"pid {first.proc.pid}" in line, line  # type: ignore[union-attr]
    finally:
        first.stop()
        cleanup(other)


LISTENER = """
import socket, sys
s = socket.socket(socket.AF_UNIX)
s.bind(sys.argv[1])
s.listen()
print("up", flush=True)
held = []
while True:
    c, _ = s.accept()
    held.append(c)
    try:
        if sys.argv[2] == "answers":
            c.settimeout(5)
            if c.recv(100):
                c.sendall(b"HTTP/1.0 400 Bad Request\\r\\n\\r\\n")
        elif sys.argv[2] == "closes":
            c.close()
    except OSError:
        pass
"""
NOT_SPILLD = {  # how a listener that is not spilld meets the hello, and what the refusal says of it
    "answers": "not spilld",  # with bytes that break the protocol
    "is_silent": "did not answer",
    "closes": "closed the connection",
}


@pytest.mark.parametrize("how", NOT_SPILLD)
def test_something_else_listening_on_the_socket_is_not_called_spilld_and_the_refusal_leaves_no_lock(
    root: str, how: str
) -> None:
    """Found in review: a start refused because some other program listened on the socket's path said "a daemon
    already listens" (of what it had not asked) and left ``SOCKET.lock`` behind, a file it had just made."""
    d = Daemon(root)
    os.makedirs(os.path.dirname(d.socket), mode=0o700)
    proc = subprocess.Popen([sys.executable, "-c", LISTENER, d.socket, how], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "up"
        line = refused(d, 5)
        assert f"something listens on {d.socket}" in line and NOT_SPILLD[how] in line, line
        assert "spilld daemon" not in line, line
        assert proc.poll() is None and stat.S_ISSOCK(os.lstat(d.socket).st_mode)  # its socket is left alone
        assert sorted(os.listdir(os.path.dirname(d.socket))) == ["spilld.sock"]  # no lock of ours left behind
        assert not os.path.exists(d.dir)
    finally:
        proc.kill()
        proc.wait()


def test_a_refused_start_keeps_a_lock_file_it_did_not_make(root: str) -> None:
    """The lock a stopped daemon left (its pid in it) is the next one's: a refusal leaves it where it was."""
    first = Daemon(root).start()
    second = Daemon(new_root(), ["--socket", first.socket])
    lock = Path(first.socket + SOCKET_LOCK_SUFFIX)
    try:
        assert first.stop() == 0 and lock.exists()
        first.start()
        assert f"pid {first.proc.pid}" in refused(second, 5)  # type: ignore[union-attr]
        assert lock.read_text().strip() == str(first.proc.pid)  # type: ignore[union-attr]
    finally:
        first.stop()
        cleanup(second.root)


def test_a_lock_file_removed_as_it_is_taken_is_never_held_twice(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A refused start removes the lock file it made while it holds it; one who opened the file just before takes
    the lock of a file no longer named, and must notice (else a third process, locking the file the name holds
    now, would be a second owner)."""
    import fcntl

    from spilld import lockfile

    path = str(tmp_path / "s.sock.lock")
    maker = FileLock(path, "the socket")
    assert maker.try_acquire() and maker.made
    real_flock = fcntl.flock
    calls = 0

    def flock(fd: int, op: int) -> None:
        nonlocal calls
        calls += 1
        if calls == 1:  # the taker opened the maker's file; the maker gives up and removes it meanwhile
            maker.discard()
        real_flock(fd, op)

    taker = FileLock(path, "the socket")
    monkeypatch.setattr(lockfile.fcntl, "flock", flock)
    assert taker.try_acquire()
    monkeypatch.setattr(lockfile.fcntl, "flock", real_flock)
    assert os.path.exists(path) and os.stat(path).st_ino == os.fstat(taker.fd).st_ino  # type: ignore[arg-type]
    assert not FileLock(path, "the socket").try_acquire()  # one owner
    taker.discard()
    assert not os.path.exists(path)


def test_the_socket_lock_is_taken_before_the_stale_socket_probe(root: str) -> None:
    d = Daemon(root)
    os.makedirs(os.path.dirname(d.socket), mode=0o700)
    starting = FileLock(d.socket + SOCKET_LOCK_SUFFIX, "the socket")  # a daemon between its lock and its bind
    starting.acquire()
    try:
        line = refused(d, 5)  # no socket exists yet, so a probe alone would have let it in
        assert f"pid {os.getpid()}" in line, line
    finally:
        starting.release()


def test_two_daemons_started_at_once_on_one_socket_one_serves(root: str) -> None:
    a, b = Daemon(root), Daemon(new_root(), ["--socket", os.path.join(root, "run", "spilld.sock")])
    try:
        a.start(wait=False)
        b.start(wait=False)
        assert a.proc is not None and b.proc is not None
        deadline = time.monotonic() + 60
        while a.proc.poll() is None and b.proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        loser = a if a.proc.poll() is not None else b
        winner = b if loser is a else a
        assert loser.proc is not None and loser.proc.wait(60) == 5, loser.read_log()
        while not is_served(a.socket):  # the one socket both were given
            assert winner.proc is not None and winner.proc.poll() is None, winner.read_log()
            time.sleep(0.05)
        assert winner.stop() == 0
    finally:
        a.kill()
        b.kill()
        cleanup(b.root)


def test_the_scan_reaps_temp_files_only_under_the_folder_lock(tmp_path: Path) -> None:
    s = Store(tmp_path, disk_cap=2**40)
    folder = tmp_path / identity_fingerprint(IDENT) / "base"
    folder.mkdir(parents=True)
    temp = folder / f".x.spilld.abc{fileio.TEMP_SUFFIX}"
    temp.write_bytes(b"another daemon's write in progress")
    other = FileLock(str(tmp_path / LOCK_NAME), "the folder")
    other.acquire()
    try:
        s.scan()
        assert temp.exists() and s.counters.reaped_temp == 0  # not ours to reap: someone else runs here
    finally:
        other.release()
    s.scan()
    assert not temp.exists() and s.counters.reaped_temp == 1
    assert not s.lock.held  # a scan that took the lock to reap gives it back
    # the root's own: a pins file's write cut short (found in review: only namespace folders were reaped)
    pins_temp = tmp_path / f".spilld-pins.abc{fileio.TEMP_SUFFIX}"
    pins_temp.write_bytes(b"half a pins file")
    s.scan()
    assert not pins_temp.exists() and s.counters.reaped_temp == 2


@pytest.mark.asyncio
async def test_a_spiller_refuses_a_folder_a_daemon_serves(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in review: a Spiller that could not share the folder's lock (a daemon holds it for its life) wrote there
    as the daemon's guest; after the daemon's restart both counted the guest's files as their own, one unlinked
    blocks the other's entries named, and spills reported stored were lost. Such a Spiller is refused now, having
    written nothing, and one opened once the daemon is gone writes there."""
    import spilld.spiller

    monkeypatch.setattr(spilld.spiller, "SHARE_WAIT_S", 0.2)
    daemon = Store(tmp_path)
    daemon.acquire()  # what a daemon's start does
    before = sorted(os.listdir(tmp_path))
    try:
        with pytest.raises(errors.AlreadyRunning, match=f"pid {os.getpid()}.*spilld.Client"):
            await spilld.Spiller.open(tmp_path, identity=IDENT)
        with pytest.raises(errors.AlreadyRunning):
            async with spilld.Spiller(tmp_path, identity=IDENT):
                pass
        assert sorted(os.listdir(tmp_path)) == before
    finally:
        daemon.close()
    async with spilld.Spiller(tmp_path, identity=IDENT) as sp:
        assert sp.store.lock.fd is not None  # the folder's lock, shared: a writer of the folder again
        settled = await sp.spill(list(range(8)), [fill(C.KVCache(), 8)])
        assert settled.outcome is spilld.Outcome.STORED


@pytest.mark.asyncio
async def test_an_open_spiller_keeps_its_folder_from_other_scans_and_daemons(tmp_path: Path) -> None:
    """A Spiller writes without a daemon: while it is open, another spilld's scan must not reap what its puts are
    writing, nor a daemon start there (found in review: a second store's scan took the blocks of a put still under
    way for orphans, and the put said stored). Spillers share the folder with each other."""
    a = await spilld.Spiller.open(tmp_path, identity=IDENT)
    folder = tmp_path / identity_fingerprint(IDENT) / "base"
    folder.mkdir(parents=True)
    temp = folder / f".x.spilld.abc{fileio.TEMP_SUFFIX}"
    temp.write_bytes(b"a put under way")
    try:
        other = Store(tmp_path, disk_cap=2**40)
        other.scan()
        assert temp.exists() and other.counters.reaped_temp == 0
        with pytest.raises(errors.AlreadyRunning):
            Store(tmp_path).acquire()  # what a daemon's start does
        b = await spilld.Spiller.open(tmp_path, identity=spilld.Identity("another model"))  # shares the folder
        await b.close()
        assert temp.exists()
    finally:
        await a.close()
    last = Store(tmp_path, disk_cap=2**40)
    last.scan()
    assert not temp.exists() and last.counters.reaped_temp == 1  # every Spiller closed: the scan may reap


@pytest.mark.asyncio
async def test_spillers_opened_at_once_all_hold_the_folder_and_a_dropped_one_lets_go(tmp_path: Path) -> None:
    """Two Spillers opened together: the second waits for the first's scan (which holds the lock alone) and then
    shares it; found in review: it went on holding nothing, so once the first closed a third one's scan reaped
    the blocks of its put under way. A Spiller dropped without ``close`` lets the lock go with it."""
    import gc

    a, b = await asyncio.gather(*(spilld.Spiller.open(tmp_path, identity=IDENT) for _ in range(2)))
    assert a.store.lock.fd is not None and b.store.lock.fd is not None
    await a.close()
    with pytest.raises(errors.AlreadyRunning):
        Store(tmp_path).acquire()  # b still holds it
    await b.close()
    dropped = await spilld.Spiller.open(tmp_path, identity=IDENT)
    assert dropped.store.lock.fd is not None
    del dropped
    gc.collect()
    owner = Store(tmp_path)
    owner.acquire()  # nothing of the dropped Spiller is left holding the folder
    owner.close()


@pytest.mark.asyncio
async def test_spillers_sharing_a_folder_never_unlink_a_block_the_others_entries_name(tmp_path: Path) -> None:
    """Two Spillers of one model in one folder (found in review: B named the blocks of A's entry that its scan had
    found, A's eviction unlinked them, and B's stored entry was lost). A block file is unlinked only by the store
    that owns it: the one that wrote it, or found it in a scan made alone; B writes copies of its own."""
    from tests.blocks_corpus import B, conversation, toks

    a = await spilld.Spiller.open(tmp_path, identity=IDENT, block_tokens=B)
    b: spilld.Spiller | None = None
    try:
        e1 = [*toks(2 * B), *toks(4, start=5000)]
        assert (await a.spill(e1, conversation(e1), droppable=False)).stored
        b = await spilld.Spiller.open(tmp_path, identity=IDENT, block_tokens=B)  # its scan finds E1 and its blocks
        e2 = [*toks(2 * B), *toks(30, start=7000)]  # shares E1's two blocks
        assert (await b.spill(e2, conversation(e2), droppable=False)).stored
        assert b.store.counters.blocks_reused == 0  # not its own: it wrote copies
        assert a.store.remove_where(lambda e: e.tokens[-1] == e1[-1]) == 1  # A evicts E1, and unlinks its blocks
        got = await b.load([*e2, 1])
        assert got is not None and got.tokens == e2
        assert all(same(live(x), live(y)) for x, y in zip(got.caches, conversation(e2), strict=True))
        # and B's eviction leaves A's files: A's entries may name them
        e3 = [*toks(2 * B), *toks(8, start=9000)]
        assert (await a.spill(e3, conversation(e3), droppable=False)).stored  # A reuses its own blocks, or writes
        await b.close()
        b = None
        assert (await a.load([*e3, 1])) is not None
    finally:
        if b is not None:
            await b.close()
        await a.close()
    last = Store(tmp_path, disk_cap=2**40, block_tokens=B)  # alone: every file is its own again
    last.scan()
    assert last.count == 2 and last.stats()["quarantined"] == 0


@pytest.mark.asyncio
async def test_a_spiller_that_loses_its_lock_turning_it_shared_owns_no_block_it_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """flock turns a hold shared by letting it go first: another writer may scan the folder alone in between and
    own its blocks too (found in review: both then reused and unlinked the same files)."""
    from tests.blocks_corpus import B, conversation, toks

    first = Store(tmp_path, disk_cap=2**40, block_tokens=B)
    e1 = [*toks(2 * B), *toks(4, start=5000)]
    await first.put(e1, conversation(e1), IDENT)
    first.close()

    def lost(self: FileLock) -> bool:
        self.release()
        return False

    monkeypatch.setattr(FileLock, "share", lost)
    a = await spilld.Spiller.open(tmp_path, identity=IDENT, block_tokens=B)
    try:
        assert a.store.blocks and not any(b.owned for b in a.store.blocks)
        assert a.store.lock.fd is not None  # held shared again
    finally:
        await a.close()


@pytest.mark.asyncio
async def test_a_scan_under_another_owners_lock_evicts_and_moves_nothing(tmp_path: Path) -> None:
    """A store that scans a folder another spilld owns (its cap may be smaller) leaves the owner's entries and
    bad files where they are (found in review: it evicted them down to its own cap)."""
    owner = Store(tmp_path, disk_cap=2**40)
    for i in range(3):
        await owner.put(list(range(i * 100, i * 100 + 8)), [fill(C.KVCache(), 8, seed=i)], IDENT)
    bad = os.path.join(os.path.dirname(owner.entries[0].path), "0" * 24 + ".spilld")
    Path(bad).write_bytes(b"not a cache file")
    lock = FileLock(str(tmp_path / LOCK_NAME), "the folder")
    lock.acquire()
    try:
        small = Store(tmp_path, disk_cap=1)
        assert small.scan() == 3
        assert all(os.path.exists(e.path) for e in owner.entries) and os.path.exists(bad)
    finally:
        lock.release()
    small.scan()  # nobody owns it now: this store's cap and quarantine apply
    assert small.count == 0 and not os.path.exists(bad)


@pytest.mark.asyncio
async def test_a_scan_reads_only_folders_named_as_spilld_names_them(tmp_path: Path) -> None:
    """A user's folder under the root (here their copy of a namespace folder, under a name of their own, and a
    folder of theirs inside a model's folder) is theirs: found in review, the scan walked every folder, moved the
    copied manifest aside, removed spilld's own blocks as duplicates and served the user's copies."""
    s = Store(tmp_path, disk_cap=2**40, block_tokens=16)
    r = await s.put(list(range(40)), [fill(C.KVCache(), 40, seed=1)], IDENT)
    s.close()
    ns = os.path.dirname(r.path)
    copies = [tmp_path / "my-backup" / "base", Path(os.path.dirname(ns)) / "old"]
    for c in copies:
        shutil.copytree(ns, c)
    theirs = {c: sorted(os.listdir(c)) for c in copies}
    ours = sorted(os.listdir(ns))
    again = Store(tmp_path, disk_cap=2**40, block_tokens=16)
    assert again.scan() == 1
    assert {c: sorted(os.listdir(c)) for c in copies} == theirs and sorted(os.listdir(ns)) == ours
    assert again.stats()["quarantined"] == 0 and again.stats()["blocks_reclaimed"] == 0
    assert all(os.path.dirname(b.path) == ns for b in again.blocks)
    # nor does `spilld verify --dir` judge them (found in review)
    (copies[0] / os.path.basename(r.path)).write_bytes(b"the user's own bytes")
    got = subprocess.run(
        [sys.executable, "-m", "spilld", "verify", "--dir", str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert got.returncode == 0 and "my-backup" not in got.stdout and "1 entry" in got.stdout, got


@pytest.mark.asyncio
async def test_symbolic_links_in_a_store_are_never_followed_served_or_replaced(tmp_path: Path) -> None:
    """Found in review: the scan read through a user's symbolic links named like spilld's files. One to a file of
    theirs was quarantined (the link moved away), one to a valid entry kept outside the store was served, its
    target's mtime changed by the restore and the link unlinked by an evict; a ``.spilld-pins`` link was replaced
    by a regular file. Links are neither read through nor touched now (a temp-named one is not reaped either)."""
    from spilld.store.pins import PINS_FILE

    root, out = tmp_path / "root", tmp_path / "outside"
    out.mkdir()
    s = Store(root, disk_cap=2**40, block_tokens=0)
    r = await s.put(list(range(40)), [fill(C.KVCache(), 40, seed=1)], IDENT)
    s.close()
    ns = os.path.dirname(r.path)
    kept, notes, pins = out / "backup.spilld", out / "notes.spilld", out / "pins.txt"
    shutil.move(r.path, kept)  # the user keeps the entry elsewhere, a link in its place
    os.utime(kept, (1e9, 1e9))
    notes.write_bytes(b"my own notes")
    pins.write_text("")
    links = {
        os.path.join(ns, "mine.spilld"): kept,
        os.path.join(ns, "notes.spilld"): notes,
        fileio.temp_path_for(os.path.join(ns, "x.spilld")): notes,
        str(root / PINS_FILE): pins,
    }
    for link, target in links.items():
        os.symlink(target, link)
    again = Store(root, disk_cap=2**40, block_tokens=0)
    assert again.scan() == 0 and again.stats()["quarantined"] == 0
    assert not isinstance(again.lookup(IDENT, "", list(range(41))), spilld.Hit)
    other = await again.put(list(range(500, 540)), [fill(C.KVCache(), 40, seed=2)], IDENT, pin=True)
    assert again.entry_at(other.path) is not None  # stored; only the pins file was refused
    entry = again.entry_at(other.path)
    assert entry is not None
    os.rename(other.path, out / "moved.spilld")  # an entry's file swapped for a link while the store runs
    os.symlink(out / "moved.spilld", other.path)
    os.utime(out / "moved.spilld", (1e9, 1e9))
    again.touch(entry)
    await again.evict_async()
    assert os.stat(kept).st_mtime == 1e9 and os.stat(out / "moved.spilld").st_mtime == 1e9
    assert all(os.path.islink(link) and os.readlink(link) == str(target) for link, target in links.items())
    assert pins.read_text() == "" and notes.read_bytes() == b"my own notes"


def test_a_lock_whose_pid_cannot_be_written_is_still_held_and_let_go(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The pid in a lock file only names its holder: a full disk there must not leave the flock taken by a
    descriptor nobody holds (found in review: every later start was refused until the process ended)."""

    def full(*_: Any) -> int:
        raise OSError(28, "No space left on device")

    lock = FileLock(str(tmp_path / LOCK_NAME), "the folder")
    with monkeypatch.context() as m:
        m.setattr(os, "pwrite", full)
        assert lock.try_acquire() and lock.held
    other = FileLock(str(tmp_path / LOCK_NAME), "the folder")
    with pytest.raises(errors.AlreadyRunning, match="has not written its pid yet"):
        other.acquire()
    lock.release()
    other.acquire()
    other.release()


# --- 3. start healthy or not at all ------------------------------------------------------------------------


@pytest.mark.parametrize("where", ["a file", "below a file", "/proc"])
def test_a_dir_that_cannot_take_writes_is_refused_at_start(root: str, where: str) -> None:
    blocker = os.path.join(root, "file")
    Path(blocker).write_text("not a folder")
    bad = {"a file": blocker, "below a file": os.path.join(blocker, "store"), "/proc": "/proc/spilld-store"}[where]
    line = refused(Daemon(root, ["--dir", bad]), 2)
    assert bad in line or "--dir" in line, line


@pytest.mark.asyncio
async def test_failed_writes_are_store_errors_in_status(root: str) -> None:
    from spilld.daemon import Daemon as InProcess

    cfg = Config(dir=os.path.join(root, "store"), socket=os.path.join(root, "run", "s.sock"), disk_cap=2**40)
    d = InProcess(cfg)
    await d.start()
    try:
        Path(d.store.root, identity_fingerprint(IDENT)).write_text("a file where the model's folder goes")
        client = await AsyncClient.open(cfg.socket, identity=IDENT)
        try:
            for n in (4, 5):
                got = await client.spill(list(range(n)), [fill(C.KVCache(), n)])
                assert not got.stored
            st = await client.status()
        finally:
            await client.close()
        assert st["queue"]["failed"] == 2
        assert st["store"]["store_errors"] == 2 and st["store"]["errors"] == {"io_error": 2}, st["store"]
    finally:
        await d.stop()


# --- 5. no file I/O on the event loop ----------------------------------------------------------------------


class Pings(Notifier):
    """Keeps the time of every watchdog ping."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.at: list[float] = []

    def send(self, **fields: str | int) -> bool:
        if fields.get("WATCHDOG") == 1:
            self.at.append(time.monotonic())
        return super().send(**fields)


def many_entries(store_dir: str, n: int) -> None:
    """``n`` entries in one folder: one real file, then hard links to it under other names (fast to make)."""
    s = Store(store_dir, disk_cap=2**40)
    first = asyncio.run(s.put(list(range(8)), [fill(C.KVCache(), 8)], IDENT)).path
    folder = os.path.dirname(first)
    for i in range(n - 1):
        os.link(first, os.path.join(folder, f"{i:024x}.spilld"))


@pytest.mark.asyncio
async def test_evicting_10000_entries_leaves_the_loop_answering(root: str) -> None:
    from spilld.daemon import Daemon as InProcess

    cfg = Config(dir=os.path.join(root, "store"), socket=os.path.join(root, "run", "s.sock"), disk_cap=2**40)
    await asyncio.to_thread(many_entries, cfg.dir, EVICT_ENTRIES)
    notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    notify.bind(os.path.join(root, "notify"))
    d = InProcess(cfg)
    pings = Pings(os.path.join(root, "notify"))
    d.service = lifecycle.Lifecycle(pings, watchdog_s=0.02)
    d.service.start_watchdog()
    await d.start()
    try:
        assert d.store.count == EVICT_ENTRIES
        client = await AsyncClient.open(cfg.socket, identity=IDENT)
        try:
            await client.status()
            t0 = time.monotonic()
            evict = asyncio.ensure_future(client.call("evict", {}))
            waits: list[float] = []
            seen: list[tuple[int, bool]] = []  # at each status answered: the entries left, and the evict answered
            while not evict.done():
                t = time.perf_counter()
                await client.status()
                waits.append(time.perf_counter() - t)
                seen.append((d.store.count, evict.done()))
                await asyncio.sleep(0.005)
            t1 = time.monotonic()
            got: dict[str, Any] = evict.result()
        finally:
            await client.close()
        assert got["evicted"] == EVICT_ENTRIES and d.store.count == 0
        assert not any(n.endswith(".spilld") for _, _, ns in os.walk(cfg.dir) for n in ns)
        print(json.dumps({"evict_s": round(t1 - t0, 3), "status_calls": len(waits), "max_wait_s": max(waits)}))
        # Counted in turns of the loop, not in wall time (found flaky: under load a status on a right daemon took
        # 60-90 ms against a 50 ms bound, and the whole index taken in one turn gives 70-100 ms): answered between
        # two batches (some entries gone, some left), and while the files are unlinked on a worker.
        between = sum(0 < n < EVICT_ENTRIES for n, _ in seen)
        unlinking = sum(n == 0 and not answered for n, answered in seen)
        assert between >= ANSWERED_AT_LEAST and unlinking >= ANSWERED_AT_LEAST, seen
        during = [t for t in pings.at if t0 <= t <= t1]
        gaps = [b - a for a, b in zip([t0, *during], [*during, t1], strict=True)]
        assert max(gaps) < 0.25, gaps  # the watchdog task kept its turns
    finally:
        await d.stop()
        notify.close()


def test_a_forked_child_keeps_none_of_its_parents_locks(tmp_path: Path) -> None:
    """Found in review: a flock goes with the open file, which a fork shares, so a child that outlived its parent
    (a worker pool's process forked by an engine with an open Spiller) kept the folder's lock, and a daemon's start
    there was refused while it lived. A child closes its copies at once; the parent's hold stays as it was."""
    from tests.forks import child_alive

    lock = FileLock(str(tmp_path / LOCK_NAME), "the folder")
    assert lock.try_acquire()
    with child_alive():
        time.sleep(0.2)  # the child has run its fork hooks
        other = FileLock(str(tmp_path / LOCK_NAME), "the folder")
        assert not other.try_acquire()  # still the parent's
        lock.release()  # the parent lets go while its child lives
        assert other.try_acquire()
        other.release()
