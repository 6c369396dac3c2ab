"""``spilld service install|uninstall|status``: put the service files in place and tell the manager.

Each action is first built as a :class:`Plan` (files to write or remove, commands to run); ``--dry-run``
prints the plan, otherwise it is carried out. Commands go through a runner so tests can see them without
running ``launchctl`` or ``systemctl``.

A command that stops the daemon (``bootout``, ``disable --now``, ``try-restart``) waits for its drain, so
commands may run as long as the longest stop plus a margin for the start. One that runs longer is a failure
like a refused command: a message, and ``spilld service`` exits 6.
"""

from __future__ import annotations

import math
import os
import plistlib
import shlex
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal, TextIO

from ..config import check_duration
from . import units
from .units import ServiceSpec

Manager = Literal["launchd", "systemd"]
# (argv, timeout in seconds) -> the finished command; raises subprocess.TimeoutExpired past the timeout
Runner = Callable[[Sequence[str], float], subprocess.CompletedProcess[str]]

# A command may run the longest stop plus this: `try-restart` and `enable --now` also wait for the start,
# which ends at READY=1, after the index scan (TimeoutStartSec= is 90 s by default).
COMMAND_MARGIN_S = 90
QUERY_TIMEOUT_S = 30  # `launchctl print`, `systemctl is-active`: nothing to wait for
# The longest wait for one command: poll() takes at most 2**31 ms (found in review: a 25-day drain deadline made
# the wait overflow, an internal error halfway through an install, and every later uninstall failed the same way)
MAX_COMMAND_WAIT_S = 24 * 86_400
POLL_S = 0.5  # between looks at a job that is still unloading
RETRIES = 4  # more tries of a step whose exit code says "not yet" (bootstrap's 5 while the old job unloads)
RETRY_PAUSE_S = 1.0


def run_command(argv: Sequence[str], timeout: float) -> subprocess.CompletedProcess[str]:
    """The real runner: run a command, capture its output; a missing program reads as exit 127."""
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError as exc:
        return subprocess.CompletedProcess(list(argv), 127, "", str(exc))


def default_manager() -> Manager | None:
    if sys.platform == "darwin":
        return "launchd"
    return "systemd" if sys.platform.startswith("linux") else None


@dataclass
class Step:
    """One command. ``may_fail``: its failure does not stop the plan (unloading what is not loaded).
    ``until_fails``: run it every POLL_S until it fails, for at most the plan's ``stop_s`` (a job's
    ``launchctl print``, until the job is gone). ``retry_on``: exit codes after which it is tried again,
    up to RETRIES more times."""

    argv: list[str]
    may_fail: bool = False
    until_fails: bool = False
    retry_on: tuple[int, ...] = ()
    why: str = ""  # said after the command in a --dry-run


@dataclass
class Plan:
    write: dict[Path, str] = field(default_factory=dict)
    remove: list[Path] = field(default_factory=list)
    folders: list[Path] = field(default_factory=list)  # missing folders, created 0700 before anything runs
    before: list[Step] = field(default_factory=list)  # run before the files change
    after: list[Step] = field(default_factory=list)  # run after
    undo: list[Step] = field(default_factory=list)  # run after the files are put back (a command of `after` failed)
    foreign: list[Path] = field(default_factory=list)  # files at our names that spilld did not write: never touched
    notes: list[str] = field(default_factory=list)  # said once the plan is carried out (a unit it restarted)
    stop_s: float = units.stop_timeout_s(units.DRAIN_DEADLINE_S)  # the longest a stop of the daemon may take

    @property
    def refuse(self) -> bool:
        """It would replace a file spilld did not write: nothing is done."""
        return any(p in self.write for p in self.foreign)

    @property
    def command_timeout_s(self) -> float:
        return min(self.stop_s + COMMAND_MARGIN_S, MAX_COMMAND_WAIT_S)


def config_home(home: Path) -> Path:
    return Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config")


def unit_dir(home: Path) -> Path:
    return config_home(home) / "systemd" / "user"


def plist_path(home: Path) -> Path:
    return home / "Library" / "LaunchAgents" / units.PLIST_NAME


def _domain() -> str:
    return f"gui/{os.getuid()}"


MARKER_READ_BYTES = 1 << 20  # a unit or plist is small; the marker is in its first lines


