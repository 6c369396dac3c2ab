"""The command line: every verb and exit code, run as a real subprocess."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from spilld import cli
from spilld.lockfile import LOCK_NAME
from tests.daemons import Daemon, cleanup, new_root

DATA = Path(__file__).parent / "data" / "v1"


def spilld(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "spilld", *args], capture_output=True, text=True, timeout=120)


def test_help_lists_exit_codes() -> None:
    r = spilld("--help")
    assert r.returncode == 0 and "exit codes" in r.stdout and "inspect" in r.stdout
    # every exit code of the README's table (found in review: 130 and 141 were not in the help)
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    table = re.findall(r"^\| ([0-9][0-9, ]*) \|", readme, flags=re.M)
    codes = {c.strip() for row in table for c in row.split(",")}
    assert {"0", "1", "2", "3", "70", "130", "141"} <= codes
    listed = {c for line in r.stdout.splitlines() for c in re.findall(r"^  ([0-9]+(?:, [0-9]+)*) ", line)}
    assert codes <= {c.strip() for item in listed for c in item.split(",")}, codes


def test_remote_options_without_remote_are_refused() -> None:
    """Found in review: --remote-key-file and the other --remote-* options were accepted, and ignored, without
    --remote (a key file given for nothing may be one the user believes encrypts what is pushed)."""
    for opt in (
        ["--remote-key-file", "/nope"],
        ["--remote-ttl", "1h"],
        ["--remote-push", "none"],
        ["--remote-cluster"],
        ["--remote-host-name", "gpu-0"],
    ):
        r = spilld(*opt, "--socket", "/tmp/x-never.sock", "--dir", "/tmp/x-never-dir")
        assert r.returncode == 2 and "without --remote" in r.stderr and "Traceback" not in r.stderr, (opt, r)


def test_usage_errors() -> None:
    assert spilld("bogus").returncode == 2
    assert spilld("inspect").returncode == 2  # argparse: missing FILE
    assert spilld("--cap", "4 parsecs", "--socket", "/tmp/x-never.sock").returncode == 2  # sizes are checked first
    r = spilld("--socket")  # no value: one refusal on stderr (found in review: the whole help, on stdout)
    assert r.returncode == 2 and "expected one argument" in r.stderr and r.stdout == "", r
    # a size too large for a float (found in review: an OverflowError traceback and exit 1)
    r = spilld("--cap", "9" * 400, "--socket", "/tmp/x-never.sock")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "larger than any disk" in r.stderr


def test_a_global_option_is_refused_by_a_command_that_does_not_take_it(tmp_path: Any) -> None:
    """Found in review: `spilld --dir D status` ran status against the default socket, ignoring --dir, and
    `spilld ls --dir /nowhere` said 0 entries."""
    r = spilld("--dir", str(tmp_path), "status")
    assert r.returncode == 2 and "--dir means nothing to `spilld status`" in r.stderr, r
    r = spilld("--socket", str(tmp_path / "s.sock"), "ls", "--dir", str(tmp_path))
    assert r.returncode == 2 and "--socket means nothing to `spilld ls`" in r.stderr, r
    assert spilld("ls", "--dir", str(tmp_path)).returncode == 0  # one it takes, before or after: as before
    # the commands said to take each option are those that have it (found in review: service's own --socket)
    from spilld.cli.parser import build_parser

    p = build_parser()
    takers = p.parse_args(["ls"]).global_takers
    subs = next(a for a in p._actions if isinstance(a, argparse._SubParsersAction)).choices
    for name, sub in subs.items():
        for opt in ("--socket", "--dir"):
            assert any(opt in a.option_strings for a in sub._actions) == (name in takers[opt]), (name, opt)
    assert spilld("--dir", str(tmp_path), "ls").returncode == 0
    r = spilld("ls", "--dir", str(tmp_path / "nowhere"))
    assert r.returncode == 2 and "no such folder" in r.stderr, r


def _filled_with_blocks(root: Any) -> int:
    """Two entries sharing two blocks, each with one of its own and a tail: the store's bytes on disk."""
    import asyncio

    from spilld.store import Store
    from tests.blocks_corpus import B, conversation, toks

    s = Store(root, disk_cap=2**40, block_tokens=B)
    for start in (5000, 6000):
        t = [*toks(2 * B), *toks(20, start=start)]
        asyncio.run(s.put(t, conversation(t), spilld_identity()))
    s.close()
    return int(s.total_bytes)


def spilld_identity() -> Any:
    import spilld as sp

    return sp.Identity("sizes", "cfg", "tok", "")


def test_ls_and_evict_count_the_blocks_of_entries(tmp_path: Any) -> None:
    """Found in review: with blocks (the default), ls and evict counted only the entries' own small files, and an
    evict with no daemon left every block on disk until the next daemon's start."""
    root = tmp_path / "store"
    on_disk = _filled_with_blocks(root)
    rows = json.loads(spilld("ls", "--dir", str(root), "--json").stdout)
    assert len(rows) == 2 and all(r["blocks"] == 3 and r["block_bytes"] > r["bytes"] for r in rows)
    assert sum(r["bytes"] for r in rows) + rows[0]["folder_block_bytes"] == on_disk
    text = spilld("ls", "--dir", str(root)).stdout
    assert "2 entries, " in text and "on disk (each block once)" in text
    r = spilld("evict", "--all", "--dir", str(root), "--socket", str(tmp_path / "none.sock"), "--json")
    out = json.loads(r.stdout)
    assert r.returncode == 0 and out["evicted"] == 2 and out["bytes"] == on_disk and not out["through_daemon"]
    left = [n for _, _, names in os.walk(root) for n in names if not n.startswith(".")]
    assert left == []
    # through a daemon: the bytes it freed, blocks included
    from tests.daemons import Daemon, cleanup, new_root

    d = Daemon(new_root())
    try:
        on_disk = _filled_with_blocks(d.dir)
        d.start()
        r = d.cli("evict", "--all", "--socket", d.socket, "--json")
        out = json.loads(r.stdout)
        assert r.returncode == 0 and out["through_daemon"] and out["evicted"] == 2 and out["bytes"] == on_disk, out
    finally:
        d.kill()
        cleanup(d.root)


def test_inspect_text_and_json() -> None:
    r = spilld("inspect", str(DATA / "kv.spilld"))
    assert r.returncode == 0 and "all tensor hashes match" in r.stdout and "kv v1 offset=9" in r.stdout
    r = spilld("inspect", "--json", str(DATA / "kv.spilld"))
    d = json.loads(r.stdout)
    assert d["ok"] and d["header"]["tokens"] == list(range(100, 109)) and d["header"]["caches"][0]["kind"] == "kv"


