"""Service managers: the plist and units, sd_notify, socket activation with a real fd, install/uninstall."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import json
import os
import plistlib
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from spilld import cli
from spilld.service import activation, install, units
from spilld.service.sdnotify import Notifier, notify_address, watchdog_interval
from spilld.service.units import ServiceSpec
from tests.daemons import cleanup, new_root

ROOT = Path(__file__).resolve().parent.parent

# --- launchd plist ----------------------------------------------------------------------------


def check_plist(job: dict[str, Any], home: str, deadline: float) -> None:
    assert job["Label"] == units.LABEL and job["RunAtLoad"] is True
    assert job["KeepAlive"] == {"SuccessfulExit": False}
    assert job["ExitTimeOut"] > deadline
    assert "EnableTransactions" not in job
    assert job["ProcessType"] in ("Background", "Adaptive")
    argv = job["ProgramArguments"]
    assert os.path.isabs(argv[0]) and argv[argv.index("--cap") + 1]
    assert float(argv[argv.index("--drain-deadline") + 1]) == deadline
    for key in ("StandardOutPath", "StandardErrorPath"):
        assert job[key].startswith(f"{home}/Library/Logs/spilld/")


def test_plist_holds_the_launchd_keys(tmp_path: Path) -> None:
    spec = ServiceSpec(cap="2GiB", drain_deadline=45)
    job = plistlib.loads(units.launchd_plist(spec, tmp_path).encode())
    check_plist(job, str(tmp_path), 45)
    assert job["ProgramArguments"][-5:] == ["serve", "--cap", "2GiB", "--drain-deadline", "45"]
    sock = job["Sockets"][units.LAUNCHD_SOCKET_KEY]
    assert sock["SockPathMode"] == 0o600 == 384 and sock["SockType"] == "stream"
    assert sock["SockPathName"] == f"{tmp_path}/Library/Application Support/spilld/spilld.sock"
    plain = plistlib.loads(units.launchd_plist(ServiceSpec(socket_activation=False), tmp_path).encode())
    assert "Sockets" not in plain


def test_deploy_files_are_the_rendered_examples() -> None:
    for rel, text in units.examples().items():
        assert (ROOT / "deploy" / rel).read_text() == text, f"deploy/{rel}: run python -m spilld.service.units deploy"
    job = plistlib.loads((ROOT / "deploy" / "launchd" / units.PLIST_NAME).read_bytes())
    check_plist(job, "/Users/you", 60)


# --- systemd units ----------------------------------------------------------------------------


def analyze(folder: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("systemd-analyze")
    if exe is None:
        pytest.skip("systemd-analyze is not installed")
    run = folder / "run"
    run.mkdir(mode=0o700, exist_ok=True)
    env = {**os.environ, "XDG_RUNTIME_DIR": str(run)}  # a user manager needs one, even a pretend one
    names = [str(p) for p in sorted(folder.glob("spilld.*"))]
    r = subprocess.run([exe, "verify", "--user", *names], capture_output=True, text=True, env=env, timeout=120)
    if "Failed to initialize manager" in r.stderr or "Failed to lookup RuntimeDirectory" in r.stderr:
        pytest.skip(f"systemd-analyze --user cannot run here: {r.stderr.strip()}")
    return r


@pytest.mark.parametrize(
    "spec",
    [
        ServiceSpec(),
        ServiceSpec(socket_activation=False, drain_deadline=200),
        ServiceSpec(cap="1GB", dir="/tmp/a dir/%h$X", socket="/tmp/odd name/s%1.sock"),
    ],
    ids=["activated", "self-bound", "odd-paths"],
)
def test_units_pass_systemd_analyze_verify(tmp_path: Path, spec: ServiceSpec) -> None:
    assert os.access(spec.command[0], os.X_OK)  # verify checks that ExecStart exists
    (tmp_path / units.SERVICE_NAME).write_text(units.systemd_service(spec))
    if spec.socket_activation:
        (tmp_path / units.SOCKET_NAME).write_text(units.systemd_socket(spec))
    r = analyze(tmp_path)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr  # unknown keys are only warnings: none allowed
    text = units.systemd_service(spec)
    for line in ("Type=notify", "NotifyAccess=main", "Restart=on-failure", "KillSignal=SIGTERM", "WatchdogSec="):
        assert line in text
    stop = int(text.split("TimeoutStopSec=")[1].split("s")[0])
    assert stop > spec.drain_deadline and f"--cap {spec.cap}" in text
    assert ("Requires=spilld.socket" in text) == spec.socket_activation


def test_verify_catches_a_broken_unit(tmp_path: Path) -> None:
    spec = ServiceSpec(command=(str(tmp_path / "no-such-spilld"),), socket_activation=False)
    (tmp_path / units.SERVICE_NAME).write_text(units.systemd_service(spec))
    assert analyze(tmp_path).returncode != 0  # so the passing runs above mean something


def test_socket_unit() -> None:
    text = units.systemd_socket(ServiceSpec())
    for line in ("ListenStream=%t/spilld/spilld.sock", "SocketMode=0600", "DirectoryMode=0700"):
        assert line in text
    assert "ListenStream=/run/x%%y.sock" in units.systemd_socket(ServiceSpec(socket="/run/x%y.sock"))


# --- sd_notify ----------------------------------------------------------------------------------


def receiver(address: str) -> socket.socket:
    r = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    r.bind(address)
    r.settimeout(5.0)
    return r


def recv_all(
    r: socket.socket, until: Callable[[list[str]], bool], timeout: float, alive: Callable[[], str] | None = None
) -> list[str]:
    """Datagrams received until ``until(messages)`` holds; fails the test at the timeout, or at once when
    ``alive`` says (with a reason) that the sender is gone."""
    got: list[str] = []
    deadline = time.monotonic() + timeout
    while not until(got):
        left = deadline - time.monotonic()
        assert left > 0, f"timed out; received {got}"
        assert alive is None or not (why := alive()), f"{why}; received {got}"
        r.settimeout(min(left, 0.5))
        try:
            got.append(r.recv(4096).decode())
        except TimeoutError:
            continue
    return got


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_sd_notify_messages(tmp_path: Path, abstract: bool) -> None:
    name = f"@spilld-test-{os.getpid()}" if abstract else str(tmp_path / "notify")
    r = receiver("\0" + name[1:] if abstract else name)
    n = Notifier(notify_address({"NOTIFY_SOCKET": name}))
    try:
        assert n.ready("serving") and n.watchdog() and n.extend_timeout(12.5, "draining") and n.stopping("bye")
        got = [r.recv(4096).decode() for _ in range(4)]
    finally:
        n.close()
        r.close()
    assert got == [
        "READY=1\nSTATUS=serving",
        "WATCHDOG=1",
        "EXTEND_TIMEOUT_USEC=12500000\nSTATUS=draining",
        "STOPPING=1\nSTATUS=bye",
    ]


def test_sd_notify_is_a_no_op_without_a_socket_and_never_raises(tmp_path: Path) -> None:
    assert notify_address({}) is None and not Notifier(None).ready("x")
    gone = Notifier(str(tmp_path / "nobody-listens"))
    assert gone.enabled and gone.send(READY=1) is False  # the manager is gone: logged, not raised
    gone.close()


def test_watchdog_interval() -> None:
    assert watchdog_interval({}) is None
    assert watchdog_interval({"WATCHDOG_USEC": "30000000"}) == 15.0
    assert watchdog_interval({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}) == 1.0
    assert watchdog_interval({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1"}, pid=2) is None  # another process's
    assert watchdog_interval({"WATCHDOG_USEC": "soon"}) is None


# --- activation, in-process ---------------------------------------------------------------------


def test_systemd_fds_only_for_our_pid_and_the_variables_go() -> None:
    env = {"LISTEN_PID": "1", "LISTEN_FDS": "1", "LISTEN_FDNAMES": "spilld.socket", "PATH": "/bin"}
    assert activation.systemd_fds(env, pid=2) == [] and env == {"PATH": "/bin"}
    assert activation.systemd_fds({"LISTEN_FDS": "1"}) == []
    with pytest.raises(activation.ActivationError):
        activation.systemd_fds({"LISTEN_PID": "x", "LISTEN_FDS": "1"})


def test_listener_checks_what_it_inherits(tmp_path: Path) -> None:
    good = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    good.bind(str(tmp_path / "ok.sock"))
    good.listen()
    sock = activation.listener_from_fd(os.dup(good.fileno()))
    assert activation.socket_path(sock) == str(tmp_path / "ok.sock")
    sock.close()
    idle, dgram = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    rfd, wfd = os.pipe()
    try:
        for fd in (idle.fileno(), dgram.fileno(), rfd):
            with pytest.raises(activation.ActivationError):
                activation.listener_from_fd(fd)
            os.fstat(fd)  # a refused fd is left open, as the manager gave it
    finally:
        for s in (good, idle, dgram):
            s.close()
        os.close(rfd)
        os.close(wfd)


ACTIVATE = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_char_p, ctypes.POINTER(ctypes.POINTER(ctypes.c_int)), ctypes.POINTER(ctypes.c_size_t)
)
FREE = ctypes.CFUNCTYPE(None, ctypes.c_void_p)


class FakeLaunch:
    """libSystem's launch_activate_socket and free, as C callbacks: the real ctypes marshalling runs."""

    def __init__(self, fds: list[int], err: int = 0) -> None:
        self.fds, self.err, self.asked, self.freed = fds, err, b"", [0]
        self.array = (ctypes.c_int * max(1, len(fds)))(*fds)
        self.launch_activate_socket = ACTIVATE(self._activate)
        self.free = FREE(self._free)

    def _activate(self, name: bytes, fds: Any, count: Any) -> int:
        self.asked = name
        if self.err:
            return self.err
        fds[0] = ctypes.cast(self.array, ctypes.POINTER(ctypes.c_int))
        count[0] = len(self.fds)
        return 0

    def _free(self, ptr: int) -> None:
        self.freed.append(ptr)