def _head(path: Path) -> bytes:
    """The first ``MARKER_READ_BYTES`` of a regular file (not a link, a FIFO or a device: OSError)."""
    if not stat.S_ISREG(path.lstat().st_mode):
        raise OSError(f"{path} is not a regular file")
    with path.open("rb") as f:
        return f.read(MARKER_READ_BYTES)


def written_by_spilld(path: Path) -> bool:
    """A regular file (not a link) that carries ``units.MARKER``: one spilld wrote, so one it may replace or
    remove. A user's own file of the same name, or a link to one kept elsewhere, is not."""
    try:
        return units.MARKER.encode() in _head(path)
    except OSError:
        return False


def _foreign(paths: Sequence[Path]) -> list[Path]:
    return [p for p in paths if file_state(p) == "yours"]


def installed_files(manager: Manager, home: Path) -> list[Path]:
    if manager == "launchd":
        return [plist_path(home)]
    return [unit_dir(home) / units.SERVICE_NAME, unit_dir(home) / units.SOCKET_NAME]


def installed_argv(manager: Manager, path: Path) -> list[str]:
    """The command an installed plist or unit runs (ProgramArguments, ExecStart=); an exception where there is none
    to read (not a regular file, no such key or line, a quote left open)."""
    head = _head(path)  # (a unit or plist spilld wrote is small: a larger one is not ours)
    if manager == "launchd":
        return [str(a) for a in plistlib.loads(head)["ProgramArguments"]]
    line = next(ln for ln in head.decode().splitlines() if ln.startswith("ExecStart="))
    return units.systemd_split(line.removeprefix("ExecStart="))


def _drain_deadline(manager: Manager, path: Path) -> float:
    """The ``--drain-deadline`` an installed plist or unit passes to the daemon."""
    argv = installed_argv(manager, path)
    return check_duration(float(argv[argv.index("--drain-deadline") + 1]), "--drain-deadline")


def installed_stop_s(manager: Manager, home: Path) -> float:
    """The longest stop of the installed daemon (what a command that stops it may have to wait)."""
    try:
        deadline = _drain_deadline(manager, installed_files(manager, home)[0])
    except Exception:  # not installed, or a file we did not write: the default deadline
        deadline = units.DRAIN_DEADLINE_S
    return units.stop_timeout_s(deadline)


def missing_folders(folders: list[Path]) -> list[Path]:
    """The folders that do not exist yet, each once: only those are ours to create (0700). One that exists,
    such as the home folder that holds ``--socket ~/spilld.sock``, keeps its mode."""
    out: list[Path] = []
    for f in folders:
        if not f.exists() and f not in out:
            out.append(f)
    return out


