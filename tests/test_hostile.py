"""Hostile and careless clients: idle storms, half-closed sockets, garbage; the daemon serves everyone else and
leaks no file descriptor."""

from __future__ import annotations

import array
import json
import os
import socket
import time
from collections.abc import Iterator

import pytest

from spilld import protocol as P
from spilld.daemon.connection import MAX_UNREAD_BYTES
from tests.daemons import Daemon, serving
from tests.wire import Wire, frames


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    with serving("--cap", "64MiB") as d:
        yield d


def fds(d: Daemon) -> int:
    assert d.proc is not None
    return len(os.listdir(f"/proc/{d.proc.pid}/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_hundreds_of_idle_connections_time_out_and_leave_no_fd(daemon: Daemon) -> None:
    time.sleep(0.5)
    before = fds(daemon)
    idle = []
    for _ in range(300):
        s = socket.socket(socket.AF_UNIX)
        s.connect(daemon.socket)
        idle.append(s)
    half = []
    for _ in range(50):  # half-closed before a word
        s = socket.socket(socket.AF_UNIX)
        s.connect(daemon.socket)
        s.shutdown(socket.SHUT_WR)
        half.append(s)
    garbage = socket.socket(socket.AF_UNIX)
    garbage.connect(daemon.socket)
    garbage.sendall(os.urandom(4096))
    t0 = time.monotonic()
    r = daemon.cli("status", "--socket", daemon.socket, "--json")  # a well-behaved client is served meanwhile
    assert r.returncode == 0 and time.monotonic() - t0 < 10
    assert json.loads(r.stdout)["clients"] >= 1
    # the idle ones are cut after the hello timeout (5 s), each told why
    deadline = time.monotonic() + 20
    for s in idle:
        s.settimeout(max(0.1, deadline - time.monotonic()))
        data = b""
        while chunk := s.recv(4096):
            data += chunk
        assert P.FrameDecoder().feed(data)[-1].params["code"] == "timeout"
        s.close()
    for s in [*half, garbage]:
        s.close()
    deadline = time.monotonic() + 10
    while fds(daemon) > before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert fds(daemon) == before
    # 301 clients ended by their own fault (idle, garbage): all counted, at most 10 log lines a second of them
    time.sleep(1.2)  # the summary of the lines held back comes a second after the first of them
    st = json.loads(daemon.cli("status", "--socket", daemon.socket, "--json").stdout)
    assert st["client_errors"] >= 301
    log = [json.loads(x) for x in daemon.read_log().splitlines()]
    lines = [x for x in log if x["msg"].startswith("client ") and "): " in x["msg"]]
    seconds = int(lines[-1]["ts"]) - int(lines[0]["ts"]) + 1
    assert len(lines) <= 10 * (seconds + 1)
    held = sum(int(x["msg"].split()[0]) for x in log if "more client errors not logged" in x["msg"])
    assert len(lines) + held == st["client_errors"]  # every one either logged or summed up


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
def test_fds_sent_with_frames_are_never_kept(daemon: Daemon) -> None:
    """The protocol passes no fds (shared memory goes by name): any a client sends are dropped by the kernel."""
    time.sleep(0.5)
    before = fds(daemon)
    hello = b"".join(bytes(b) for b in P.request(1, "hello", {"version": 1}))
    senders = []
    for _ in range(20):
        s = socket.socket(socket.AF_UNIX)
        s.connect(daemon.socket)
        pipes = [os.pipe() for _ in range(16)]  # 32 unexpected fds on each connection
        passed = [fd for pair in pipes for fd in pair]
        s.sendmsg([hello], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", passed))])
        for fd in passed:
            os.close(fd)
        senders.append(s)
    for s in senders:
        s.settimeout(10)
        assert P.FrameDecoder().feed(s.recv(4096))[0].error is None  # its hello is answered all the same
    assert fds(daemon) == before + len(senders)  # one per connection: none of the 640 passed fds arrived
    assert daemon.cli("status", "--socket", daemon.socket).returncode == 0
    for s in senders:
        s.close()
    deadline = time.monotonic() + 10
    while fds(daemon) > before and time.monotonic() < deadline:
        time.sleep(0.1)
    assert fds(daemon) == before


def test_a_client_that_never_reads_its_answers_is_cut_off(daemon: Daemon) -> None:
    """Found in review: answers queued for a client that sends and never reads grew without bound (a status is
    answered whether it is read or not). Past MAX_UNREAD_BYTES the daemon cuts it off; everyone else is served."""
    w = Wire(daemon.socket, timeout=10)
    w.hello()
    ids = iter(range(1, 10**9))
    cut = False
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        batch = frames(*(P.request(next(ids), "status", {}) for _ in range(16)))
        try:
            w.sock.sendall(batch)
        except (BrokenPipeError, ConnectionResetError):
            cut = True
            break
        time.sleep(0.001)  # a few in flight at a time: under MAX_INFLIGHT_REQUESTS
    assert cut, "the daemon kept answering a client that never reads"
    w.close()
    other = Wire(daemon.socket)
    other.hello()
    st = other.call("status", {}).result
    other.close()
    assert st["client_errors"] >= 1
    assert "answers left unread; disconnected" in daemon.read_log()
    assert next(ids) * 2000 > MAX_UNREAD_BYTES  # it took that many answers, not a protocol error, to be cut


def test_a_silent_client_that_never_reads_its_answers_is_let_go_at_its_idle_timeout() -> None:
    """Found in review: a client that left answers unread (under ``MAX_UNREAD_BYTES``) and went silent was closed
    at its idle timeout with a close that waits for the unread bytes to be sent: it never was, and the connection
    kept its slot of ``--max-clients`` and its answers for ever. It is cut off ``CLOSE_FLUSH_S`` after the close."""
    from spilld.daemon.connection import CLOSE_FLUSH_S

    with serving("--cap", "64MiB", "--idle-timeout", "1") as d:
        stuck = socket.socket(socket.AF_UNIX)
        stuck.connect(d.socket)
        stuck.sendall(frames(P.request(1, "hello", {"version": 1, "client": "stuck"})))
        stuck.setblocking(False)
        sent = 0
        for i in range(200):  # a few MiB of answers, never read (a few in flight at a time)
            try:
                stuck.sendall(frames(*(P.request(10 + 16 * i + j, "status", {}) for j in range(16))))
            except BlockingIOError:
                break
            sent += 16
            time.sleep(0.002)
        assert sent >= 160
        deadline = time.monotonic() + 1 + CLOSE_FLUSH_S + 10
        clients = -1
        while time.monotonic() < deadline:
            time.sleep(0.5)
            r = d.cli("status", "--socket", d.socket, "--json")
            if (clients := json.loads(r.stdout)["clients"]) == 0:  # (the status call's own is not counted)
                break
        assert clients == 0, "the silent client that reads nothing still holds its connection"
        stuck.close()


def sent_spill(w: Wire, seed: int) -> int:
    """A non-droppable spill of 16 rows sent whole, then its commit; the commit's msgid (its answer not read)."""
    from tests.hostile_memory import kv_header

    sid = w.call("spill", {"header": kv_header(16, seed=seed), "droppable": False}).result["spill"]
    for i in range(2):
        w.send(P.notification("put", {"spill": sid, "index": i, "offset": 0}, bytes([seed]) * (8 * 16 * 128 * 2)))
    w._ids += 1
    w.send(P.request(w._ids, "commit", {"spill": sid}))
    return w._ids


def test_a_malformed_lease_answer_lets_its_step_run_unheld_at_once() -> None:
    """Found in review: a grantor's answer to a lease request whose error map had no code closed its connection,
    but the wait for that grant had been taken out first: the daemon's one writer waited out --request-timeout,
    then failed the item, and every other client's commit waited behind it. A grantor gone runs its steps free."""
    import msgpack

    with serving("--cap", "64MiB", "--request-timeout", "20", "--block-tokens", "0") as d:
        g = Wire(d.socket, timeout=30)
        g.hello(lease_grantor=True)
        sent_spill(g, 1)
        while (ask := next((m for m in g.inbox if m.kind == P.REQUEST and m.method == "lease"), None)) is None:
            assert g._read()
        t0 = time.monotonic()
        body = msgpack.packb([1, ask.msgid, {"message": "no code"}, None])
        g.sock.sendall(len(body).to_bytes(4, "little") + (0).to_bytes(4, "little") + body)
        other = Wire(d.socket, timeout=30)
        other.hello()
        assert other.response(sent_spill(other, 2)).result["outcome"] == "stored"
        assert time.monotonic() - t0 < 10  # not the 20 s request timeout
        st = other.call("status", {}).result
        assert st["queue"]["stored"] == 2 and st["queue"]["failed"] == 0, st["queue"]
        other.close()


def test_a_grantors_error_answer_is_quoted_never_taken_as_the_daemons_own_error() -> None:
    """Found in review: a grantor's error answer was rebuilt as the error its code names: a ``disk_full`` made the
    store evict other clients' entries to make room and retry (each hostile spill evicted one), and
    ``not_admitted`` turned a failed non-droppable spill into a dropped one."""

    with serving("--cap", "64MiB", "--block-tokens", "0") as d:
        victim = Wire(d.socket, timeout=30)
        victim.hello()
        for seed in (1, 2, 3):
            assert victim.response(sent_spill(victim, seed)).result["outcome"] == "stored"
        g = Wire(d.socket, timeout=30)
        g.hello(lease_grantor=True)
        for code in ("disk_full", "not_admitted"):
            commit, refusals = sent_spill(g, 9), 0
            while (done := next((m for m in g.inbox if m.kind == P.RESPONSE and m.msgid == commit), None)) is None:
                if (ask := next((m for m in g.inbox if m.kind == P.REQUEST and m.method == "lease"), None)) is None:
                    assert g._read()
                    continue
                g.inbox.remove(ask)
                g.send(P.frame([P.RESPONSE, ask.msgid, {"code": code, "message": "x" * 5000}, None]))
                refusals += 1
            assert done.result["outcome"] == "failed" and done.result["code"] == "lease_refused", done.result
            assert code in done.result["message"] and len(done.result["message"]) <= P.MAX_ERROR_MESSAGE
            assert refusals == 1  # no retry made room for it
        st = victim.call("status", {}).result["store"]
        assert st["entries"] == 3 and st["evicted"] == 0, st
        assert st["store_errors"] == 0 and not st["errors"], st  # a client's refusal is no failed write of the disk
        victim.close()
        g.close()


def test_clients_connecting_in_a_loop_under_new_names_do_not_flood_the_log() -> None:
    """Found in review: each new client name was one line at info, unthrottled: a client connecting in a loop
    under new names (each process's default name is its pid) wrote a line a connection; and a newline in a name
    forged a second line on a terminal."""
    from spilld.daemon.logs import CLIENT_ERROR_LOGS_PER_S

    with serving("--cap", "64MiB") as d:
        t0 = time.monotonic()
        for i in range(120):
            w = Wire(d.socket)
            w.hello(client=f"n{i}\nFAKE level=error")
            w.close()
        took = time.monotonic() - t0
        time.sleep(0.3)
        lines = [json.loads(line) for line in d.read_log().splitlines() if line.startswith("{")]
    said = [x for x in lines if x["level"] == "info" and "connected" in x["msg"]]
    assert len(said) <= CLIENT_ERROR_LOGS_PER_S * (took + 2), (len(said), took)
    assert said and all("\n" not in x["msg"] and x["client_name"].startswith("n") for x in said)