def test_launchd_fds_through_ctypes() -> None:
    lib = FakeLaunch([7, 8])
    assert activation.launchd_fds("spilld", lib=lib) == [7, 8] and lib.asked == b"spilld"
    assert lib.freed[1:] == [ctypes.addressof(lib.array)]  # the array launchd allocated is freed, once
    assert activation.launchd_fds(lib=FakeLaunch([], errno.ESRCH)) == []  # not started by launchd
    assert activation.launchd_fds(lib=FakeLaunch([], errno.ENOENT)) == []  # no Sockets entry of that name
    with pytest.raises(activation.ActivationError):
        activation.launchd_fds(lib=FakeLaunch([], errno.EALREADY))
    if sys.platform != "darwin":
        assert activation.launchd_fds() == []


# --- activation, a real daemon on an inherited fd -----------------------------------------------


@pytest.fixture
def root() -> Iterator[str]:
    r = new_root()
    try:
        yield r
    finally:
        cleanup(r)


# Puts the listener at fd 3 and sets LISTEN_PID to its own pid, which exec keeps (as systemd does after fork).
SHIM = """
import os, sys
fd = int(os.environ.pop("SPILLD_TEST_FD"))
if fd != 3:
    os.dup2(fd, 3)
    os.close(fd)
os.environ["LISTEN_PID"] = str(os.getpid())
os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
"""