def install_plan(manager: Manager, spec: ServiceSpec, home: Path) -> Plan:
    """Files and commands that install the service and start it."""
    stop_s = max(spec.stop_timeout_s, installed_stop_s(manager, home))  # a reinstall stops the old daemon
    if manager == "launchd":
        plist = plist_path(home)
        target = f"{_domain()}/{units.LABEL}"
        bootstrap = Step(["launchctl", "bootstrap", _domain(), str(plist)], retry_on=(5,))
        return Plan(
            write={plist: units.launchd_plist(spec, home)},
            foreign=_foreign([plist]),
            folders=missing_folders([units.launchd_log(home).parent, Path(units.launchd_socket(spec, home)).parent]),
            before=[
                Step(["launchctl", "bootout", target], may_fail=True),  # a reinstall replaces the old job
                # the old job may still be unloading, and a bootstrap meanwhile fails with 5 (I/O error)
                Step(["launchctl", "print", target], until_fails=True),
            ],
            after=[Step(["launchctl", "enable", target]), bootstrap],
            # a failed reinstall put the old plist back: its job, booted out above, is loaded again (found in
            # review: the service stayed down though the files were 'rolled back')
            undo=[replace(bootstrap, may_fail=True)] if written_by_spilld(plist) else [],
            stop_s=stop_s,
        )
    folder = unit_dir(home)
    write = {folder / units.SERVICE_NAME: units.systemd_service(spec)}
    names, before, restart, notes = [units.SERVICE_NAME], [], [units.SERVICE_NAME], []
    if spec.socket_activation:
        socket_unit = folder / units.SOCKET_NAME
        write[socket_unit] = units.systemd_socket(spec)
        names.insert(0, units.SOCKET_NAME)
        # A running socket unit keeps the socket it listens on through daemon-reload and `enable --now` (found in
        # review: a reinstall with another --socket left it on the old path): one whose unit changes is restarted,
        # and a running daemon with it (it holds the old socket's fd)
        if _changed(socket_unit, write[socket_unit]):
            restart.insert(0, units.SOCKET_NAME)
            notes.append(
                f"{units.SOCKET_NAME} changed: restarted, it listens on {units.systemd_listen(spec)} now (a running "
                f"{units.SERVICE_NAME} restarted with it)"
            )
    elif written_by_spilld(folder / units.SOCKET_NAME):  # an earlier install's would hold the path the daemon binds
        before.append(Step(["systemctl", "--user", "disable", "--now", units.SOCKET_NAME], may_fail=True))
    stale = [p for p in installed_files(manager, home) if p not in write]
    # the old units again after a failed reinstall: a socket restarted on the new path must be restarted on the old
    back = "restart" if units.SOCKET_NAME in restart else "start"
    return Plan(
        write=write,
        remove=[p for p in stale if written_by_spilld(p)],
        foreign=_foreign([*write, *stale]),  # a stale file of the user's is only left alone
        before=before,
        after=[
            Step(["systemctl", "--user", "daemon-reload"]),
            # a reinstall over a running daemon: it drains and comes back with the new unit
            Step(
                ["systemctl", "--user", "try-restart", *restart],
                may_fail=True,
                why=f"{units.SOCKET_NAME} changed: it listens anew, as its new unit says" if len(restart) > 1 else "",
            ),
            Step(["systemctl", "--user", "enable", "--now", *names]),
        ],
        undo=[
            Step(["systemctl", "--user", "daemon-reload"], may_fail=True),  # the manager sees the old files again
            # a failed reinstall: the daemon its try-restart stopped comes back with the old units (review)
            *([Step(["systemctl", "--user", back, *old], may_fail=True)] if (old := _ours(folder)) else []),
        ],
        notes=notes,
        stop_s=stop_s,
    )


def _changed(path: Path, text: str) -> bool:
    """An earlier install of ours left ``path`` holding other than ``text`` (a new file is no change: nothing
    listens on its behalf yet)."""
    try:
        return written_by_spilld(path) and _head(path) != text.encode()
    except OSError:  # gone meanwhile: nothing to restart
        return False


def _ours(folder: Path) -> list[str]:
    """The units an earlier install of ours left in ``folder`` (the socket first)."""
    return [n for n in (units.SOCKET_NAME, units.SERVICE_NAME) if written_by_spilld(folder / n)]


def uninstall_plan(manager: Manager, home: Path) -> Plan:
    """Commands that stop and disable the service (the daemon drains), then the files go."""
    every, stop_s = installed_files(manager, home), installed_stop_s(manager, home)
    files, foreign = [p for p in every if written_by_spilld(p)], _foreign(every)
    if not files:  # nothing of ours: no command either (a user's own job of that name is theirs to stop)
        return Plan(foreign=foreign, stop_s=stop_s)
    if manager == "launchd":
        target = f"{_domain()}/{units.LABEL}"
        bootout = [Step(["launchctl", "bootout", target], may_fail=True)]
        return Plan(remove=files, foreign=foreign, before=bootout, stop_s=stop_s)
    names = [p.name for p in files]
    return Plan(
        remove=files,
        foreign=foreign,
        # must succeed: our unit files are there, so only an unreachable manager refuses, and removing the files
        # then would leave the daemon running with nothing to stop it by (found in review: reported uninstalled)
        before=[Step(["systemctl", "--user", "disable", "--now", *names])],
        after=[Step(["systemctl", "--user", "daemon-reload"], may_fail=True)],
        stop_s=stop_s,
    )


