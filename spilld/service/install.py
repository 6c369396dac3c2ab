"""``spilld service install|uninstall|status``: put the service files in place and tell the manager.

Each action is first built as a :class:`Plan` (files to write or remove, commands to run); ``--dry-run``
prints the plan, otherwise it is carried out. Commands go through a runner so tests can see them without
running ``launchctl`` or ``systemctl``.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, TextIO

from . import units
from .units import ServiceSpec

Manager = Literal["launchd", "systemd"]
Runner = Callable[[Sequence[str]], subprocess.CompletedProcess[str]]


def run_command(argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    """The real runner: run a command, capture its output; a missing program reads as exit 127."""
    try:
        return subprocess.run(list(argv), capture_output=True, text=True, timeout=120)
    except FileNotFoundError as exc:
        return subprocess.CompletedProcess(list(argv), 127, "", str(exc))


def default_manager() -> Manager | None:
    if sys.platform == "darwin":
        return "launchd"
    return "systemd" if sys.platform.startswith("linux") else None


@dataclass
class Step:
    """One command; a step that may fail (unloading what is not loaded) does not stop the plan."""

    argv: list[str]
    may_fail: bool = False


@dataclass
class Plan:
    write: dict[Path, str] = field(default_factory=dict)
    remove: list[Path] = field(default_factory=list)
    folders: list[Path] = field(default_factory=list)  # created 0700 before anything runs
    before: list[Step] = field(default_factory=list)  # run before the files change
    after: list[Step] = field(default_factory=list)  # run after


def config_home(home: Path) -> Path:
    return Path(os.environ.get("XDG_CONFIG_HOME") or home / ".config")


def unit_dir(home: Path) -> Path:
    return config_home(home) / "systemd" / "user"


def plist_path(home: Path) -> Path:
    return home / "Library" / "LaunchAgents" / units.PLIST_NAME


def _domain() -> str:
    return f"gui/{os.getuid()}"


def installed_files(manager: Manager, home: Path) -> list[Path]:
    if manager == "launchd":
        return [plist_path(home)]
    return [unit_dir(home) / units.SERVICE_NAME, unit_dir(home) / units.SOCKET_NAME]


def install_plan(manager: Manager, spec: ServiceSpec, home: Path) -> Plan:
    """Files and commands that install the service and start it."""
    if manager == "launchd":
        plist = plist_path(home)
        target = f"{_domain()}/{units.LABEL}"
        return Plan(
            write={plist: units.launchd_plist(spec, home)},
            folders=[units.launchd_log(home).parent, Path(units.launchd_socket(spec, home)).parent],
            before=[Step(["launchctl", "bootout", target], may_fail=True)],  # a reinstall replaces the old job
            after=[Step(["launchctl", "enable", target]), Step(["launchctl", "bootstrap", _domain(), str(plist)])],
        )
    folder = unit_dir(home)
    write = {folder / units.SERVICE_NAME: units.systemd_service(spec)}
    names, before = [units.SERVICE_NAME], []
    if spec.socket_activation:
        write[folder / units.SOCKET_NAME] = units.systemd_socket(spec)
        names.insert(0, units.SOCKET_NAME)
    else:  # a socket unit from an earlier install would hold the path the daemon now binds itself
        before.append(Step(["systemctl", "--user", "disable", "--now", units.SOCKET_NAME], may_fail=True))
    return Plan(
        write=write,
        remove=[p for p in installed_files(manager, home) if p not in write],
        before=before,
        after=[
            Step(["systemctl", "--user", "daemon-reload"]),
            # a reinstall over a running daemon: it drains and comes back with the new unit
            Step(["systemctl", "--user", "try-restart", units.SERVICE_NAME], may_fail=True),
            Step(["systemctl", "--user", "enable", "--now", *names]),
        ],
    )


def uninstall_plan(manager: Manager, home: Path) -> Plan:
    """Commands that stop and disable the service (the daemon drains), then the files go."""
    files = installed_files(manager, home)
    if manager == "launchd":
        return Plan(remove=files, before=[Step(["launchctl", "bootout", f"{_domain()}/{units.LABEL}"], may_fail=True)])
    return Plan(
        remove=files,
        before=[
            Step(["systemctl", "--user", "disable", "--now", units.SERVICE_NAME, units.SOCKET_NAME], may_fail=True)
        ],
        after=[Step(["systemctl", "--user", "daemon-reload"], may_fail=True)],
    )


def _write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.chmod(tmp, 0o644)  # launchd refuses a plist others can write
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _run_steps(steps: list[Step], runner: Runner, err: TextIO) -> bool:
    for step in steps:
        r = runner(step.argv)
        if r.returncode != 0 and not step.may_fail:
            print(
                f"spilld: `{shlex.join(step.argv)}` failed ({r.returncode}): {(r.stderr or r.stdout).strip()}", file=err
            )
            return False
    return True


def show(plan: Plan, out: TextIO) -> None:
    """Print the plan: every file in full, then every command (what --dry-run shows)."""
    for folder in plan.folders:
        print(f"# create folder {folder} (0700)", file=out)
    for step in plan.before:
        print(f"$ {shlex.join(step.argv)}", file=out)
    for path, text in plan.write.items():
        print(f"# write {path}\n{text.rstrip()}\n", file=out)
    for path in plan.remove:
        print(f"# remove {path}", file=out)
    for step in plan.after:
        print(f"$ {shlex.join(step.argv)}", file=out)


def apply(plan: Plan, runner: Runner, err: TextIO) -> bool:
    """Carry the plan out; False (with a message) when a command that must succeed failed."""
    for folder in plan.folders:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        folder.chmod(0o700)  # an existing folder too: the socket's folder is what keeps other users out
    if not _run_steps(plan.before, runner, err):
        return False
    for path, text in plan.write.items():
        _write_atomic(path, text)
    for path in plan.remove:
        path.unlink(missing_ok=True)
    return _run_steps(plan.after, runner, err)


@dataclass
class Status:
    files: dict[Path, bool]
    loaded: bool
    detail: list[str]

    @property
    def installed(self) -> bool:
        return any(self.files.values())


def status(manager: Manager, home: Path, runner: Runner) -> Status:
    """Which files are in place and whether the manager has the job loaded (asks, changes nothing)."""
    files = {p: p.exists() for p in installed_files(manager, home)}
    if manager == "launchd":
        r = runner(["launchctl", "print", f"{_domain()}/{units.LABEL}"])
        state = next((ln.strip() for ln in r.stdout.splitlines() if ln.strip().startswith("state =")), "")
        return Status(files, r.returncode == 0, [f"launchd: {'loaded' if r.returncode == 0 else 'not loaded'} {state}"])
    detail, active = [], False
    for unit in (units.SOCKET_NAME, units.SERVICE_NAME):
        enabled = runner(["systemctl", "--user", "is-enabled", unit]).stdout.strip() or "unknown"
        state = runner(["systemctl", "--user", "is-active", unit]).stdout.strip() or "unknown"
        active = active or state == "active"
        detail.append(f"{unit}: {enabled}, {state}")
    return Status(files, active, detail)
