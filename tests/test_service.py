"""Service managers: the plist and units, sd_notify, socket activation with a real fd, install/uninstall."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import fcntl
import io
import itertools
import json
import os
import plistlib
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from spilld import cli
from spilld.daemon.listen import serve_inherited
from spilld.service import activation, install, lifecycle, units
from spilld.service.lifecycle import Progress
from spilld.service.sdnotify import Notifier, notify_address, watchdog_interval
from spilld.service.units import ServiceSpec
from tests.daemons import cleanup, new_root

ROOT = Path(__file__).resolve().parent.parent

# --- launchd plist ----------------------------------------------------------------------------


def check_plist(job: dict[str, Any], home: str, deadline: float) -> None:
    assert job["Label"] == units.LABEL and job["RunAtLoad"] is True
    assert job["KeepAlive"] == {"SuccessfulExit": False}
    assert job["ExitTimeOut"] > deadline  # launchd cannot be asked for more time: the whole drain must fit
    assert job["ThrottleInterval"] >= 30  # exit 2 is relaunched (launchd has no RestartPreventExitStatus): slowly
    assert "EnableTransactions" not in job
    assert job["ProcessType"] == "Standard"  # Background would throttle the I/O of the drain and of every save
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
        # found in review: a copy installed by hand carried the marker, so install replaced it and uninstall removed it
        assert units.MARKER not in text and units.EXAMPLE_NOTE in text
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
    stop = int(text.split("\nTimeoutStopSec=")[1].split("s")[0])
    assert stop == units.SYSTEMD_STOP_S == 30 and f"--cap {spec.cap}" in text  # short: a drain asks for more
    assert "\nTimeoutStartSec=" not in text  # the default: the scan asks for more time while it advances
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


def unused_fds(n: int) -> int:
    """The first of ``n`` consecutive fd numbers (from 200) that are not open in this process."""
    first = 200
    while any(is_open(fd) for fd in range(first, first + n)):
        first += n
    return first


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def test_several_systemd_fds_ours_is_picked_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    socks = [socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) for _ in range(3)]
    first = unused_fds(3)
    monkeypatch.setattr(activation, "SD_LISTEN_FDS_START", first)  # where systemd would put them: 3, 4, 5
    fds = list(range(first, first + 3))
    try:
        for i, s in enumerate(socks):
            s.bind(str(tmp_path / f"{i}.sock"))
            s.listen()
            os.dup2(s.fileno(), fds[i], inheritable=True)
        env = {"LISTEN_PID": "7", "LISTEN_FDS": "3", "LISTEN_FDNAMES": "metrics.socket:spilld.socket:admin"}
        named = activation.systemd_fds(env, pid=7)
        assert named == [(fds[0], "metrics.socket"), (fds[1], "spilld.socket"), (fds[2], "admin")]
        assert all(fcntl.fcntl(fd, fcntl.F_GETFD) & fcntl.FD_CLOEXEC for fd in fds)  # as sd_listen_fds leaves them
        sock = activation.listener_from_fd(activation._pick(named))
        assert sock.fileno() == fds[1] and activation.socket_path(sock) == str(tmp_path / "1.sock")
        sock.detach()
        assert activation._pick([(fds[0], "metrics"), (fds[1], "spilld")]) == fds[1]  # FileDescriptorName=spilld
        for names in ("metrics:admin:other", "spilld.socket:spilld:other", ""):  # none ours, two ours, unnamed
            env = {"LISTEN_PID": "7", "LISTEN_FDS": "3", "LISTEN_FDNAMES": names}
            with pytest.raises(activation.ActivationError, match="not exactly one is named"):
                activation._pick(activation.systemd_fds(env, pid=7))
    finally:
        for fd in fds:
            if is_open(fd):
                os.close(fd)
        for s in socks:
            s.close()


def test_a_listen_fd_that_is_not_open_is_an_activation_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(activation, "SD_LISTEN_FDS_START", unused_fds(2))
    with pytest.raises(activation.ActivationError, match="which is not open"):  # EBADF, which would exit 1
        activation.systemd_fds({"LISTEN_PID": "7", "LISTEN_FDS": "2"}, pid=7)


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


def test_an_inherited_socket_is_served_without_the_loops_cleanup_of_its_path() -> None:
    """Since Python 3.13 an event loop unlinks a Unix server's path when it closes, unless ``cleanup_socket=False``
    (the test below failed there: the manager's socket was gone after the daemon stopped). A loop that takes the
    parameter is told not to; one that does not (3.11's asyncio) is not given it."""
    seen: list[dict[str, Any]] = []

    class Newer(asyncio.SelectorEventLoop):
        async def create_unix_server(  # type: ignore[override]
            self, factory: Any, path: Any = None, *, sock: Any = None, cleanup_socket: bool = True, **kw: Any
        ) -> Any:
            seen.append({"sock": sock, "cleanup_socket": cleanup_socket})
            return "server"

    class Older(asyncio.SelectorEventLoop):
        async def create_unix_server(self, factory: Any, path: Any = None, *, sock: Any = None, **kw: Any) -> Any:  # type: ignore[override]
            seen.append({"sock": sock, **kw})
            return "server"

    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        for loop in (Newer, Older):
            with asyncio.Runner(loop_factory=loop) as runner:
                assert runner.run(serve_inherited(s, object)) == "server"
    assert seen == [{"sock": s, "cleanup_socket": False}, {"sock": s}]


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
        assert f"not --socket {os.path.join(root, 'never.sock')}" in log_of(root)  # and said so (found in review)
        second = subprocess.run(
            [sys.executable, "-m", "spilld", "--socket", path, "--dir", os.path.join(root, "other")],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert second.returncode == 5 and f"pid {proc.pid}" in second.stderr, second.stderr  # named (review)
        assert f"a spilld daemon already listens on {path}" in second.stderr, second.stderr  # it answered as one
        assert not os.path.exists(path + ".lock")  # the refused start left no lock of its own (found in review)
        pings = recv_all(notify, lambda g: sum(m == "WATCHDOG=1" for m in g) >= 3, timeout=10)
        assert pings.count("WATCHDOG=1") >= 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log_of(root)
        rest = recv_all(notify, has("STOPPING=1"), timeout=10)
        notify.setblocking(False)
        with contextlib.suppress(BlockingIOError):  # the daemon has exited: whatever it sent is here
            while True:
                rest.append(notify.recv(4096).decode())
        assert any(m.startswith("STOPPING=1\nSTATUS=stopping: 0 items") for m in rest), rest
        assert not any("EXTEND_TIMEOUT_USEC" in m for m in rest), rest  # nothing to write: no more time asked
        assert os.path.exists(path)  # an inherited socket's path belongs to the manager: not unlinked
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        notify.close()


@pytest.mark.parametrize(
    ("kind", "extra", "why"),
    [
        (socket.SOCK_DGRAM, {}, "not a listening Unix stream socket"),
        # two fds announced, one passed: fd 4 is ours by name and not there (EBADF, or not a socket)
        (socket.SOCK_STREAM, {"LISTEN_FDS": "2", "LISTEN_FDNAMES": "other:spilld.socket"}, "fd 4"),
    ],
    ids=["datagram", "missing-fd"],
)
def test_a_wrong_inherited_socket_is_a_configuration_error(
    root: str, kind: socket.SocketKind, extra: dict[str, str], why: str
) -> None:
    sock = socket.socket(socket.AF_UNIX, kind)
    if kind == socket.SOCK_STREAM:
        sock.bind(os.path.join(root, "act.sock"))
        sock.listen()
    try:
        proc = start_activated(root, sock, extra)
        assert proc.wait(120) == cli.EXIT_USAGE, log_of(root)  # 2: RestartPreventExitStatus, not a restart loop
    finally:
        sock.close()
    assert why in log_of(root)


# --- spilld service install / uninstall / status ----------------------------------------------


def test_install_dry_run_prints_and_writes_nothing(short_home: Path) -> None:
    tmp_path = short_home
    env = {k: v for k, v in os.environ.items() if k != "XDG_CONFIG_HOME"} | {"HOME": str(tmp_path)}
    for manager, want in (
        ("systemd", ["ExecStart=", "ListenStream=", "$ systemctl --user daemon-reload", "enable --now spilld.socket"]),
        (
            "launchd",
            [
                "<key>ProgramArguments</key>",
                f"$ launchctl print gui/{os.getuid()}/{units.LABEL}  # again every 0.5 s until it fails",
                f"$ launchctl bootstrap gui/{os.getuid()}",
                "4GiB",
            ],
        ),
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
    """launchctl and systemctl as a small state machine that answers as the real tools do. ``codes[verb]``
    forces the exit codes of that verb's next calls; ``unloading``: how many ``launchctl print`` calls still
    find a job after its bootout; ``hang``: a verb that runs past its timeout. Given ``unit_dir``, ``listening``
    is the path the socket unit listens on: read from its unit file when it starts, kept through daemon-reload
    and a start of a unit that is active, as systemd does."""

    def __init__(
        self,
        codes: dict[str, list[int]] | None = None,
        unloading: int = 0,
        hang: str = "",
        unit_dir: Path | None = None,
    ) -> None:
        self.calls: list[list[str]] = []
        self.timeouts: list[float] = []
        self.codes = {verb: list(rcs) for verb, rcs in (codes or {}).items()}
        self.unloading, self.hang = unloading, hang
        self.loaded, self.lingering = False, 0
        self.enabled: set[str] = set()
        self.active: set[str] = set()
        self.unit_dir, self.listening = unit_dir, ""

    def __call__(self, argv: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
        argv = list(argv)
        self.calls.append(argv)
        self.timeouts.append(timeout)
        skip = 3 if argv[0] == "systemctl" else 2  # systemctl --user VERB ..., launchctl VERB ...
        verb, args = argv[skip - 1], argv[skip:]
        if verb == self.hang:
            raise subprocess.TimeoutExpired(argv, timeout)
        if self.codes.get(verb):
            rc = self.codes[verb].pop(0)
            return subprocess.CompletedProcess(argv, rc, "", f"{verb} failed: {rc}" if rc else "")
        rc, out, err = self.answer(verb, args)
        return subprocess.CompletedProcess(argv, rc, out, err)

    def answer(self, verb: str, args: list[str]) -> tuple[int, str, str]:
        names = {a for a in args if not a.startswith("--")}
        if verb == "bootstrap":
            if self.loaded or self.lingering:
                return 5, "", "Bootstrap failed: 5: Input/output error"
            self.loaded = True
        elif verb == "bootout":
            if not self.loaded:
                return 113, "", "Boot-out failed: 113: Could not find specified service"
            self.loaded, self.lingering = False, self.unloading
        elif verb == "print":
            if not (self.loaded or self.lingering):
                return 113, "", f'Could not find service "{units.LABEL}" in domain for user gui: {os.getuid()}'
            self.lingering = max(0, self.lingering - 1)
            return 0, f"{args[0]} = {{\n\tstate = {'running' if self.loaded else 'exiting'}\n}}\n", ""
        elif verb in ("enable", "disable"):
            (self.enabled.update if verb == "enable" else self.enabled.difference_update)(names)
            if "--now" in args and verb == "enable":
                self.starts(names - self.active)
            elif "--now" in args:
                self.active.difference_update(names)
        elif verb == "start":
            self.starts(names - self.active)  # one that is active already is left as it is
        elif verb == "restart":
            self.starts(names)
        elif verb == "try-restart":
            self.starts(names & self.active)  # only those that run
        elif verb == "is-enabled":
            return (0, "enabled\n", "") if names <= self.enabled else (1, "disabled\n", "")
        elif verb == "is-active":
            return (0, "active\n", "") if names <= self.active else (3, "inactive\n", "")
        return 0, "", ""

    def starts(self, names: set[str]) -> None:
        """``names`` (re)started: a socket unit listens where its unit file says now."""
        self.active.update(names)
        unit = self.unit_dir / units.SOCKET_NAME if self.unit_dir is not None else None
        if units.SOCKET_NAME in names and unit is not None and unit.exists():
            lines = unit.read_text().splitlines()
            self.listening = next((ln.split("=", 1)[1] for ln in lines if ln.startswith("ListenStream=")), "")


REAL_RUN = install.run_command  # before any test replaces it


@pytest.fixture
def short_home() -> Iterator[Path]:
    """A home whose LaunchAgent socket fits macOS's 103 bytes (pytest's own folders are too long for it)."""
    home = Path(tempfile.mkdtemp(prefix="spilld-home-", dir="/tmp"))
    yield home
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture
def fake_home(short_home: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, FakeRunner]:
    monkeypatch.setenv("HOME", str(short_home))
    monkeypatch.delenv("XDG_CONFIG_HOME", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)  # the default --dir is the daemon's own (a test sets it)
    runner = FakeRunner(unit_dir=short_home / ".config" / "systemd" / "user")
    monkeypatch.setattr(install, "run_command", runner)
    return short_home, runner


def test_systemd_install_and_uninstall(fake_home: tuple[Path, FakeRunner], capsys: pytest.CaptureFixture[str]) -> None:
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
    capsys.readouterr()
    assert cli.main(["service", "status", "--manager", "systemd"]) == 0
    assert ["systemctl", "--user", "is-active", "spilld.service"] in runner.calls
    out = capsys.readouterr().out
    assert "spilld.socket: enabled, active" in out and "spilld.service: enabled, active" in out
    runner.calls.clear()
    assert cli.main(["service", "uninstall", "--manager", "systemd"]) == 0
    assert list(folder.iterdir()) == []
    assert runner.calls == [
        ["systemctl", "--user", "disable", "--now", "spilld.service", "spilld.socket"],
        ["systemctl", "--user", "daemon-reload"],
    ]
    capsys.readouterr()
    assert cli.main(["service", "status", "--manager", "systemd"]) == cli.EXIT_NOT_INSTALLED  # files gone, stopped
    assert "spilld.service: disabled, inactive" in capsys.readouterr().out
    assert cli.main(["service", "uninstall", "--manager", "systemd"]) == 0  # again: says so (not "uninstalled: ")
    assert "nothing to uninstall" in capsys.readouterr().out


def test_systemd_install_without_activation_drops_the_socket_unit(fake_home: tuple[Path, FakeRunner]) -> None:
    home, runner = fake_home
    assert cli.main(["service", "install", "--manager", "systemd"]) == 0
    assert cli.main(["service", "install", "--manager", "systemd", "--no-socket-activation"]) == 0
    folder = home / ".config" / "systemd" / "user"
    assert sorted(p.name for p in folder.iterdir()) == ["spilld.service"]
    assert "Requires=spilld.socket" not in (folder / "spilld.service").read_text()
    assert runner.calls[-1] == ["systemctl", "--user", "enable", "--now", "spilld.service"]
    assert runner.active == {"spilld.service"}  # the socket unit of the first install was stopped


def test_a_reinstall_with_another_socket_restarts_the_socket_unit_and_only_then(
    fake_home: tuple[Path, FakeRunner], capsys: pytest.CaptureFixture[str]
) -> None:
    """Found in review: a reinstall with another --socket rewrote the socket unit, but the running socket unit kept
    listening on the old path (daemon-reload and `enable --now` leave an active unit as it is). Its unit changed, it
    is restarted after daemon-reload, with the service, and install says so; a reinstall that changes nothing
    restarts no socket unit."""
    home, runner = fake_home
    base = ["service", "install", "--manager", "systemd"]
    assert cli.main([*base, "--socket", "~/a.sock"]) == 0
    assert runner.listening == f"{home}/a.sock"
    runner.calls.clear()
    capsys.readouterr()
    assert cli.main([*base, "--socket", "~/b.sock"]) == 0
    assert runner.listening == f"{home}/b.sock"  # (without the restart: still a.sock)
    assert runner.calls[:2] == [
        ["systemctl", "--user", "daemon-reload"],
        ["systemctl", "--user", "try-restart", units.SOCKET_NAME, units.SERVICE_NAME],
    ]
    out = capsys.readouterr().out
    assert f"spilld.socket changed: restarted, it listens on {home}/b.sock now" in out, out
    runner.calls.clear()
    assert cli.main([*base, "--socket", "~/b.sock"]) == 0  # the same again: the socket unit is left alone
    assert not [c for c in runner.calls if "restart" in c[2] and units.SOCKET_NAME in c]
    assert "changed" not in capsys.readouterr().out
    assert cli.main([*base, "--socket", "~/b.sock", "--dry-run"]) == 0
    assert "# spilld.socket changed" not in capsys.readouterr().out
    assert cli.main([*base, "--socket", "~/c.sock", "--dry-run"]) == 0
    assert "try-restart spilld.socket spilld.service  # spilld.socket changed" in capsys.readouterr().out


def test_a_failed_reinstall_puts_the_socket_unit_back_on_its_old_path(
    fake_home: tuple[Path, FakeRunner], capsys: pytest.CaptureFixture[str]
) -> None:
    """The reinstall's restart moved the socket unit to the new path; when a later command fails, the old files come
    back and the socket unit is restarted on the old path (a start would leave the active unit on the new one)."""
    home, runner = fake_home
    base = ["service", "install", "--manager", "systemd"]
    assert cli.main([*base, "--socket", "~/a.sock"]) == 0
    runner.codes["enable"] = [1]
    assert cli.main([*base, "--socket", "~/b.sock"]) == cli.EXIT_SERVICE
    unit = home / ".config" / "systemd" / "user" / units.SOCKET_NAME
    assert f"ListenStream={home}/a.sock" in unit.read_text() and runner.listening == f"{home}/a.sock"
    assert runner.calls[-1] == ["systemctl", "--user", "restart", units.SOCKET_NAME, units.SERVICE_NAME]


def test_launchd_install_and_uninstall(fake_home: tuple[Path, FakeRunner], capsys: pytest.CaptureFixture[str]) -> None:
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
        ["launchctl", "bootout", target],  # nothing loaded yet: fails, and may
        ["launchctl", "print", target],  # fails at once: no old job to wait for
        ["launchctl", "enable", target],
        ["launchctl", "bootstrap", f"gui/{os.getuid()}", str(plist)],
    ]
    capsys.readouterr()
    assert cli.main(["service", "status", "--manager", "launchd"]) == 0
    assert "launchd: loaded state = running" in capsys.readouterr().out
    runner.calls.clear()
    assert cli.main(["service", "uninstall", "--manager", "launchd"]) == 0
    assert not plist.exists() and runner.calls == [["launchctl", "bootout", target]]
    assert cli.main(["service", "status", "--manager", "launchd"]) == cli.EXIT_NOT_INSTALLED


def test_files_spilld_did_not_write_are_never_replaced_removed_or_stopped(
    fake_home: tuple[Path, FakeRunner], capsys: pytest.CaptureFixture[str]
) -> None:
    """A user's own spilld.service / spilld.socket (no marker line), or a link to one kept elsewhere, is not
    spilld's: install refuses to replace it and runs nothing; uninstall and a reinstall without socket activation
    leave it, and stop nothing of it (found in review: both were deleted, a symlink became a plain file)."""
    home, runner = fake_home
    folder = home / ".config" / "systemd" / "user"
    folder.mkdir(parents=True)
    mine = folder / "spilld.service"
    mine.write_text("[Service]\nExecStart=/usr/bin/my-own-spilld\n")
    mine.chmod(0o600)
    # a usage refusal, exit 2 (found in review: 6, which says a service manager refused a command), dry run too
    assert cli.main(["service", "install", "--manager", "systemd"]) == cli.EXIT_USAGE
    assert "was not written by spilld service install" in capsys.readouterr().err
    assert cli.main(["service", "install", "--manager", "systemd", "--dry-run"]) == cli.EXIT_USAGE
    assert mine.read_text().startswith("[Service]") and (mine.stat().st_mode & 0o777) == 0o600
    assert runner.calls == [] and not (folder / "spilld.socket").exists()
    assert cli.main(["service", "uninstall", "--manager", "systemd"]) == 0
    assert mine.exists() and runner.calls == []  # not stopped, not removed
    capsys.readouterr()
    cli.main(["service", "status", "--manager", "systemd"])  # found in review: listed as spilld's ("installed")
    listed = capsys.readouterr().out
    assert f"yours      {mine} (not written by spilld" in listed and f"missing    {folder / 'spilld.socket'}" in listed
    kept = home / "dotfiles" / "spilld.service"  # a link to a file spilld wrote, kept elsewhere: not spilld's either
    kept.parent.mkdir()
    kept.write_text(units.systemd_service(ServiceSpec()))
    mine.unlink()
    mine.symlink_to(kept)
    assert cli.main(["service", "install", "--manager", "systemd"]) == cli.EXIT_USAGE and mine.is_symlink()
    mine.unlink()
    assert cli.main(["service", "install", "--manager", "systemd"]) == 0  # ours now: with the marker
    capsys.readouterr()
    assert cli.main(["service", "status", "--manager", "systemd"]) == 0
    assert f"installed  {mine}\n" in capsys.readouterr().out
    sock = folder / "spilld.socket"
    sock.write_text("[Socket]\nListenStream=/run/user/me/theirs.sock\n")  # replaced by the user by hand
    runner.calls.clear()
    capsys.readouterr()
    assert cli.main(["service", "install", "--manager", "systemd", "--no-socket-activation"]) == 0
    assert sock.read_text().startswith("[Socket]") and "left alone" in capsys.readouterr().err
    assert ["systemctl", "--user", "disable", "--now", "spilld.socket"] not in runner.calls
    runner.calls.clear()
    assert cli.main(["service", "uninstall", "--manager", "systemd"]) == 0
    assert sock.exists() and not mine.exists()
    assert runner.calls[0] == ["systemctl", "--user", "disable", "--now", "spilld.service"]


def test_a_binary_plist_of_ours_is_saved_and_put_back_as_bytes(fake_home: tuple[Path, FakeRunner]) -> None:
    """launchd reads binary plists too: one spilld wrote and the user converted (``plutil -convert binary1``) is
    saved and put back byte for byte when the manager refuses the reinstall (found in review: reading it as text
    failed with the old job already stopped). Its marker is gone with the conversion, so it reads as the user's
    and is refused untouched; one with the marker kept in a string is ours."""
    home, runner = fake_home
    assert cli.main(["service", "install", "--manager", "launchd"]) == 0
    plist = home / "Library" / "LaunchAgents" / units.PLIST_NAME
    job = plistlib.loads(plist.read_bytes())
    converted = plistlib.dumps(job, fmt=plistlib.FMT_BINARY)
    plist.write_bytes(converted)
    runner.calls.clear()
    assert cli.main(["service", "install", "--manager", "launchd"]) == cli.EXIT_USAGE  # the user's: refused
    assert plist.read_bytes() == converted and runner.calls == []
    ours = plistlib.dumps(job | {"Comment": units.MARKER}, fmt=plistlib.FMT_BINARY)
    plist.write_bytes(ours)
    runner.codes["bootstrap"] = [1]  # the manager refuses: the files are put back
    assert cli.main(["service", "install", "--manager", "launchd"]) == cli.EXIT_SERVICE
    assert plist.read_bytes() == ours


def launchd_reinstall(home: Path, runner: FakeRunner, deadline: float = 20) -> tuple[bool, list[float], str]:
    """Install, then install again over it; the second install's verbs are left in ``runner.calls``."""
    slept: list[float] = []
    err = io.StringIO()
    spec = ServiceSpec(drain_deadline=deadline)
    assert install.apply(install.install_plan("launchd", spec, home), runner, err, sleep=slept.append)
    runner.calls.clear()
    ok = install.apply(install.install_plan("launchd", spec, home), runner, err, sleep=slept.append)
    return ok, slept, err.getvalue()


def verbs(runner: FakeRunner) -> list[str]:
    return [argv[1] for argv in runner.calls]


def test_launchd_reinstall_waits_until_the_old_job_has_unloaded(tmp_path: Path) -> None:
    runner = FakeRunner(unloading=3)  # the bootout returns while the old job is still going
    ok, slept, err = launchd_reinstall(tmp_path, runner)
    assert ok, err
    assert verbs(runner) == ["bootout", "print", "print", "print", "print", "enable", "bootstrap"]
    assert slept == [install.POLL_S] * 3


def test_launchd_bootstrap_is_retried_on_an_io_error(tmp_path: Path) -> None:
    runner = FakeRunner(codes={"bootstrap": [0, 5, 5]})  # the first install's, then two "not yet"
    ok, slept, err = launchd_reinstall(tmp_path, runner)
    assert ok, err
    assert verbs(runner) == ["bootout", "print", "enable", "bootstrap", "bootstrap", "bootstrap"]
    assert slept == [install.RETRY_PAUSE_S] * 2
    stuck = FakeRunner(codes={"bootstrap": [0, *[5] * 10]})
    ok, slept, err = launchd_reinstall(tmp_path / "stuck", stuck)
    # the new job's tries, then the rollback's to load the old one again: each retried as long
    assert not ok and verbs(stuck).count("bootstrap") == 2 * (1 + install.RETRIES) and "failed (5)" in err


def test_launchd_reinstall_gives_up_on_a_job_that_never_unloads(tmp_path: Path) -> None:
    runner = FakeRunner(unloading=10**6)
    ok, slept, err = launchd_reinstall(tmp_path, runner, deadline=5)
    stop_s = units.stop_timeout_s(5)
    assert not ok and "has not unloaded" in err and f"after {stop_s} s" in err
    assert sum(slept) == pytest.approx(stop_s) and "bootstrap" not in verbs(runner)  # bounded, and no bootstrap


def test_commands_may_run_as_long_as_the_longest_stop(fake_home: tuple[Path, FakeRunner]) -> None:
    _, runner = fake_home
    assert cli.main(["service", "install", "--manager", "systemd", "--drain-deadline", "300"]) == 0
    longest = units.stop_timeout_s(300) + install.COMMAND_MARGIN_S
    assert set(runner.timeouts) == {longest} and longest > 300
    runner.timeouts.clear()
    assert cli.main(["service", "install", "--manager", "systemd", "--drain-deadline", "10"]) == 0
    assert set(runner.timeouts) == {longest}  # try-restart stops the installed daemon, whose deadline is 300 s
    runner.timeouts.clear()
    assert cli.main(["service", "uninstall", "--manager", "systemd"]) == 0
    assert set(runner.timeouts) == {units.stop_timeout_s(10) + install.COMMAND_MARGIN_S}  # read from the unit


def test_a_command_that_hangs_is_a_clean_failure(
    fake_home: tuple[Path, FakeRunner], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(install, "run_command", FakeRunner(hang="try-restart"))  # a step that may fail, even so
    assert cli.main(["service", "install", "--manager", "systemd"]) == cli.EXIT_SERVICE
    err = capsys.readouterr().err
    assert "`systemctl --user try-restart spilld.service` did not finish within 180 s" in err
    assert "Traceback" not in err
    monkeypatch.setattr(install, "run_command", FakeRunner(hang="is-active"))
    assert cli.main(["service", "status", "--manager", "systemd"]) == cli.EXIT_NOT_INSTALLED  # no answer: not active


def test_a_refused_command_and_bad_options(fake_home: tuple[Path, FakeRunner], monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(install, "run_command", FakeRunner(codes={"bootstrap": [1]}))
    assert cli.main(["service", "install", "--manager", "launchd"]) == cli.EXIT_SERVICE
    assert cli.main(["service", "install", "--manager", "systemd", "--cap", "lots"]) == cli.EXIT_USAGE
    assert cli.main(["service", "install", "--manager", "systemd", "--drain-deadline", "0"]) == cli.EXIT_USAGE


def test_a_refused_install_puts_the_files_back(
    fake_home: tuple[Path, FakeRunner], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    home = fake_home[0]
    service, sock = install.unit_dir(home) / units.SERVICE_NAME, install.unit_dir(home) / units.SOCKET_NAME
    monkeypatch.setattr(install, "run_command", FakeRunner(codes={"daemon-reload": [1]}))  # no user manager
    assert cli.main(["service", "install", "--manager", "systemd"]) == cli.EXIT_SERVICE
    err = capsys.readouterr().err
    assert not service.exists() and not sock.exists()  # a first install leaves nothing behind
    assert f"rolled back: removed {service}" in err and "Traceback" not in err
    assert not (home / ".config").exists()  # nor the folders it made for its files (found in review)
    monkeypatch.setattr(install, "run_command", FakeRunner())
    assert cli.main(["service", "install", "--manager", "systemd", "--cap", "2GiB"]) == 0
    before = service.read_text()
    failing = FakeRunner(codes={"enable": [1]})
    monkeypatch.setattr(install, "run_command", failing)
    assert cli.main(["service", "install", "--manager", "systemd", "--cap", "8GiB"]) == cli.EXIT_SERVICE
    assert service.read_text() == before and "--cap 2GiB" in before  # a reinstall: the old unit is back
    assert f"restored {service}" in capsys.readouterr().err
    # and its daemon, stopped by the reinstall's try-restart, is started again (found in review: left down)
    assert failing.calls[-1] == ["systemctl", "--user", "start", "spilld.socket", "spilld.service"]
    monkeypatch.setattr(install, "run_command", FakeRunner(codes={"bootstrap": [1]}))
    assert cli.main(["service", "install", "--manager", "launchd"]) == cli.EXIT_SERVICE
    assert not install.plist_path(home).exists() and not (home / "Library").exists()  # its folders too
    monkeypatch.setattr(install, "run_command", FakeRunner())
    assert cli.main(["service", "install", "--manager", "launchd", "--cap", "2GiB"]) == 0
    failing = FakeRunner(codes={"bootstrap": [1]})
    monkeypatch.setattr(install, "run_command", failing)
    assert cli.main(["service", "install", "--manager", "launchd", "--cap", "8GiB"]) == cli.EXIT_SERVICE
    assert "--cap" in install.plist_path(home).read_text() and "2GiB" in install.plist_path(home).read_text()
    assert failing.calls[-1][:2] == ["launchctl", "bootstrap"] and failing.loaded  # the old job loaded again


# --- the lifecycle, in-process ------------------------------------------------------------------


class Recorder(Notifier):
    """A notifier that also keeps every message, with the time it was sent."""

    def __init__(self, address: str) -> None:
        super().__init__(address)
        self.sent: list[tuple[float, str]] = []

    def send(self, **fields: str | int) -> bool:
        self.sent.append((time.monotonic(), "\n".join(f"{k}={v}" for k, v in fields.items())))
        return super().send(**fields)

    def messages(self, prefix: str = "") -> list[str]:
        return [m for _, m in self.sent if m.startswith(prefix)]


@pytest.mark.asyncio
async def test_more_time_is_asked_only_while_the_work_advances(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lifecycle, "EXTEND_EVERY_S", 0.01)
    rec = Recorder(str(tmp_path / "notify"))
    life = lifecycle.Lifecycle(rec, watchdog_s=None)
    looks = [
        Progress((10, 1000), False, "10 left"),  # the first look: what the next is compared with
        Progress((8, 800), False, "8 left"),
        Progress((8, 800), True, "8 left, writing"),  # counts stand still, but a write is under way
        Progress((8, 800), False, "8 left"),  # stalled
        Progress((5, 500), False, "5 left"),
    ]
    seen, done = 0, asyncio.Event()

    def probe() -> Progress:
        nonlocal seen
        seen += 1
        if seen >= len(looks):
            done.set()
        return looks[min(seen, len(looks)) - 1]

    async with life.extending(probe):  # no budget: the start-up scan
        await asyncio.wait_for(done.wait(), timeout=60)
    await life.close()
    window = "EXTEND_TIMEOUT_USEC=15000000"
    sent = rec.messages()
    assert sent[:4] == [
        f"{window}\nSTATUS=8 left",
        f"{window}\nSTATUS=8 left, writing",
        "STATUS=8 left (no progress: no more time asked)",
        f"{window}\nSTATUS=5 left",
    ]
    assert all(m == "STATUS=5 left (no progress: no more time asked)" for m in sent[4:]), sent


@pytest.mark.asyncio
async def test_the_requests_never_reach_past_the_drain_budget(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(lifecycle, "EXTEND_EVERY_S", 0.05)
    monkeypatch.setattr(lifecycle, "STOP_GRACE_S", 0.1)
    rec = Recorder(str(tmp_path / "notify"))
    life = lifecycle.Lifecycle(rec, watchdog_s=0.05)
    left = itertools.count(1000, -1)
    life.start_watchdog()
    async with life.extending(lambda: Progress((next(left),), False, "draining"), budget_s=0.5):
        ends = time.monotonic() + 0.5 + 0.1  # no earlier than the end of the budget and grace
        await asyncio.sleep(1.5)  # a drain that outlives its budget, advancing all the while
    await life.close()
    extends = [(t, m) for t, m in rec.sent if m.startswith("EXTEND_TIMEOUT_USEC=")]
    assert extends, rec.sent  # at least one of the ~10 turns came, however busy the machine
    usecs = [int(m.split("\n")[0].split("=")[1]) for _, m in extends]
    assert all(m.endswith("\nSTATUS=draining") for _, m in extends)
    assert usecs == sorted(usecs, reverse=True) and usecs[0] <= 600_000  # each asks only for what is left
    assert all(t + usec / 1e6 <= ends + 0.01 for (t, _), usec in zip(extends, usecs, strict=True))
    assert len(rec.messages("WATCHDOG=1")) >= 2  # the watchdog is a separate task and keeps going


@pytest.mark.asyncio
async def test_the_daemon_asks_for_time_while_it_scans_and_while_it_drains(
    root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real scan of a store of ten entries, slowed to 40 ms a file: found in review, the scan's progress was
    never seen (the index it builds is taken only at its end), so no more time was asked and a big store's start
    was killed at systemd's TimeoutStartSec."""
    from mlx_lm.models import cache as C

    import spilld
    from spilld.config import Config
    from spilld.daemon import Daemon
    from spilld.queue import DrainReport
    from spilld.store import Store
    from spilld.store import store as store_module
    from tests.caches import fill

    monkeypatch.setattr(lifecycle, "EXTEND_EVERY_S", 0.02)
    cfg = Config(
        cap=2**20,
        disk_cap=2**30,
        dir=os.path.join(root, "store"),
        socket=os.path.join(root, "run", "spilld.sock"),
        drain_deadline=30,
    )
    filled = Store(cfg.dir, block_tokens=0, durability="none")
    for i in range(10):
        await filled.put([i * 100 + t for t in range(4)], [fill(C.KVCache(), 4)], spilld.Identity("m"))
    d = Daemon(cfg)
    rec = Recorder(os.path.join(root, "notify"))
    d.service = lifecycle.Lifecycle(rec, watchdog_s=None)
    real = store_module.scan_root

    def slow_scan(root: str, ops: Any, reap: bool, stopped: Any = bool, tally: Any = None) -> Any:  # a big store's

        def slow() -> bool:
            time.sleep(0.04)
            return bool(stopped())

        return real(root, ops, reap, slow, tally)

    async def slow_close(timeout: float | None = None) -> DrainReport:  # one long write, counts standing still
        d.writing += 1
        await asyncio.sleep(0.4)
        d.writing -= 1
        return DrainReport(done=True, pending_items=0, pending_bytes=0)

    monkeypatch.setattr(store_module, "scan_root", slow_scan)
    monkeypatch.setattr(d.queue, "close", slow_close)
    await d.start()
    assert await d.stop() == 0
    sent = rec.messages()
    first = lambda prefix: next(i for i, m in enumerate(sent) if m.startswith(prefix))  # noqa: E731
    scanning, ready = first("EXTEND_TIMEOUT_USEC=15000000\nSTATUS=scanning: "), first("READY=1")
    stopping, draining = first("STOPPING=1"), first("EXTEND_TIMEOUT_USEC=15000000\nSTATUS=stopping: 0 items")
    assert scanning < ready < stopping < draining, sent
    asked = [m for m in sent[:ready] if m.startswith("EXTEND_TIMEOUT_USEC=15000000\nSTATUS=scanning: ")]
    assert len(asked) >= 3, sent  # asked again and again while files keep being scanned, not once at its end


def test_install_never_plans_a_mode_change_on_a_folder_that_exists(
    fake_home: tuple[Path, FakeRunner], capsys: pytest.CaptureFixture[str]
) -> None:
    home, _ = fake_home
    home.chmod(0o755)
    args = ["service", "install", "--manager", "launchd", "--socket", str(home / "spilld.sock")]
    assert cli.main([*args, "--dry-run"]) == 0
    planned = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("# create folder")]
    assert planned == [f"# create folder {home / 'Library' / 'Logs' / 'spilld'} (0700)"], planned  # never the home
    assert cli.main(args) == 0
    assert home.stat().st_mode & 0o7777 == 0o755  # the socket's folder (the home) kept its mode
    assert (home / "Library" / "Logs" / "spilld").stat().st_mode & 0o777 == 0o700  # the one we made


def test_numbers_from_the_environment_and_installed_files_are_bounded(tmp_path: Path) -> None:
    """Found in review: LISTEN_FDS=10**9 built a list of a billion fds before checking one; WATCHDOG_USEC of
    hundreds of digits overflowed a float; an installed unit's --drain-deadline of inf crashed the stop's timeout
    (OverflowError), and a FIFO at the unit's path hung the command that read it."""
    big = {"LISTEN_PID": "7", "LISTEN_FDS": str(activation.MAX_LISTEN_FDS + 1)}
    with pytest.raises(activation.ActivationError, match="more than"):
        activation.systemd_fds(big, pid=7)
    from spilld.service.sdnotify import MAX_WATCHDOG_USEC

    assert watchdog_interval({"WATCHDOG_USEC": "9" * 400}) == MAX_WATCHDOG_USEC / 2 / 1e6
    unit = install.unit_dir(tmp_path) / units.SERVICE_NAME
    unit.parent.mkdir(parents=True)
    default = units.stop_timeout_s(units.DRAIN_DEADLINE_S)
    for deadline in ("inf", "nan", "-5", "1e300"):
        unit.write_text(f"{units.MARKER}\nExecStart=/bin/spilld --drain-deadline {deadline}\n")
        assert install.installed_stop_s("systemd", tmp_path) == default
    unit.write_text(f"{units.MARKER}\nExecStart=/bin/spilld --drain-deadline 45\n")
    assert install.installed_stop_s("systemd", tmp_path) == units.stop_timeout_s(45)
    unit.unlink()
    os.mkfifo(unit)
    assert install.installed_stop_s("systemd", tmp_path) == default  # at once: a FIFO is never opened


@pytest.mark.parametrize("deadline", [1209600.0, 2.5, 1e-05, 3153600000.0])
def test_the_drain_deadline_a_unit_writes_is_one_the_daemon_reads_back_exactly(deadline: float) -> None:
    """Found in review: 14 days were written '1.2096e+06', which the daemon refused (exit 2) at every start."""
    from spilld.config import parse_duration

    argv = ServiceSpec(cap="2GiB", drain_deadline=deadline).argv()
    assert parse_duration(argv[argv.index("--drain-deadline") + 1], positive=True) == deadline


@pytest.mark.parametrize("action", ["status", "uninstall"])
@pytest.mark.parametrize(
    "extra",
    [["--cap", "9GiB"], ["--dir", "/x"], ["--drain-deadline", "5"], ["--no-socket-activation"], ["--", "--log-level"]],
)
def test_options_only_install_uses_are_refused_by_the_other_actions(action: str, extra: list[str]) -> None:
    """Found in review: status and uninstall ignored them (the README says an option is refused, never ignored)."""
    r = subprocess.run(
        [sys.executable, "-m", "spilld", "service", action, "--manager", "systemd", *extra],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    said = extra[0].replace("--no-", "--")
    assert r.returncode == 2 and "only install uses them" in r.stderr and said in r.stderr, r.stderr


@pytest.mark.parametrize("bad", ["dir", "socket"])
def test_install_refuses_a_dir_or_socket_serve_would_refuse(tmp_path: Path, bad: str) -> None:
    """Found in review: install took a --dir that is a file (refused only when the service started) and a socket in
    a folder other users can write (with socket activation the manager binds it: serve's check never runs)."""
    a_file = tmp_path / "f"
    a_file.write_text("")
    option = ["--dir", str(a_file)] if bad == "dir" else ["--socket", "/tmp/spilld-test.sock"]
    r = subprocess.run(
        [sys.executable, "-m", "spilld", "service", "install", "--manager", "systemd", "--dry-run", *option],
        capture_output=True, text=True, timeout=60, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stdout + r.stderr


def test_a_drain_deadline_of_weeks_caps_each_commands_wait_where_a_real_command_can_wait(
    fake_home: tuple[Path, FakeRunner],
) -> None:
    """Found in review: ``--drain-deadline 25d`` made a command's wait pass poll()'s 2**31 ms: an internal error
    halfway through the install (its files written, no reload), and every later uninstall or install failed the
    same way. Each command now waits at most MAX_COMMAND_WAIT_S, a wait a real command takes."""
    _, runner = fake_home
    assert cli.main(["service", "install", "--manager", "systemd", "--drain-deadline", "30d"]) == 0
    assert set(runner.timeouts) == {install.MAX_COMMAND_WAIT_S}
    assert REAL_RUN(["true"], max(runner.timeouts)).returncode == 0  # the real runner waits that long
    runner.timeouts.clear()
    assert cli.main(["service", "uninstall", "--manager", "systemd"]) == 0
    assert set(runner.timeouts) == {install.MAX_COMMAND_WAIT_S}


def test_uninstall_keeps_the_files_when_systemd_refuses_to_stop_the_service(
    fake_home: tuple[Path, FakeRunner], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found in review: with the user manager's bus out of reach (sudo, ssh), ``disable --now`` failed, and
    uninstall removed the unit files anyway and said "uninstalled", the daemon still running. Now it fails with
    exit 6 and the files stay, so that a later uninstall can stop it."""
    home, _ = fake_home
    assert cli.main(["service", "install", "--manager", "systemd"]) == 0
    folder = home / ".config" / "systemd" / "user"
    before = sorted(p.name for p in folder.iterdir())
    monkeypatch.setattr(install, "run_command", FakeRunner(codes={"disable": [1]}))
    capsys.readouterr()
    assert cli.main(["service", "uninstall", "--manager", "systemd"]) == cli.EXIT_SERVICE
    assert "disable --now" in capsys.readouterr().err
    assert sorted(p.name for p in folder.iterdir()) == before


def test_launchd_refuses_a_default_socket_path_macos_cannot_bind(
    short_home: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Found in review: the LaunchAgent's default socket (under ~/Library/Application Support) was not checked:
    under a long home it passed macOS's 103 bytes, launchd could not bind it and the daemon was relaunched every
    30 s. It is refused at install (exit 2), as an explicit ``--socket`` of that length is, by macOS's limit
    wherever the plist is made."""
    from spilld.config import MACOS_SOCKET_PATH_MAX

    tail = "/Library/Application Support/spilld/spilld.sock"
    home = short_home / ("h" * (MACOS_SOCKET_PATH_MAX + 1 - len(str(short_home)) - 1 - len(tail)))
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setattr(install, "run_command", FakeRunner())
    assert len(str(home) + tail) == MACOS_SOCKET_PATH_MAX + 1
    assert cli.main(["service", "install", "--manager", "launchd", "--dry-run"]) == cli.EXIT_USAGE
    assert f"holds at most {MACOS_SOCKET_PATH_MAX}" in capsys.readouterr().err
    assert cli.main(["service", "install", "--manager", "launchd", "--dry-run", "--socket", str(home) + tail]) == 2
    shorter = home.with_name(home.name[:-1])
    shorter.mkdir()
    monkeypatch.setenv("HOME", str(shorter))
    assert cli.main(["service", "install", "--manager", "launchd", "--dry-run"]) == 0  # 103 bytes: taken


@pytest.mark.parametrize("manager", ["systemd", "launchd"])
@pytest.mark.parametrize("option", ["--dir", "--socket"])
@pytest.mark.parametrize("control", ["\n", "\r", "\x01"])
def test_a_control_character_in_a_path_is_refused_never_written_into_a_service_file(
    fake_home: tuple[Path, FakeRunner], capsys: pytest.CaptureFixture[str], manager: str, option: str, control: str
) -> None:
    """Found in review: a newline in --dir or --socket wrote a line of its own into the unit
    (``ExecStartPre=/bin/touch PWNED``), exit 0; launchd's plist failed with an internal error on \\x01."""
    home, runner = fake_home
    bad = f"{home}/a{control}ExecStartPre=/bin/touch {home}/PWNED.sock"
    for dry in (["--dry-run"], []):
        argv = ["service", "install", "--manager", manager, option, bad, *dry]
        assert cli.main(argv) == cli.EXIT_USAGE, argv
        out, err = capsys.readouterr()
        assert "control character" in err and len(err.strip().splitlines()) == 1 and "ExecStartPre" not in out, err
    assert os.listdir(home) == [] and runner.calls == []  # nothing written, nothing loaded
    with pytest.raises(ValueError, match="control character"):
        units.systemd_quote(f"a{control}b")  # nor quoted into a unit by any other way in


@pytest.mark.parametrize("manager", ["systemd", "launchd"])
@pytest.mark.parametrize("option", ["--dir", "--socket"])
def test_a_path_that_is_not_utf8_is_refused_never_an_internal_error(
    fake_home: tuple[Path, FakeRunner], capsys: pytest.CaptureFixture[str], manager: str, option: str
) -> None:
    """Found in review: a byte that is not UTF-8 in --dir (argv holds it as a lone surrogate) passed every check and
    failed as the file was encoded: exit 70, with launchd's dry run too. Refused with exit 2 and nothing written."""
    home, runner = fake_home
    bad = os.fsdecode(os.fsencode(str(home)) + b"/a\xff.sock")
    for dry in (["--dry-run"], []):
        assert cli.main(["service", "install", "--manager", manager, option, bad, *dry]) == cli.EXIT_USAGE
        err = capsys.readouterr().err
        assert "not UTF-8" in err and len(err.strip().splitlines()) == 1, err
    assert os.listdir(home) == [] and runner.calls == []


@pytest.mark.parametrize("manager", ["systemd", "launchd"])
def test_install_serves_spilld_socket_as_every_other_command_reaches_it(
    fake_home: tuple[Path, FakeRunner],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    manager: str,
) -> None:
    """Found in review: `SPILLD_SOCKET=/x/env.sock spilld service install` wrote the default socket, so the service
    served a socket that status, drain and the engines (all of which honour $SPILLD_SOCKET) never reached. It is
    written into the files, as --socket would be, and said; --socket still wins; checked as --socket is."""
    home, _ = fake_home
    env_sock = f"{home}/run/env.sock"
    monkeypatch.setenv("SPILLD_SOCKET", env_sock)
    assert cli.main(["service", "install", "--manager", manager, "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert out.count(env_sock) >= 2 and "$SPILLD_SOCKET" in err, (out, err)  # the daemon's --socket, the listener
    given = f"{home}/run/given.sock"
    assert cli.main(["service", "install", "--manager", manager, "--dry-run", "--socket", given]) == 0
    out, err = capsys.readouterr()
    assert env_sock not in out and given in out and err == ""
    monkeypatch.setenv("SPILLD_SOCKET", "/tmp/spilld-env-test.sock")  # a folder other users can write
    assert cli.main(["service", "install", "--manager", manager, "--dry-run"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "from SPILLD_SOCKET" in err and len(err.strip().splitlines()) == 1, err


def test_install_keeps_the_files_where_xdg_cache_home_names_as_every_other_command_reads_them(
    fake_home: tuple[Path, FakeRunner], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: with $XDG_CACHE_HOME set, `spilld service install` wrote no --dir, so the daemon, started by
    a systemd user manager that seldom has the variable, kept its files in ~/.cache/spilld while `spilld ls` and
    `verify` in the shell that installed it read $XDG_CACHE_HOME/spilld. The folder is written into the unit, as
    $SPILLD_SOCKET is, and said; --dir still wins; launchd's default folder does not follow the variable."""
    home, _ = fake_home
    monkeypatch.setenv("XDG_CACHE_HOME", f"{home}/xdg")
    assert cli.main(["service", "install", "--manager", "systemd", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert f" --dir {home}/xdg/spilld " in out and "$XDG_CACHE_HOME" in err, (out, err)
    assert cli.main(["service", "install", "--manager", "systemd", "--dry-run", "--dir", f"{home}/kv"]) == 0
    out, err = capsys.readouterr()
    assert f" --dir {home}/kv " in out and "xdg" not in out and err == ""
    assert cli.main(["service", "install", "--manager", "launchd", "--dry-run"]) == 0
    out, err = capsys.readouterr()
    assert "--dir" not in out and err == ""
    (home / "file").write_text("x")
    monkeypatch.setenv("XDG_CACHE_HOME", f"{home}/file")  # no folder can be made there: refused now, not at start
    assert cli.main(["service", "install", "--manager", "systemd", "--dry-run"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "from XDG_CACHE_HOME" in err and len(err.strip().splitlines()) == 1, err


# --- daemon options passed through `spilld service install -- OPTIONS` ----------------------------------------

ODD_WORDS = ["a b", 'x"y', "it's", "back\\slash", "%h", "%%", "$X", "${X}", "$$", ";", "", "é", "--", "#x"]


def test_a_units_exec_start_splits_back_into_the_words_it_was_made_of() -> None:
    """systemd_split is the inverse of systemd_quote: what `service status` reads back is what the unit runs."""
    words = (*(f"--remote-host-name={w}" for w in ODD_WORDS), *ODD_WORDS)
    spec = ServiceSpec(command=("/opt/a b/spilld",), dir="/tmp/d %i", serve_args=words)
    line = next(ln for ln in units.systemd_service(spec).splitlines() if ln.startswith("ExecStart="))
    assert units.systemd_split(line.removeprefix("ExecStart=")) == spec.argv()
    assert spec.argv()[-len(words) :] == list(words)  # after install's own, --drain-deadline first of its name


def test_units_with_serve_options_pass_systemd_analyze_verify(tmp_path: Path) -> None:
    spec = ServiceSpec(serve_args=("--metrics-file", "/tmp/a dir/%h $X;.prom", "--log-level", "debug"))
    (tmp_path / units.SERVICE_NAME).write_text(units.systemd_service(spec))
    (tmp_path / units.SOCKET_NAME).write_text(units.systemd_socket(spec))
    r = analyze(tmp_path)
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr


@pytest.fixture
def elsewhere(fake_home: tuple[Path, FakeRunner], monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A working folder other than the home (so that nothing an install writes hides among its files), with a
    folder for a metrics file and a 0600 password file."""
    cwd = Path(tempfile.mkdtemp(prefix="spilld-cwd-", dir="/tmp"))
    (cwd / "prom dir").mkdir()
    (cwd / "pw").write_text("secret\n")
    (cwd / "pw").chmod(0o600)
    monkeypatch.chdir(cwd)
    yield cwd
    shutil.rmtree(cwd, ignore_errors=True)


def serve_args_of(argv: list[str]) -> Any:
    """``argv`` (a service's command) as `spilld serve` parses it: the round trip."""
    assert argv[1] == "serve", argv
    args = cli.build_parser().parse_args(argv[1:])
    assert args.func.__name__ == "cmd_serve"
    return args


@pytest.mark.parametrize("manager", ["systemd", "launchd"])
def test_install_passes_the_options_after_dashes_to_the_daemon(
    fake_home: tuple[Path, FakeRunner], elsewhere: Path, capsys: pytest.CaptureFixture[str], manager: str
) -> None:
    """`spilld service install -- OPTIONS`: every daemon option reaches the service, quoted for systemd, a word of
    ProgramArguments for launchd, a file's relative path made absolute (the service runs elsewhere); --dry-run shows
    them, `service status` says what the service runs, and the command parses back through serve's own parser."""
    from spilld.config import parse_size

    home, runner = fake_home
    metrics = "prom dir/%h $X;.prom"
    options = [
        "--write-budget", "50GiB", "--durability=full", "--metrics-file", metrics, "--block-tokens", "128",
        "--remote", "redis://cache.local:6379/0", "--remote-password-file=pw", "--remote-host-name", 'a "b" c',
    ]  # fmt: skip
    argv = ["service", "install", "--manager", manager, "--cap", "2GiB"]
    assert cli.main([*argv, "--dry-run", "--", *options]) == 0
    shown = capsys.readouterr().out
    assert not list(home.iterdir()) and runner.calls == []
    assert cli.main([*argv, "--", *options]) == 0
    if manager == "systemd":
        text = (home / ".config" / "systemd" / "user" / units.SERVICE_NAME).read_text()
        line = next(ln for ln in text.splitlines() if ln.startswith("ExecStart="))
        assert f'--metrics-file "{elsewhere}/prom dir/%%h $$X;.prom"' in line, line  # quoted, literal
        assert '--remote-host-name "a \\"b\\" c"' in line, line
        written = units.systemd_split(line.removeprefix("ExecStart="))
    else:
        text = (home / "Library" / "LaunchAgents" / units.PLIST_NAME).read_text()
        written = plistlib.loads(text.encode())["ProgramArguments"]
    assert text.rstrip() in shown  # what --dry-run showed is what was written
    tail = written[written.index("--drain-deadline") + 2 :]
    assert tail == [
        "--write-budget", "50GiB", "--durability=full", "--metrics-file", f"{elsewhere}/{metrics}", "--block-tokens",
        "128", "--remote", "redis://cache.local:6379/0", "--remote-password-file", f"{elsewhere}/pw",
        "--remote-host-name", 'a "b" c',
    ]  # fmt: skip
    assert "secret" not in text  # the password file's path, never its password
    args = serve_args_of(written)
    assert (args.cap, args.write_budget, args.durability, args.block_tokens) == (
        2 << 30,
        parse_size("50GiB"),
        "full",
        128,
    )
    assert args.metrics_file == f"{elsewhere}/{metrics}" and args.remote_host_name == 'a "b" c'
    capsys.readouterr()
    assert cli.main(["service", "status", "--manager", manager]) == 0
    out = capsys.readouterr().out
    assert "runs: " in out and "--write-budget 50GiB" in out and f"{elsewhere}/pw" in out, out


@pytest.mark.parametrize("manager", ["systemd", "launchd"])
@pytest.mark.parametrize(
    ("options", "said"),
    [
        (["--durability", "bogus"], "invalid choice: 'bogus'"),
        (["--no-such-option"], "unrecognized arguments: --no-such-option"),
        (["--write", "5G"], "each option in full"),  # serve takes the abbreviation; a unit must not
        (["--write-budget", "0"], "at least 1 byte"),
        (["--block-tokens", "3"], "block tokens must be"),  # refused by Config, as serve refuses it
        (["--metrics-file", "no/such/folder/m.prom"], "its folder does not exist"),
        (["--remote-key-file", "pw"], "without --remote"),
        (["--remote", "redis://user:hunter2@cache.local:6379/0"], "holds a password"),
        (["--remote", "redis://cache.local/0", "--remote-password-file", "no-such-file"], "cannot be opened"),
        (["--remote", "rediss://cache.local/0?ssl_ca_certs=ca.pem"], "ssl_ca_certs=ca.pem is a relative path"),
        (["--remote", "rediss://cache.local/0?ssl_keyfile=k.pem"], "ssl_keyfile=k.pem is a relative path"),
        (["--cap", "2GiB"], "--cap is an option of install's own"),
        (["--drain-deadline", "5"], "--drain-deadline is an option of install's own"),
        (["--dir", "/tmp/x", "--socket=/tmp/x.sock"], "--dir, --socket are options of install's own"),
        (["--metrics-file", "prom dir/a\nExecStartPre=x.prom"], "control character"),
        (["--metrics-file", os.fsdecode(b"prom dir/\xff.prom")], "not UTF-8"),
        (["--log-level", "debug", "--"], "unrecognized arguments: --"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_install_refuses_options_after_dashes_the_daemon_would_refuse_or_install_owns(
    fake_home: tuple[Path, FakeRunner],
    elsewhere: Path,
    capsys: pytest.CaptureFixture[str],
    manager: str,
    options: list[str],
    said: str,
) -> None:
    """A daemon option passed to the service is checked at install by serve's own parser and settings, or the
    service would fail at every start (launchd restarts it every 30 s): one line, exit 2, nothing written or run.
    install's own options are refused there too, naming the option to use; a password never lands in a file."""
    home, runner = fake_home
    for dry in (["--dry-run"], []):
        argv = ["service", "install", "--manager", manager, *dry, "--", *options]
        assert cli.main(argv) == cli.EXIT_USAGE, argv
        out, err = capsys.readouterr()
        assert said in err and len(err.strip().splitlines()) == 1 and out == "", (out, err)
        assert "hunter2" not in err
    assert list(home.iterdir()) == [] and runner.calls == []


def test_install_refuses_options_after_dashes_in_a_real_process(short_home: Path) -> None:
    """The same through the console entry point (argv split before argparse sees it): one line, exit 2."""
    env = {**os.environ, "HOME": str(short_home), "PYTHONPATH": str(ROOT)}
    for tail in (["--", "--durability", "bogus"], ["--", "--cap", "1G"]):
        r = subprocess.run(
            [sys.executable, "-m", "spilld", "--socket", f"{short_home}/s.sock", "service", "install", "--manager",
             "systemd", *tail],
            capture_output=True, text=True, env=env, timeout=60,
        )  # fmt: skip
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert "after --" in r.stderr and r.stdout == ""
    assert list(short_home.iterdir()) == []


def test_install_dashes_help_shows_serves_options_and_installs_nothing(
    fake_home: tuple[Path, FakeRunner], capsys: pytest.CaptureFixture[str]
) -> None:
    home, runner = fake_home
    assert cli.main(["service", "install", "--manager", "systemd", "--", "--help"]) == 0
    assert "usage: spilld serve" in capsys.readouterr().out
    assert list(home.iterdir()) == [] and runner.calls == []


def test_a_reinstall_with_other_options_after_dashes_replaces_them(
    fake_home: tuple[Path, FakeRunner], elsewhere: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Each install states the whole service: a reinstall writes its own options (none without `--`) in place of
    the old ones, and restarts a running daemon with them, as a reinstall with another --cap does."""
    home, runner = fake_home
    unit = home / ".config" / "systemd" / "user" / units.SERVICE_NAME
    base = ["service", "install", "--manager", "systemd"]
    assert cli.main([*base, "--", "--durability", "none"]) == 0
    assert "--durability none" in unit.read_text()
    runner.calls.clear()
    assert cli.main([*base, "--", "--log-level", "debug"]) == 0
    text = unit.read_text()
    assert "--log-level debug" in text and "--durability" not in text
    assert ["systemctl", "--user", "try-restart", units.SERVICE_NAME] in runner.calls
    assert cli.main(base) == 0
    assert "--log-level" not in unit.read_text()


def test_install_says_the_service_does_not_see_the_shells_remote_password(
    fake_home: tuple[Path, FakeRunner],
    elsewhere: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """$SPILLD_REMOTE_PASSWORD of the installing shell is never written into a service file: install says so,
    and names the way to give the service a password."""
    home, _ = fake_home
    monkeypatch.setenv("SPILLD_REMOTE_PASSWORD", "hunter2")
    assert cli.main(["service", "install", "--manager", "systemd", "--", "--remote", "redis://cache.local/0"]) == 0
    err = capsys.readouterr().err
    assert "$SPILLD_REMOTE_PASSWORD" in err and "--remote-password-file" in err, err
    for path in (home / ".config" / "systemd" / "user").iterdir():
        assert "hunter2" not in path.read_text()
    args = ["service", "install", "--manager", "systemd", "--", "--remote", "redis://cache.local/0"]
    assert cli.main([*args, "--remote-password-file", "pw"]) == 0
    assert "SPILLD_REMOTE_PASSWORD" not in capsys.readouterr().err


def test_a_daemon_option_given_to_install_without_dashes_is_refused_with_where_it_goes(
    fake_home: tuple[Path, FakeRunner], capsys: pytest.CaptureFixture[str]
) -> None:
    """Found in review: `service install --remote URL` said only "unrecognized arguments"; the line now says that
    the daemon's other options go after `--`. Other commands' refusals say no such thing."""
    home, runner = fake_home
    assert cli.main(["service", "install", "--dry-run", "--remote", "redis://h:6379/0"]) == cli.EXIT_USAGE
    err = capsys.readouterr().err
    assert "unrecognized arguments: --remote" in err and "go after `--`" in err and len(err.splitlines()) == 1, err
    assert list(home.iterdir()) == [] and runner.calls == []
    assert cli.main(["ls", "--remote", "x"]) == cli.EXIT_USAGE
    assert "go after" not in capsys.readouterr().err