def _write_atomic(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)  # launchd refuses a plist others can write
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _run_step(step: Step, plan: Plan, runner: Runner, sleep: Callable[[float], None]) -> str | None:
    """Carry out one step: None, or why it failed."""
    timeout = plan.command_timeout_s
    if step.until_fails:
        for _ in range(math.ceil(plan.stop_s / POLL_S)):
            if runner(step.argv, timeout).returncode != 0:
                return None
            sleep(POLL_S)
        return f"still finds the job after {plan.stop_s:g} s: it has not unloaded"
    r = runner(step.argv, timeout)
    for _ in range(RETRIES if step.retry_on else 0):
        if r.returncode not in step.retry_on:
            break
        sleep(RETRY_PAUSE_S)
        r = runner(step.argv, timeout)
    if r.returncode == 0 or step.may_fail:
        return None
    return f"failed ({r.returncode}): {(r.stderr or r.stdout).strip()}"


def _run_steps(steps: list[Step], plan: Plan, runner: Runner, err: TextIO, sleep: Callable[[float], None]) -> bool:
    for step in steps:
        try:
            why = _run_step(step, plan, runner, sleep)
        except subprocess.TimeoutExpired as exc:  # even for a step that may fail: the stop is still under way
            why = f"did not finish within {exc.timeout:g} s (a stop waits for the drain): see `spilld service status`"
        if why is not None:
            print(f"spilld: `{shlex.join(step.argv)}` {why}", file=err)
            return False
    return True


def _show_step(step: Step, plan: Plan, out: TextIO) -> None:
    note = ""
    if step.until_fails:
        note = f"  # again every {POLL_S:g} s until it fails, for at most {plan.stop_s:g} s"
    elif step.retry_on:
        note = f"  # again on exit {', '.join(map(str, step.retry_on))}, up to {RETRIES} times"
    elif step.why:
        note = f"  # {step.why}"
    print(f"$ {shlex.join(step.argv)}{note}", file=out)


def show(plan: Plan, out: TextIO) -> None:
    """Print the plan: every file in full, then every command (what --dry-run shows)."""
    for path in plan.foreign:
        why = "refused: it exists" if path in plan.write else "left alone:"
        print(
            f"# {why} {path} was not written by spilld service install (it lacks the line {units.MARKER!r})", file=out
        )
    if plan.refuse:
        return
    for folder in plan.folders:
        print(f"# create folder {folder} (0700)", file=out)
    for step in plan.before:
        _show_step(step, plan, out)
    for path, text in plan.write.items():
        print(f"# write {path}\n{text.rstrip()}\n", file=out)
    for path in plan.remove:
        print(f"# remove {path}", file=out)
    for step in plan.after:
        _show_step(step, plan, out)
    if plan.write:
        print("# if one of these commands fails, the files are put back as they were, then:", file=out)
        for step in plan.undo:
            _show_step(step, plan, out)
    print(f"# each command may run {plan.command_timeout_s:g} s (a stop waits for the daemon's drain)", file=out)


def apply(plan: Plan, runner: Runner, err: TextIO, sleep: Callable[[float], None] = time.sleep) -> bool:
    """Carry the plan out; False (with a message) when a command that must succeed failed or timed out, or when
    the install would replace a file spilld did not write (then nothing is done)."""
    for path in plan.foreign:
        if path in plan.write:
            print(f"spilld: {path} exists and was not written by spilld service install: move it away first", file=err)
        else:
            print(f"spilld: left alone (not written by spilld service install): {path}", file=err)
    if plan.refuse:
        return False
    saved = _saved_files(plan)  # before any command: a file that cannot be read stops nothing half done
    made = _new_folders(plan)  # a rollback removes them too (found in review: they were left behind)
    for folder in plan.folders:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)  # one made meanwhile by someone else keeps its mode
    if not _run_steps(plan.before, plan, runner, err, sleep):
        return False
    for path, text in plan.write.items():
        _write_atomic(path, text.encode())
    for path in plan.remove:
        path.unlink(missing_ok=True)
    if _run_steps(plan.after, plan, runner, err, sleep):
        return True
    _roll_back(saved, plan, runner, err, sleep, made)
    return False


def _new_folders(plan: Plan) -> list[Path]:
    """The folders carrying out ``plan`` will make (each missing one up the chain of its folders and of its files'),
    the deepest first."""
    out: list[Path] = []
    for start in [*plan.folders, *(p.parent for p in plan.write)]:
        for d in [start, *start.parents]:
            if d.exists():
                break
            if d not in out:
                out.append(d)
    return sorted(out, key=lambda d: len(d.parts), reverse=True)