def test_inspect_says_a_file_is_packed() -> None:
    v3 = DATA.parent / "v3" / "kv.spilld"
    r = spilld("inspect", str(v3))
    assert r.returncode == 0 and "format       v3" in r.stdout and "packed (64-byte alignment)" in r.stdout
    assert json.loads(spilld("inspect", "--json", str(v3)).stdout)["header"]["align"] == 64
    assert "packed" not in spilld("inspect", str(DATA / "kv.spilld")).stdout  # v1: 16 KiB pages


def test_inspect_shows_what_verify_passes_never_an_internal_error(tmp_path: Any) -> None:
    """Found in review: files ``spilld verify`` passes made ``spilld inspect`` fail with "internal error" (exit 70):
    a creation time past the calendar's range, and a msgpack extension in a field of a codec this build does not
    know (with ``--json``)."""
    import msgpack

    from spilld import format as fmt

    def write(name: str, h: fmt.Header) -> str:
        fmt.plan_layout(h)
        path = str(tmp_path / name)
        Path(path).write_bytes(fmt.encode_prefix(fmt.pack_header(h), align=h.align)[0])
        return path

    future = write("future.spilld", fmt.Header(3, 2**63, "spilld/mlx-lm/1", fmt.Identity("m"), [], []))
    entry = fmt.CacheEntry("custom", 1, None, 0, False, {"x": msgpack.ExtType(5, b"\x01")}, [])
    ext = write("ext.spilld", fmt.Header(3, 0, "someone/else/1", fmt.Identity("m"), [], [entry]))
    for path in (future, ext):
        assert spilld("verify", path).returncode == 0
        r = spilld("inspect", path)
        assert r.returncode == 0 and "format       v3" in r.stdout, r.stderr
        r = spilld("inspect", "--json", path)
        assert r.returncode == 0 and json.loads(r.stdout)["ok"], r.stderr
    assert str(2**63) in spilld("inspect", future).stdout
    assert json.loads(spilld("inspect", "--json", ext).stdout)["header"]["caches"][0]["fields"] == {"x": [5, "01"]}


def test_inspect_and_verify_refuse_a_corrupt_file(tmp_path: Any) -> None:
    bad = tmp_path / "bad.spilld"
    shutil.copy(DATA / "kv.spilld", bad)
    data = bytearray(bad.read_bytes())
    data[-1] ^= 0xFF
    bad.write_bytes(bytes(data))
    r = spilld("inspect", "--json", str(bad))
    assert r.returncode == 1 and json.loads(r.stdout)["code"] == "tensor_hash_mismatch"
    assert spilld("inspect", "--no-verify", str(bad)).returncode == 0  # header alone is fine
    r = spilld("verify", str(DATA / "kv.spilld"), str(bad))
    assert r.returncode == 1 and "ok   " in r.stdout and "BAD  " in r.stdout
    assert spilld("verify", *map(str, sorted(DATA.glob("*.spilld")))).returncode == 0
    # a missing file is a failed check, and those after it are still checked (found in review: exit 2, none checked)
    r = spilld("verify", str(tmp_path / "nope.spilld"), str(DATA / "kv.spilld"), str(bad))
    assert r.returncode == 1 and "BAD  " + str(tmp_path / "nope.spilld") in r.stdout, r
    assert "ok   " + str(DATA / "kv.spilld") in r.stdout and "BAD  " + str(bad) in r.stdout


# --- one parser, one line, no traceback (issue 12, item 7) -----------------------------------------------


def place(root: Path, n: int = 1, src: Path = DATA / "kv.spilld") -> list[Path]:
    """Copies of a golden file where a store keeps them (its identity's and namespace's folders)."""
    from spilld.entries import identity_fingerprint, namespace_hash
    from spilld.loader import read_header

    ident = read_header(src).identity
    folder = root / identity_fingerprint(ident) / namespace_hash(ident.namespace)
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        shutil.copy(src, folder / f"{i:024x}.spilld")
        out.append(folder / f"{i:024x}.spilld")
    return out


def refusal_cases(tmp: Path) -> list[tuple[list[str], int]]:
    """(argv, exit code): inputs that once gave a traceback, or were accepted and then misbehaved."""
    f, sock = tmp / "file", str(tmp / "none.sock")
    f.write_text("x")
    long_sock = "/tmp/" + "s" * 110 + ".sock"
    daemon = ["--socket", str(tmp / "d.sock")]
    return [
        (["--dir", str(f), *daemon], 2),  # --dir naming a file
        (["--dir", str(f / "below"), *daemon], 2),  # a path below a file
        (["--dir", "/proc/x/y", *daemon], 2),
        (["--socket", str(f)], 2),  # a socket path that holds a file
        (["--socket", str(f / "s.sock")], 2),  # a socket below a file
        (["--socket", long_sock], 2),  # over sun_path
        (["status", "--socket", long_sock], 2),
        (["--drain-deadline", "-5", *daemon], 2),
        (["--drain-deadline", "nan", *daemon], 2),
        (["--drain-deadline", "inf", *daemon], 2),
        (["--drain-deadline", "0", *daemon], 2),
        (["--idle-timeout", "-1", *daemon], 2),
        (["--cap", "0", *daemon], 2),
        (["--cap", "0.5", *daemon], 2),
        (["--cap", "-1G", *daemon], 2),
        (["--disk-cap", "0", *daemon], 2),
        (["--cap", "99999999TB", *daemon], 2),
        (["service", "install", "--dry-run", "--manager", "systemd", "--drain-deadline", "-5"], 2),
        (["service", "install", "--dry-run", "--manager", "systemd", "--cap", "0"], 2),
        (["drain", "--socket", sock, "--timeout", "nan"], 2),
        (["evict", "--socket", sock, "--older-than", "-1d"], 2),
        (["evict", "--socket", sock, "--fingerprint", "nope"], 2),  # a typo evicted nothing, exit 0 (review)
        (["evict", "--socket", sock, "--fingerprint", "0123456789ABCDEF"], 2),  # spilld's folders are lower case
        (["evict", "--socket", sock, "--dir", str(tmp)], 2),  # no filter, no --all
        (["evict", "--socket", sock, "--dir", str(f), "--all"], 2),
        (["evict", "--socket", sock, "--dir", str(tmp / "missing"), "--all"], 2),  # never created
        (["ls", "--dir", str(f)], 2),
        (["inspect", str(tmp)], 2),  # a folder
        (["inspect", str(tmp / "missing.spilld")], 2),
        (["inspect", "/dev/null"], 2),  # not a regular file
        # (a FILE that cannot be opened is a failed check, exit 1, and the next is checked: see above)
        (["verify"], 2),
        (["verify", "--dir", str(f)], 2),
        (["status", "--socket", sock], 4),
        (["drain", "--socket", sock], 4),
        (["--socket", sock, "status"], 4),
        (["bogus"], 2),
        (["status", "--bogus"], 2),
    ]