def start_activated(root: str, listener: socket.socket, extra: dict[str, str]) -> subprocess.Popen[bytes]:
    """The daemon with ``listener`` as its fd 3, LISTEN_FDS=1 and LISTEN_PID its own pid."""
    cmd = [
        sys.executable, "-c", SHIM, "-m", "spilld", "--dir", os.path.join(root, "store"),
        "--socket", os.path.join(root, "never.sock"), "--log-format", "json",
    ]  # fmt: skip
    env = {k: v for k, v in os.environ.items() if not k.startswith(("LISTEN_", "NOTIFY_", "WATCHDOG_"))}
    env |= {"LISTEN_FDS": "1", "LISTEN_FDNAMES": "spilld.socket", "SPILLD_TEST_FD": str(listener.fileno()), **extra}
    with open(os.path.join(root, "daemon.log"), "ab") as log:
        return subprocess.Popen(
            cmd, env=env, pass_fds=(listener.fileno(),), stdout=log, stderr=log, start_new_session=True
        )


def log_of(root: str) -> str:
    with open(os.path.join(root, "daemon.log")) as f:
        return f.read()


def has(prefix: str) -> Callable[[list[str]], bool]:
    return lambda got: any(m.startswith(prefix) for msg in got for m in msg.split("\n"))


def test_socket_activation_with_a_real_inherited_fd(root: str) -> None:
    path = os.path.join(root, "act.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    notify = receiver(os.path.join(root, "notify"))
    proc = start_activated(root, listener, {"NOTIFY_SOCKET": notify.getsockname(), "WATCHDOG_USEC": "200000"})
    listener.close()  # the daemon holds its own copy now, as a service manager's child would
    try:
        dead = lambda: "" if proc.poll() is None else f"daemon exited {proc.returncode}:\n{log_of(root)}"  # noqa: E731
        got = recv_all(notify, has("READY=1"), timeout=120, alive=dead)
        assert any("STATUS=serving on " + path in m for m in got), got
        r = subprocess.run(
            [sys.executable, "-m", "spilld", "status", "--socket", path, "--json"],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 0, r.stderr
        st = json.loads(r.stdout)
        assert st["pid"] == proc.pid and st["socket"] == path
        assert not os.path.exists(os.path.join(root, "never.sock"))  # it never bound a socket of its own
        pings = recv_all(notify, lambda g: sum(m == "WATCHDOG=1" for m in g) >= 3, timeout=10)
        assert pings.count("WATCHDOG=1") >= 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log_of(root)
        notify.settimeout(0.5)
        rest = recv_all(notify, has("STOPPING=1"), timeout=10)
        rest += recv_all(notify, has("EXTEND_TIMEOUT_USEC="), timeout=10)
        assert any(m.startswith("STOPPING=1\nSTATUS=stopping: 0 items") for m in rest), rest
        assert os.path.exists(path)  # an inherited socket's path belongs to the manager: not unlinked
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        notify.close()


def test_a_wrong_inherited_socket_is_a_configuration_error(root: str) -> None:
    dgram = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    try:
        proc = start_activated(root, dgram, {})
        assert proc.wait(120) == cli.EXIT_USAGE
    finally:
        dgram.close()
    assert "not a listening Unix stream socket" in log_of(root)


# --- spilld service install / uninstall / status ----------------------------------------------


def test_install_dry_run_prints_and_writes_nothing(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != "XDG_CONFIG_HOME"} | {"HOME": str(tmp_path)}
    for manager, want in (
        ("systemd", ["ExecStart=", "ListenStream=", "$ systemctl --user daemon-reload", "enable --now spilld.socket"]),
        ("launchd", ["<key>ProgramArguments</key>", f"$ launchctl bootstrap gui/{os.getuid()}", "4GiB"]),
    ):
        r = subprocess.run(
            [sys.executable, "-m", "spilld", "service", "install", "--dry-run", "--manager", manager],
            capture_output=True,
            text=True,
            env=env,
            timeout=120,
        )
        assert r.returncode == 0, r.stderr
        for text in want:
            assert text in r.stdout, r.stdout
        assert list(tmp_path.iterdir()) == []


class FakeRunner:
    def __init__(self, fail: Sequence[str] = ()) -> None:
        self.calls: list[list[str]] = []
        self.fail = fail

    def __call__(self, argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
        self.calls.append(list(argv))
        bad = any(word in argv for word in self.fail)
        return subprocess.CompletedProcess(list(argv), 1 if bad else 0, "active\n", "refused" if bad else "")


@pytest.fixture
def fake_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, FakeRunner]:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    runner = FakeRunner()
    monkeypatch.setattr(install, "run_command", runner)
    return tmp_path, runner


def test_systemd_install_and_uninstall(fake_home: tuple[Path, FakeRunner]) -> None:
    home, runner = fake_home
    assert cli.main(["service", "install", "--manager", "systemd", "--cap", "8GiB", "--dir", "~/kv"]) == 0
    folder = home / ".config" / "systemd" / "user"
    service = (folder / "spilld.service").read_text()
    assert f"--cap 8GiB --dir {home}/kv" in service and (folder / "spilld.socket").exists()
    assert runner.calls == [
        ["systemctl", "--user", "daemon-reload"],
        ["systemctl", "--user", "try-restart", "spilld.service"],
        ["systemctl", "--user", "enable", "--now", "spilld.socket", "spilld.service"],
    ]
    runner.calls.clear()
    assert cli.main(["service", "status", "--manager", "systemd"]) == 0
    assert ["systemctl", "--user", "is-active", "spilld.service"] in runner.calls
    runner.calls.clear()
    assert cli.main(["service", "uninstall", "--manager", "systemd"]) == 0
    assert list(folder.iterdir()) == []
    assert runner.calls == [
        ["systemctl", "--user", "disable", "--now", "spilld.service", "spilld.socket"],
        ["systemctl", "--user", "daemon-reload"],
    ]
    assert cli.main(["service", "status", "--manager", "systemd"]) == cli.EXIT_UNREACHABLE  # files gone


def test_systemd_install_without_activation_drops_the_socket_unit(fake_home: tuple[Path, FakeRunner]) -> None:
    home, runner = fake_home
    assert cli.main(["service", "install", "--manager", "systemd"]) == 0
    assert cli.main(["service", "install", "--manager", "systemd", "--no-socket-activation"]) == 0
    folder = home / ".config" / "systemd" / "user"
    assert sorted(p.name for p in folder.iterdir()) == ["spilld.service"]
    assert "Requires=spilld.socket" not in (folder / "spilld.service").read_text()
    assert runner.calls[-1] == ["systemctl", "--user", "enable", "--now", "spilld.service"]


def test_launchd_install_and_uninstall(fake_home: tuple[Path, FakeRunner]) -> None:
    home, runner = fake_home
    target = f"gui/{os.getuid()}/{units.LABEL}"
    assert cli.main(["service", "install", "--manager", "launchd", "--drain-deadline", "20"]) == 0
    plist = home / "Library" / "LaunchAgents" / units.PLIST_NAME
    job = plistlib.loads(plist.read_bytes())
    check_plist(job, str(home), 20)
    assert (plist.stat().st_mode & 0o777) == 0o644
    assert (home / "Library" / "Logs" / "spilld").is_dir()
    assert (home / "Library" / "Application Support" / "spilld").stat().st_mode & 0o777 == 0o700
    assert runner.calls == [
        ["launchctl", "bootout", target],
        ["launchctl", "enable", target],
        ["launchctl", "bootstrap", f"gui/{os.getuid()}", str(plist)],
    ]
    runner.calls.clear()
    assert cli.main(["service", "uninstall", "--manager", "launchd"]) == 0
    assert not plist.exists() and runner.calls == [["launchctl", "bootout", target]]


def test_a_refused_command_and_bad_options(fake_home: tuple[Path, FakeRunner], monkeypatch: pytest.MonkeyPatch) -> None:
    runner = FakeRunner(fail=["bootstrap"])
    monkeypatch.setattr(install, "run_command", runner)
    assert cli.main(["service", "install", "--manager", "launchd"]) == cli.EXIT_SERVICE
    assert cli.main(["service", "install", "--manager", "systemd", "--cap", "lots"]) == cli.EXIT_USAGE
    assert cli.main(["service", "install", "--manager", "systemd", "--drain-deadline", "0"]) == cli.EXIT_USAGE


# --- the lifecycle, in-process ------------------------------------------------------------------


@pytest.mark.asyncio
async def test_a_long_drain_keeps_extending_the_stop(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from spilld.service import lifecycle

    monkeypatch.setattr(lifecycle, "EXTEND_EVERY_S", 0.05)
    monkeypatch.setattr(lifecycle, "STOP_GRACE_S", 0.0)
    r = receiver(str(tmp_path / "notify"))
    life = lifecycle.Lifecycle(Notifier(str(tmp_path / "notify")), watchdog_s=0.05)
    left = iter(range(100, 0, -1))
    try:
        life.start_watchdog()
        async with life.extending_stop(0.3, lambda: f"{next(left)} items left"):
            await asyncio.sleep(0.6)  # a drain that outlives its budget: the requests stop at the budget
        await life.close()
        r.setblocking(False)
        got = []
        with contextlib.suppress(BlockingIOError):
            while True:
                got.append(r.recv(4096).decode())
    finally:
        r.close()
    extends = [m for m in got if m.startswith("EXTEND_TIMEOUT_USEC=")]
    assert 4 <= len(extends) <= 8, got  # every 50 ms within the 300 ms budget, none after
    assert all(int(m.split("\n")[0].split("=")[1]) <= 300_000 for m in extends)  # never past the budget
    assert extends[0].endswith("STATUS=100 items left") and "STATUS=99 items left" in extends[1]
    assert got.count("WATCHDOG=1") >= 5