def _saved_files(plan: Plan) -> dict[Path, bytes | None]:
    """What each file the plan writes or removes holds now (None: absent), to put back if the manager refuses:
    its bytes, whatever they are (a binary plist is one launchd reads)."""
    saved: dict[Path, bytes | None] = {}
    for path in [*plan.write, *plan.remove]:
        try:
            saved[path] = path.read_bytes()
        except FileNotFoundError:
            saved[path] = None
    return saved


def _roll_back(
    saved: dict[Path, bytes | None],
    plan: Plan,
    runner: Runner,
    err: TextIO,
    sleep: Callable[[float], None],
    made: Sequence[Path] = (),
) -> None:
    """Put every file back as it was before the plan (the manager refused a command), and remove the folders it
    made (``made``, left empty), and say so; a file that cannot be put back is named with how to remove it."""
    removed, restored, left = [], [], []
    for path, data in saved.items():
        try:
            if data is None:
                if path.exists():
                    path.unlink()
                    removed.append(path)
            elif not path.exists() or path.read_bytes() != data:
                _write_atomic(path, data)
                restored.append(path)
        except OSError:
            left.append(path)
    for folder in made:  # the deepest first; one that is not empty (someone put a file there meanwhile) stays
        try:
            folder.rmdir()
            removed.append(folder)
        except OSError:
            pass
    _run_steps(plan.undo, plan, runner, err, sleep)
    if removed or restored:
        done = [*(f"removed {p}" for p in removed), *(f"restored {p}" for p in restored)]
        print(f"spilld: rolled back: {'; '.join(done)}", file=err)
    if left:
        names = " ".join(shlex.quote(str(p)) for p in left)
        print(f"spilld: left in place: {names} (remove with `rm {names}`, or `spilld service uninstall`)", file=err)


FileState = Literal["installed", "yours", "missing"]  # written by spilld; a user's own of that name; absent


@dataclass
class Status:
    files: dict[Path, FileState]
    loaded: bool
    detail: list[str]

    @property
    def installed(self) -> bool:
        """A unit or plist of spilld's name is in place (ours, or one a user installed by hand)."""
        return any(state != "missing" for state in self.files.values())


def file_state(path: Path) -> FileState:
    if not os.path.lexists(path):
        return "missing"
    return "installed" if written_by_spilld(path) else "yours"


def _ask(runner: Runner, argv: list[str]) -> subprocess.CompletedProcess[str]:
    """A query; one that hangs reads as a failure with no answer."""
    try:
        return runner(argv, QUERY_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return subprocess.CompletedProcess(argv, 124, "", f"no answer within {QUERY_TIMEOUT_S} s")


def _runs(manager: Manager, home: Path) -> list[str]:
    """``runs: COMMAND``, the command the installed plist or unit of ours runs (its daemon options with it); none
    where that file is missing, not ours, or unreadable."""
    path = installed_files(manager, home)[0]
    if not written_by_spilld(path):
        return []
    try:
        return [f"runs: {shlex.join(installed_argv(manager, path))}"]
    except Exception:  # edited into something we cannot read: status still answers
        return []


def status(manager: Manager, home: Path, runner: Runner) -> Status:
    """Which files are in place, the command the service runs, and whether the manager has the job loaded (asks,
    changes nothing)."""
    files = {p: file_state(p) for p in installed_files(manager, home)}
    if manager == "launchd":
        r = _ask(runner, ["launchctl", "print", f"{_domain()}/{units.LABEL}"])
        state = next((ln.strip() for ln in r.stdout.splitlines() if ln.strip().startswith("state =")), "")
        loaded = f"launchd: {'loaded' if r.returncode == 0 else 'not loaded'} {state}"
        return Status(files, r.returncode == 0, [*_runs(manager, home), loaded])
    detail, active = _runs(manager, home), False
    for unit in (units.SOCKET_NAME, units.SERVICE_NAME):
        enabled = _ask(runner, ["systemctl", "--user", "is-enabled", unit]).stdout.strip() or "unknown"
        state = _ask(runner, ["systemctl", "--user", "is-active", unit]).stdout.strip() or "unknown"
        active = active or state == "active"
        detail.append(f"{unit}: {enabled}, {state}")
    return Status(files, active, detail)