def test_every_refusal_is_one_line_and_its_exit_code(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for argv, code in refusal_cases(tmp_path):
        got = cli.main(argv)
        err = capsys.readouterr().err
        assert (got, len(err.strip().splitlines())) == (code, 1), (argv, got, err)
        assert err.startswith("spilld"), (argv, err)
    assert not (tmp_path / "missing").exists() and not os.path.exists("/proc/x")


def test_a_bad_spilld_socket_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SPILLD_SOCKET", "/tmp/" + "s" * 120)
    assert cli.main(["status"]) == 2 and "SPILLD_SOCKET" in capsys.readouterr().err


def test_no_traceback_from_a_process(tmp_path: Path) -> None:
    """The same refusals as whole processes: one line on stderr, never a traceback."""
    (tmp_path / "file").write_text("x")
    for argv, code in [
        (["--dir", str(tmp_path / "file"), "--socket", str(tmp_path / "d.sock")], 2),
        (["inspect", str(tmp_path)], 2),
        (["--socket", str(tmp_path / "none.sock"), "status", "--json"], 4),
    ]:
        r = spilld(*argv)
        assert r.returncode == code and len(r.stderr.strip().splitlines()) == 1, (argv, r.stderr)


def test_a_relative_socket_is_served_from_the_current_folder(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "spilld", "--socket", "s.sock", "--dir", "store", "--log-format", "json"],
        cwd=tmp_path,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 30
        while not (tmp_path / "s.sock").exists() and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        r = spilld("status", "--json", "--socket", str(tmp_path / "s.sock"))
        assert r.returncode == 0, r.stderr
        st = json.loads(r.stdout)
        assert st["socket"] == str(tmp_path / "s.sock") and st["dir"] == str(tmp_path / "store")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    d = Daemon(new_root())
    os.makedirs(d.dir)
    place(Path(d.dir), 3)
    d.start()
    try:
        yield d
    finally:
        d.kill()
        cleanup(d.root)


def test_global_options_before_or_after_the_command(daemon: Daemon) -> None:
    before = spilld("--socket", daemon.socket, "status", "--json")
    after = spilld("status", "--json", "--socket", daemon.socket)
    assert before.returncode == after.returncode == 0, before.stderr + after.stderr
    assert json.loads(before.stdout)["pid"] == json.loads(after.stdout)["pid"]
    assert spilld(f"--socket={daemon.socket}", "status").returncode == 0


def test_status_json_without_a_daemon_is_an_object_and_exit_4(tmp_path: Path) -> None:
    r = spilld("status", "--json", "--socket", str(tmp_path / "none.sock"))
    d = json.loads(r.stdout)
    assert r.returncode == 4 and d["ok"] is False and d["code"] == "connection_lost"


def test_status_text_counts_other_clients_and_entries(daemon: Daemon) -> None:
    """The asking command is not one of the clients it reports (it said "1 client" with nobody else connected)."""
    r = spilld("status", "--socket", daemon.socket)
    assert r.returncode == 0 and "0 clients," in r.stdout and "3 entries" in r.stdout, r.stdout
    with socket.socket(socket.AF_UNIX) as other:
        other.connect(daemon.socket)
        r = spilld("status", "--socket", daemon.socket)
    assert r.returncode == 0 and "1 client," in r.stdout, r.stdout


def test_evict_refuses_a_folder_the_daemon_does_not_serve(daemon: Daemon, tmp_path: Path) -> None:
    other = tmp_path / "other"
    kept = place(other, 2)
    r = spilld("evict", "--all", "--socket", daemon.socket, "--dir", str(other))
    assert r.returncode == 2 and daemon.dir in r.stderr and str(other) in r.stderr
    assert all(p.exists() for p in kept)
    st = json.loads(spilld("status", "--json", "--socket", daemon.socket).stdout)
    assert st["store"]["entries"] == 3  # the daemon's folder was not touched either


def test_evict_of_another_folder_with_the_default_socket_evicts_that_folder_itself(
    daemon: Daemon, tmp_path: Path
) -> None:
    """Found in a walk-through of the README: with a daemon on the default socket serving its own folder, `evict --dir
    OTHER` was refused ("name its socket with --socket") though no daemon serves OTHER. With the default socket it
    evicts OTHER from the folder itself, under its lock; a --socket named still refuses (the test above)."""
    other = tmp_path / "other"
    kept = place(other, 2)
    env = os.environ | {"SPILLD_SOCKET": daemon.socket}
    r = subprocess.run(
        [sys.executable, "-m", "spilld", "evict", "--all", "--dir", str(other)],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip
    assert r.returncode == 0 and "evicted 2 entries" in r.stdout, r.stdout + r.stderr
    assert not any(p.exists() for p in kept)
    st = json.loads(spilld("status", "--json", "--socket", daemon.socket).stdout)
    assert st["store"]["entries"] == 3  # the daemon's own folder untouched


def test_evict_through_the_daemon_says_which_folder(daemon: Daemon) -> None:
    r = spilld("evict", "--all", "--socket", daemon.socket)  # no --dir: the daemon's own
    assert r.returncode == 0 and "evicted 3 entries" in r.stdout and daemon.dir in r.stdout, r.stdout + r.stderr
    assert "through the daemon" in r.stdout
    st = json.loads(spilld("status", "--json", "--socket", daemon.socket).stdout)
    assert st["store"]["entries"] == 0


def _log_lines(d: Daemon) -> list[dict[str, Any]]:
    return [json.loads(line) for line in d.read_log().splitlines() if line.startswith("{")]


def test_the_daemons_log_says_what_a_command_evicted_or_pinned_and_who_asked_it_to_stop(daemon: Daemon) -> None:
    """Found in review: `spilld evict --all` emptied the store, `spilld pin` changed what the disk cap evicts, and a
    client's shutdown request stopped the daemon, each without a line in its log (the command's connection is said at
    info only the first time its name connects): an operator could not tell where the cache had gone, or why the
    daemon had stopped."""
    path = next(Path(daemon.dir).rglob("*.spilld"))
    for argv in (["pin", str(path)], ["unpin", str(path)], ["evict", "--older-than", "1d"], ["evict", "--all"]):
        r = spilld(*argv, "--socket", daemon.socket)
        assert r.returncode == 0, (argv, r.stderr)
    said = [line["msg"] for line in _log_lines(daemon)]
    assert any(m.endswith(f"(spilld pin) pinned {path}") for m in said), said
    assert any(m.endswith(f"(spilld unpin) unpinned {path}") for m in said), said
    evicted = [line for line in _log_lines(daemon) if "(spilld evict) evicted" in line["msg"]]
    assert [(e["evicted"], e["older_than_s"]) for e in evicted] == [(0, 86400.0), (3, None)], evicted
    assert evicted[1]["bytes"] > 0
    from spilld.control import Control

    with Control(daemon.socket, name="a tool") as c:
        assert c.call("shutdown", {}) == {"stopping": True}
    assert daemon.stop() == 0
    assert any("(a tool) asked it to stop" in line["msg"] for line in _log_lines(daemon)), daemon.read_log()


def test_pin_finds_an_entry_named_through_a_link_or_from_inside_the_folder() -> None:
    """Found in review: with the daemon's --dir a symbolic link, `cd DIR/... && spilld pin F` of an entry `spilld ls`
    listed said "not an entry of the daemon's store" (exit 1): the current folder is spelled from the real folder,
    and the daemon knows its entries by its own spelling only. So was the entry named through the real folder."""
    d = Daemon(new_root())
    real = Path(d.root) / "real"
    (entry,) = place(real, 1)
    os.symlink(real, d.dir)
    d.start()
    try:
        listed = json.loads(spilld("ls", "--json", "--dir", d.dir).stdout)[0]["path"]
        assert listed == os.path.join(d.dir, os.path.relpath(entry, real))
        r = spilld("pin", "--socket", d.socket, str(entry))  # through the real folder
        assert r.returncode == 0 and r.stdout.strip() == f"pinned {listed}", r
        r = subprocess.run(
            [sys.executable, "-m", "spilld", "unpin", "--socket", d.socket, entry.name],
            capture_output=True, text=True, timeout=120, cwd=os.path.dirname(listed),
            env=os.environ | {"PYTHONPATH": str(Path(__file__).parent.parent)},  # this checkout's spilld, from there
        )  # fmt: skip
        assert r.returncode == 0 and r.stdout.strip() == f"unpinned {listed}", r
        r = spilld("pin", "--socket", d.socket, str(Path(d.root) / "elsewhere.spilld"))  # outside it: as before
        assert r.returncode == 1 and "not an entry of the daemon's store" in r.stderr, r
    finally:
        d.kill()
        cleanup(d.root)


def test_evict_from_a_folder_without_a_daemon(tmp_path: Path) -> None:
    files = place(tmp_path / "store", 1)
    sock = str(tmp_path / "none.sock")
    r = spilld("evict", "--older-than", "1d", "--socket", sock, "--dir", str(tmp_path / "store"))
    assert r.returncode == 0 and "evicted 0 entries" in r.stdout and files[0].exists()
    r = spilld("evict", "--all", "--json", "--socket", sock, "--dir", str(tmp_path / "store"))
    out = json.loads(r.stdout)
    assert out["evicted"] == 1 and not out["through_daemon"] and out["dir"] == str(tmp_path / "store")
    assert not files[0].exists() and os.listdir(tmp_path / "store") == [LOCK_NAME]  # emptied model folders go too


def _tree(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


def test_evict_refuses_a_folder_that_is_not_a_store_and_touches_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found in review: `evict --all --dir` on a user's folder (no daemon) made `.spilld.lock` there and removed
    the user's empty folders that happened to be named like a model's. `ls` and `verify` only read: they change
    nothing there either."""
    user = tmp_path / "U"
    (user / "docs").mkdir(parents=True)
    (user / "0123456789abcdef" / "base").mkdir(parents=True)
    (user / "notes.txt").write_text("hi")
    before, sock = _tree(user), str(tmp_path / "none.sock")
    for argv in (["evict", "--all"], ["evict", "--quarantine"], ["evict", "--older-than", "1d"]):
        assert cli.main([*argv, "--dir", str(user), "--socket", sock]) == cli.EXIT_USAGE, argv
        err = capsys.readouterr().err
        assert "is not a spilld store" in err and len(err.strip().splitlines()) == 1, (argv, err)
        assert _tree(user) == before, argv
    for argv in (["ls"], ["ls", "--quarantine"]):
        assert cli.main([*argv, "--dir", str(user)]) == 0, argv
        assert _tree(user) == before, argv
    # found in a walk-through of the README: verify passed such a folder, "0 entries checked, 0 bad" (a typo'd --dir)
    assert cli.main(["verify", "--quiet", "--dir", str(user)]) == cli.EXIT_USAGE
    assert "is not a spilld store" in capsys.readouterr().err and _tree(user) == before
    place(user, 1)  # entries (copied in, no lock yet): a store, evicted from
    assert cli.main(["evict", "--all", "--dir", str(user), "--socket", sock]) == 0


def test_tinymodel_module_writes_the_model_and_prints_its_path(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "spilld.tinymodel", str(tmp_path / "tiny")], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0 and r.stdout.strip() == str(tmp_path / "tiny"), r.stderr
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(os.listdir(tmp_path / "tiny"))
    (tmp_path / "file").write_text("x")
    r = subprocess.run(
        [sys.executable, "-m", "spilld.tinymodel", str(tmp_path / "file")], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert subprocess.run([sys.executable, "-m", "spilld.tinymodel"], capture_output=True).returncode == 2


def test_license_is_the_mit_license_pyproject_names() -> None:
    root = Path(__file__).resolve().parent.parent
    text = (root / "LICENSE").read_text()
    assert text.startswith("MIT License") and "spilld contributors" in text
    assert 'license = { text = "MIT" }' in (root / "pyproject.toml").read_text()


# --- the store as a whole: verify --dir, the quarantine, progress (issue 12, item 9) -----------------------


def corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def test_verify_dir_checks_every_entry_of_a_store(tmp_path: Path) -> None:
    root = tmp_path / "store"
    files = place(root, 3)
    assert spilld("verify", "--dir", str(root)).returncode == 0
    corrupt(files[0])
    other = root / "0123456789abcdef" / "base"  # a good file in the folder of another identity
    other.mkdir(parents=True)
    shutil.copy(files[1], other / "x.spilld")
    r = spilld("verify", "--dir", str(root))
    assert r.returncode == 1 and r.stdout.count("BAD  ") == 2, r.stdout
    assert "tensor_hash_mismatch" in r.stdout and "another identity" in r.stdout
    assert "4 entries" in r.stdout and "2 bad" in r.stdout
    assert r.stderr == ""  # no progress line when stderr is not a terminal


def test_verify_names_the_bad_block_of_a_manifest(tmp_path: Path) -> None:
    """Found in review: a manifest whose block had a flipped byte was reported as the manifest's own fault, the
    block file never named."""
    import asyncio

    from mlx_lm.models.cache import KVCache

    import spilld as sd
    from spilld.store import Store
    from tests.caches import fill

    root = tmp_path / "store"
    store = Store(root, block_tokens=16, durability="none")
    asyncio.run(store.put(list(range(40)), [fill(KVCache(), 40)], sd.Identity("m")))
    (entry,) = store.entries
    block = sorted(b.path for b in store.blocks)[0]
    corrupt(Path(block))
    for args in (["verify", entry.path], ["verify", "--dir", str(root)]):
        r = spilld(*args)
        assert r.returncode == 1 and f"in its block {block}" in r.stdout and "tensor_hash_mismatch" in r.stdout, r
    # inspect shows the manifest's header, its blocks said, then the block's error (it showed nothing but the error)
    r = spilld("inspect", entry.path)
    assert r.returncode == 1 and "tokens       40" in r.stdout and "blocks       2 of 16" in r.stdout, r
    assert block in r.stderr and "tensor_hash_mismatch" in r.stderr, r.stderr
    got = json.loads(spilld("inspect", "--json", entry.path).stdout)
    assert got["ok"] is False and got["code"] == "tensor_hash_mismatch" and len(got["header"]["tokens"]) == 40


def test_verify_dir_checks_the_stores_own_files_and_never_follows_a_link(tmp_path: Path) -> None:
    """Found in review: the scan and ls skip a symbolic link named like an entry (it is not spilld's), but verify
    --dir followed it: a user's link to their own file was reported bad, one to an entry elsewhere checked as ours."""
    root = tmp_path / "store"
    (kept,) = place(root, 1)
    (kept.parent / "mine.spilld").symlink_to(tmp_path / "notes.txt")
    (tmp_path / "notes.txt").write_text("a user's file")
    r = spilld("verify", "--dir", str(root))
    assert r.returncode == 0 and "1 entry" in r.stdout and "BAD" not in r.stdout, r.stdout


def test_verify_dir_refuses_a_block_swapped_for_a_link_as_the_store_does(tmp_path: Path) -> None:
    """Found in review: verify --dir read a manifest's blocks with the default file layer, so a block that someone
    replaced by a link to a copy elsewhere was checked through it and the entry said good, where the store's own
    reads (restore, scrub, scan: ``fileio.OWN_OPS``) refuse it. It is bad there too; the file it points at is left
    as it is."""
    import asyncio

    from mlx_lm.models.cache import KVCache

    import spilld as sd
    from spilld.store import Store
    from tests.caches import fill

    root, theirs = tmp_path / "store", tmp_path / "theirs"
    store = Store(root, block_tokens=16, durability="none")
    asyncio.run(store.put(list(range(40)), [fill(KVCache(), 40)], sd.Identity("m")))
    store.close()
    block = Path(sorted(b.path for b in store.blocks)[0])
    theirs.mkdir()
    shutil.copyfile(block, theirs / block.name)  # the same bytes: only the link itself is wrong
    block.unlink()
    block.symlink_to(theirs / block.name)
    r = spilld("verify", "--dir", str(root))
    assert r.returncode == 1 and f"in its block {block}" in r.stdout and "1 bad" in r.stdout, r.stdout
    assert block.is_symlink() and os.listdir(theirs) == [block.name]


def test_verify_dir_of_a_live_store_says_an_entry_evicted_during_the_check_is_gone_not_bad(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found in review: ``verify --dir`` on a store a daemon serves reported an entry as bad when the daemon evicted
    it during the check (its manifest gone before it was read, or its blocks gone after): a false alarm, exit 1.
    Each race is made certain here by evicting through the real daemon from a hook at that point of the check. Such
    an entry is said gone and counted apart; a block removed while its manifest stays is still bad."""
    import asyncio

    from mlx_lm.models.cache import KVCache

    import spilld as sd
    from spilld import loader
    from spilld.entries import identity_fingerprint
    from spilld.store import Store
    from tests.caches import fill

    d = Daemon(new_root(), ["--block-tokens", "16", "--scrub-rate", "0", "--warm-bytes", "0"])
    try:
        store = Store(d.dir, block_tokens=16, durability="none")
        idents = {name: sd.Identity(name) for name in ("listed", "half_read", "kept")}
        for i, ident in enumerate(idents.values()):
            asyncio.run(store.put(list(range(i, i + 40)), [fill(KVCache(), 40)], ident))
        store.close()
        fps = {name: identity_fingerprint(ident) for name, ident in idents.items()}
        manifest = {name: next(e.path for e in store.entries if e.fingerprint == fp) for name, fp in fps.items()}
        d.start()

        def evict(name: str) -> None:
            r = d.cli("evict", "--fingerprint", fps[name], "--socket", d.socket)
            assert r.returncode == 0 and "evicted 1 entry" in r.stdout, r

        real, done = loader._verify_one, set()

        def racing(p: str, ops: Any) -> Any:
            """Evict "listed" just before its manifest is read, "half_read" once its manifest is read and before its
            first block is."""
            if p == manifest["listed"] and "listed" not in done:
                done.add("listed")
                evict("listed")
            if p.endswith(".spilld-block") and os.path.dirname(p) == os.path.dirname(manifest["half_read"]):
                if "half_read" not in done:
                    done.add("half_read")
                    evict("half_read")
            return real(p, ops)

        monkeypatch.setattr(loader, "_verify_one", racing)
        capsys.readouterr()
        assert cli.main(["verify", "--quiet", "--dir", d.dir]) == cli.EXIT_OK
        out = capsys.readouterr().out
        assert done == {"listed", "half_read"} and "BAD" not in out, out
        assert "3 entries" in out and "0 bad, 2 evicted during the check" in out, out
        assert f"gone {manifest['listed']}" in out and f"gone {manifest['half_read']}" in out, out
        # a block missing while its manifest is still there, naming it: bad, as before
        monkeypatch.setattr(loader, "_verify_one", real)
        kept_dir = os.path.dirname(manifest["kept"])
        os.unlink(next(os.path.join(kept_dir, n) for n in sorted(os.listdir(kept_dir)) if n.endswith("-block")))
        assert cli.main(["verify", "--quiet", "--dir", d.dir]) == cli.EXIT_BAD_FILE
        out = capsys.readouterr().out
        assert f"BAD  {manifest['kept']}" in out and "1 bad" in out and "evicted" not in out, out
    finally:
        d.kill()
        cleanup(d.root)


def test_verify_of_files_named_says_one_removed_during_the_check_is_gone_not_bad(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found in review: ``verify FILE...`` called a file bad (``open failed: No such file or directory
    [io_error]``, exit 1) when it was removed between the command's look at it and its check, as a daemon's
    eviction does; only ``--dir`` said such a file gone. Named one by one, it is said gone too, and does not fail the
    check (exit 0, as ``--dir``). The races are made certain through the file layer the check reads with: the file
    removed as it is opened, and a manifest removed with its blocks once it is read (as an eviction unlinks them). A
    name that is not there when verify starts is still a failed check (a typo must not pass), and so is a block
    missing while its manifest stays."""
    import asyncio

    from mlx_lm.models.cache import KVCache

    import spilld as sd
    from spilld import fileio
    from spilld.entries import identity_fingerprint
    from spilld.store import Store
    from tests.caches import fill

    single = tmp_path / "single.spilld"
    shutil.copy(DATA / "kv.spilld", single)
    root = tmp_path / "store"
    store = Store(root, block_tokens=16, durability="none")
    for name in ("evicted", "kept"):
        asyncio.run(store.put(list(range(40)), [fill(KVCache(), 40)], sd.Identity(name)))
    store.close()
    names = {identity_fingerprint(sd.Identity(name)): name for name in ("evicted", "kept")}
    manifest = {names[e.fingerprint]: e.path for e in store.entries}
    blocks_of = {m: sorted(str(p) for p in Path(f).parent.glob("*.spilld-block")) for m, f in manifest.items()}
    real_open = fileio.DEFAULT_OPS.open_read

    def evicting(p: str) -> int:
        if p == str(single) and single.exists():  # removed between verify's look at it and its opening
            single.unlink()
        if p in blocks_of["evicted"] and os.path.exists(manifest["evicted"]):  # its manifest read: the entry goes
            for f in [manifest["evicted"], *blocks_of["evicted"]]:
                os.unlink(f)
        return real_open(p)

    monkeypatch.setattr(fileio.DEFAULT_OPS, "open_read", evicting)
    capsys.readouterr()
    assert cli.main(["verify", str(single), manifest["evicted"], manifest["kept"]]) == cli.EXIT_OK
    out = capsys.readouterr().out
    assert "BAD" not in out and f"ok   {manifest['kept']}" in out, out
    assert f"gone {single}: removed during the check" in out and f"gone {manifest['evicted']}" in out, out
    # not there from the start: a failed check, as before; a block missing under a manifest still there: bad
    os.unlink(blocks_of["kept"][0])
    assert cli.main(["verify", str(tmp_path / "nope.spilld"), manifest["kept"]]) == cli.EXIT_BAD_FILE
    out = capsys.readouterr().out
    assert f"BAD  {tmp_path / 'nope.spilld'}" in out and f"BAD  {manifest['kept']}" in out and "gone" not in out, out


def test_progress_shows_on_a_terminal_only(tmp_path: Path) -> None:
    import pty

    place(tmp_path / "store", 2)
    main, sub = pty.openpty()
    try:
        r = subprocess.run(
            [sys.executable, "-m", "spilld", "verify", "--dir", str(tmp_path / "store")],
            stdout=subprocess.PIPE,
            stderr=sub,
            timeout=120,
        )
        os.close(sub)
        shown = os.read(main, 65536).decode()
    finally:
        os.close(main)
    assert r.returncode == 0 and "verifying" in shown and "2 items" in shown and "left" in shown, shown


def test_quarantine_is_capped_listed_and_evicted(tmp_path: Path) -> None:
    from spilld import errors
    from spilld.store import QUARANTINE, Store

    root = tmp_path / "store"
    store = Store(str(root))
    store.quarantine_cap = 2500
    for name in ("a", "b", "c"):  # moved in this order: a is the oldest
        (root / f"{name}.spilld").write_bytes(b"x" * 1000)
        store.quarantine(str(root / f"{name}.spilld"), errors.HeaderMalformed("test"))
    kept = sorted(os.listdir(root / QUARANTINE))
    assert len(kept) == 2 and not any(k.endswith("-a.spilld") for k in kept)  # the oldest went
    assert store.counters.quarantined == 3 and store.stats()["quarantine_removed"] == 1
    r = spilld("ls", "--quarantine", "--dir", str(root))
    assert r.returncode == 0 and "2 quarantined files" in r.stdout and kept[0] in r.stdout, r.stdout
    rows = json.loads(spilld("ls", "--quarantine", "--json", "--dir", str(root)).stdout)
    assert [row["bytes"] for row in rows] == [1000, 1000]
    r = spilld("evict", "--quarantine", "--socket", str(tmp_path / "none.sock"), "--dir", str(root))
    assert r.returncode == 0 and "removed 2 quarantined files" in r.stdout, r.stdout + r.stderr
    assert os.listdir(root / QUARANTINE) == []


def test_singular_and_plural() -> None:
    assert cli.plural(1, "entry", "entries") == "1 entry" and cli.plural(2, "entry", "entries") == "2 entries"
    assert cli.plural(1, "client") == "1 client" and cli.plural(0, "client") == "0 clients"


def test_ls_says_1_entry(tmp_path: Path) -> None:
    place(tmp_path / "store", 1)
    r = spilld("ls", "--dir", str(tmp_path / "store"))
    assert r.returncode == 0 and "1 entry," in r.stdout, r.stdout


def test_evict_refuses_a_folder_a_daemon_on_another_socket_serves(daemon: Daemon, tmp_path: Path) -> None:
    r = spilld("evict", "--all", "--socket", str(tmp_path / "other.sock"), "--dir", daemon.dir)
    assert r.returncode == 5 and f"pid {daemon.proc.pid if daemon.proc else 0}" in r.stderr, r.stderr
    st = json.loads(spilld("status", "--json", "--socket", daemon.socket).stdout)
    assert st["store"]["entries"] == 3


def test_evict_through_the_daemon_shows_progress_on_a_terminal(daemon: Daemon) -> None:
    import pty

    main, sub = pty.openpty()
    try:
        r = subprocess.run(
            [sys.executable, "-m", "spilld", "evict", "--all", "--socket", daemon.socket],
            stdout=subprocess.PIPE,
            stderr=sub,
            timeout=120,
        )
        os.close(sub)
        shown = os.read(main, 65536).decode()
    finally:
        os.close(main)
    assert r.returncode == 0 and b"evicted 3 entries" in r.stdout
    assert f"evicting from {daemon.dir}: 3 items" in shown, shown


def test_status_text_shows_the_stores_misses_beside_the_shared_tiers(
    daemon: Daemon, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found in review: with --remote, the lookups line printed the shared tier's misses as the store's; and a
    reason named in both of the shared tier's counts (bad_bytes) showed only the fills' count."""
    from spilld.cli.running import _print_status

    st = json.loads(spilld("status", "--json", "--socket", daemon.socket).stdout)
    st["store"]["misses"] = {"no_entry": 3}
    st["remote"] = {
        "state": "open", "push": "all",
        "misses": {"down": 2, "bad_bytes": 5}, "fill_misses": {"no_root": 1, "bad_bytes": 1},
    }  # fmt: skip
    _print_status(st)
    out = capsys.readouterr().out
    assert (
        "misses: no_entry 3" in out and "misses: down 2, bad_bytes 5; fills not done: no_root 1, bad_bytes 1" in out
    ), out


def test_evict_without_a_daemon_from_a_folder_it_cannot_lock_is_a_usage_error(tmp_path: Path) -> None:
    """Found in review: exit 7 ('the daemon answered with an error'), where no daemon was involved."""
    root = tmp_path / "store"
    (root / ".spilld.lock").mkdir(parents=True)  # the lock file cannot be opened
    r = spilld("evict", "--all", "--dir", str(root), "--socket", str(tmp_path / "none.sock"))
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "cannot evict" in r.stderr, r.stderr


def test_a_socket_in_use_is_refused_before_the_store_folder_is_touched(daemon: Daemon, tmp_path: Path) -> None:
    """Found in review: the daemon took and scanned its folder before it looked at its socket, so a refusal for a
    socket in use came after the scan (a long wait on a big store), and left a new folder and its lock behind."""
    fresh = tmp_path / "fresh"
    r = spilld("serve", "--dir", str(fresh), "--socket", daemon.socket, "--cap", "64MiB")
    assert r.returncode == 5 and "in use by another spilld" in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    assert not fresh.exists()


def test_verify_and_ls_say_so_of_a_folder_they_cannot_list(
    tmp_path: Path, refuse_listing: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found in review: a model folder that could not be listed was skipped in silence: verify said '0 entries,
    0 bad' and exited 0."""
    folder = place(tmp_path / "store", 2)[0].parent
    refuse_listing(folder, PermissionError(13, "Permission denied", str(folder)))
    assert cli.main(["verify", "--dir", str(tmp_path / "store")]) == cli.EXIT_BAD_FILE
    out = capsys.readouterr().out
    assert f"BAD  {folder}: a folder of the store that cannot be listed" in out and "1 bad" in out, out
    assert cli.main(["ls", "--dir", str(tmp_path / "store")]) == 0
    assert f"{folder}: cannot be listed" in capsys.readouterr().err


def test_an_empty_folder_path_is_refused_never_the_default_in_its_place(tmp_path: Path) -> None:
    """Found in review: `--dir ''` (an unset variable in a unit) served, and made, the default folder."""
    env = {**os.environ, "HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    for args in (["--socket", str(tmp_path / "s.sock"), "--dir", ""], ["ls", "--dir", ""], ["verify", "--dir", " "]):
        r = subprocess.run([sys.executable, "-m", "spilld", *args], capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode == 2 and "empty path" in r.stderr, (args, r.stderr)
    assert os.listdir(tmp_path) == []  # no default folder made


def test_an_empty_remote_option_is_refused_never_taken_as_not_given(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: `--remote-key-file "$KEYFILE"` with KEYFILE unset was taken as not given, and the shared
    tier ran unencrypted; `--remote ""` and `--remote-password-file ""` were dropped the same way."""
    from spilld import daemon
    from spilld.config import Config

    served: list[Config] = []  # a daemon the command would have run (never started here)
    monkeypatch.setattr(daemon, "run", lambda cfg: served.append(cfg) or 0)
    monkeypatch.setattr(daemon, "setup_logging", lambda *a: None)
    sock, url = ["--socket", str(tmp_path / "s.sock"), "--dir", str(tmp_path / "d")], "redis://127.0.0.1:1/0"
    for given in (["--remote", ""], ["--remote", url, "--remote-key-file", ""], ["--remote", url,
                  "--remote-password-file", " "], ["--remote", url, "--remote-host-name", ""]):  # fmt: skip
        assert cli.main([*given, *sock]) == cli.EXIT_USAGE, (given, served)
        err = capsys.readouterr().err
        assert "empty" in err and len(err.strip().splitlines()) == 1, (given, err)
    for name in ("remote", "remote_key_file", "remote_password_file", "remote_host_name"):  # the API's way in, too
        with pytest.raises(ValueError, match="empty"):
            Config(socket=str(tmp_path / "s.sock"), **{"remote": url, name: ""})  # type: ignore[arg-type]
    assert not (tmp_path / "d").exists()


def test_ls_on_a_machine_where_no_daemon_ran_lists_nothing(tmp_path: Path) -> None:
    """Found in review: `spilld ls` with the default folder not made yet failed (exit 2, 'No such file')."""
    env = {**os.environ, "HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    r = subprocess.run([sys.executable, "-m", "spilld", "ls"], capture_output=True, text=True, env=env, timeout=60)
    assert r.returncode == 0 and "0 entries" in r.stdout, (r.stdout, r.stderr)
    assert os.listdir(tmp_path) == []


# --- the exit codes no other test reaches (found in review: README promised them, nothing checked them) ----------


def test_a_daemons_error_answer_exits_7_with_its_code() -> None:
    """A path longer than the daemon takes (``MAX_TEXT_CHARS``): the daemon answers ``bad_params``."""
    d = Daemon(new_root(), ["--cap", "16MiB"]).start()
    try:
        r = spilld("pin", "--socket", d.socket, "/" + "p" * 5000)
        assert r.returncode == cli.EXIT_DAEMON_ERROR == 7 and "[bad_params]" in r.stderr, r.stderr
    finally:
        d.kill()
        cleanup(d.root)


@pytest.mark.parametrize(
    "reply",
    [
        b"HTTP/1.1 400 Bad Request\r\nContent-Type: text/plain\r\n\r\n",  # read as a frame's length: too large
        b"\x03\x00\x00\x00\x00\x00\x00\x00\xc1\xc1\xc1",  # a frame of a byte msgpack never uses
    ],
)
def test_a_socket_served_by_something_else_is_not_a_daemon_exit_4(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], reply: bytes
) -> None:
    """Found in review: a --socket served by something that is not spilld (docker.sock answers HTTP) gave
    "message of 1347703880 bytes (limit 4194304) [frame_too_large]" and exit 7, "the daemon refused"."""
    import socket
    import threading

    path = str(tmp_path / "other.sock")
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(8)

    def answer() -> None:  # every connection: whatever it sends, one reply that is not spilld's, then closed
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(reply)

    threading.Thread(target=answer, daemon=True).start()
    try:
        for argv in (
            ["status"],
            ["drain", "--timeout", "5"],
            ["pin", str(tmp_path / "x.spilld")],
            ["status", "--json"],
        ):
            assert cli.main([*argv, "--socket", path]) == cli.EXIT_UNREACHABLE == 4, argv
            out, err = capsys.readouterr()
            said = json.loads(out)["error"] if "--json" in argv else err
            assert f"not a spilld daemon at {path}" in said and len(err.strip().splitlines()) <= 1, (argv, out, err)
        store = tmp_path / "store"
        store.mkdir()
        (store / LOCK_NAME).write_text("")  # a store: evict works on it as where no daemon answers
        assert cli.main(["evict", "--all", "--dir", str(store), "--socket", path]) == 0
        assert "no daemon serves it" in capsys.readouterr().out
    finally:
        server.close()


class FakeDaemon:
    """A socket that takes connections, answers the hello only when ``hello``, and never anything else (a daemon
    hung or stopped with SIGSTOP, seen from a command); the requests it got are kept."""

    def __init__(self, path: str, hello: bool) -> None:
        import socket
        import threading

        self.hello, self.requests = hello, []  # type: ignore[var-annotated]
        self.server = socket.socket(socket.AF_UNIX)
        self.server.bind(path)
        self.server.listen(8)
        self.conns: list[Any] = []
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        from spilld import protocol as P

        while True:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            self.conns.append(conn)  # held open, never answered past the hello
            decoder = P.FrameDecoder()
            while (data := conn.recv(65536)) and not any(m.method == "drain" for m in self.requests):
                for msg in decoder.feed(data):
                    self.requests.append(msg)
                    if msg.method == "hello" and self.hello:
                        conn.sendall(b"".join(bytes(b) for b in P.response(msg.msgid, {"dir": "/nowhere"})))

    def close(self) -> None:
        self.server.close()
        for conn in self.conns:
            conn.close()


def test_drain_bounds_the_hello_by_its_timeout_alone_and_exits_4_when_it_is_never_answered(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: `drain --timeout 2` against a hung daemon took 7 s (the answer's grace bounded the hello
    too) and exited 3, where `status` exits 4 (the daemon cannot be reached). The hello gets --timeout alone; the
    grace is the drain's answer's only."""
    from spilld.cli import running

    silent = FakeDaemon(str(tmp_path / "hung.sock"), hello=False)
    try:
        t0 = time.monotonic()
        assert cli.main(["drain", "--timeout", "1", "--socket", str(tmp_path / "hung.sock")]) == cli.EXIT_UNREACHABLE
        took = time.monotonic() - t0
        assert "no answer from spilld" in capsys.readouterr().err
        assert took < 1 + running.ANSWER_GRACE_S / 2, took  # --timeout, not --timeout + the grace
        assert not any(m.method == "drain" for m in silent.requests)
    finally:
        silent.close()
    monkeypatch.setattr(running, "ANSWER_GRACE_S", 0.5)  # answered hello, then silence: the grace, exit 3
    answered = FakeDaemon(str(tmp_path / "stuck.sock"), hello=True)
    try:
        t0 = time.monotonic()
        assert cli.main(["drain", "--timeout", "1", "--socket", str(tmp_path / "stuck.sock")]) == cli.EXIT_TIMEOUT
        assert 1.4 < time.monotonic() - t0 < 4 and "did not answer within" in capsys.readouterr().out
        drain = [m for m in answered.requests if m.method == "drain"]
        assert len(drain) == 1 and drain[0].params["timeout"] <= 1, drain  # what is left of --timeout
    finally:
        answered.close()


def test_ctrl_c_exits_130_and_a_closed_pipe_141(tmp_path: Any) -> None:
    import socket

    silent = socket.socket(socket.AF_UNIX)  # takes the connection, never answers: the command waits
    silent.bind(str(tmp_path / "s.sock"))
    silent.listen(1)
    try:
        proc = subprocess.Popen(
            [sys.executable, "-m", "spilld", "status", "--socket", str(tmp_path / "s.sock")],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        conn, _ = silent.accept()  # it has connected, and waits for the hello's answer
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        conn.close()
        assert proc.returncode == cli.EXIT_INTERRUPTED == 130 and "interrupted" in err, err
    finally:
        silent.close()
    proc = subprocess.Popen(
        [sys.executable, "-m", "spilld", "inspect", "--json", str(DATA / "kv.spilld")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    proc.stdout.close()  # the reader went away before a byte was written
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == cli.EXIT_BROKEN_PIPE == 141 and b"Traceback" not in err, err


def test_an_internal_error_exits_70_and_shows_its_traceback_only_when_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    from spilld.cli import parser as parser_module

    def broken(args: argparse.Namespace) -> int:
        raise ValueError("a bug")

    monkeypatch.setattr(parser_module, "cmd_inspect", broken)
    monkeypatch.delenv("SPILLD_DEBUG", raising=False)
    assert cli.main(["inspect", str(DATA / "kv.spilld")]) == cli.EXIT_INTERNAL == 70
    monkeypatch.setenv("SPILLD_DEBUG", "1")
    with pytest.raises(ValueError, match="a bug"):
        cli.main(["inspect", str(DATA / "kv.spilld")])


def test_ls_prints_a_file_time_past_the_calendar_as_its_number(tmp_path: Path) -> None:
    """Found in review: ``ls`` (and ``ls --quarantine``) failed with an internal error on a file whose time was
    past the year 9999 (tmpfs allows it); such a time is printed as its raw number."""
    from spilld.cli import files

    assert files._local_minute(99_999_999_999_999) == "@99999999999999"
    assert files._local_minute(0).startswith(("1970-01-01", "1969-12-31"))
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK):  # where the kernel keeps such a time: the command as a whole
        root = Path(tempfile.mkdtemp(dir=shm))
        try:
            place(root, 1)
            for p in root.rglob("*.spilld"):
                os.utime(p, (99_999_999_999_999, 99_999_999_999_999))
            r = spilld("ls", "--dir", str(root))
            assert r.returncode == 0 and "1 entry," in r.stdout, r.stdout + r.stderr
        finally:
            shutil.rmtree(root)
