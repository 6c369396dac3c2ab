"""The service files: a launchd LaunchAgent plist and systemd user units, rendered for one installation.

The files in ``deploy/`` are these renderings for placeholder paths (``python -m spilld.service.units deploy``
writes them again; a test keeps them in step).
"""

from __future__ import annotations

import decimal
import math
import os
import plistlib
import re
import shlex
import string
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .lifecycle import EXTEND_EVERY_S, EXTEND_WINDOW_S, STOP_GRACE_S

LABEL = "dev.spilld"
PLIST_NAME = f"{LABEL}.plist"
SERVICE_NAME = "spilld.service"
SOCKET_NAME = "spilld.socket"
LAUNCHD_SOCKET_KEY = "spilld"  # what the daemon asks launch_activate_socket for
STOP_MARGIN_S = 30  # launchd's ExitTimeOut exceeds the drain deadline by this much
SYSTEMD_STOP_S = 30  # TimeoutStopSec=: short, since a drain that is still writing asks for more (EXTEND_TIMEOUT_USEC)
THROTTLE_S = 30  # launchd starts the job at most this often (its default, 10 s, is a relaunch loop on a bad option)
WATCHDOG_S = 30
DRAIN_DEADLINE_S = 60.0  # the daemon's own default
SYSTEMD_SOCKET = "%t/spilld/spilld.sock"  # %t is $XDG_RUNTIME_DIR, the daemon's own default folder
# ASCII control characters: a newline ends a unit's line (the rest would be a directive of its own), and XML, so a
# plist, holds none of the others. No service file carries them.
CONTROL_CHARACTERS = re.compile("[\x00-\x1f\x7f]")


def refuse_control_characters(value: str, what: str) -> str:
    """``value``, if it holds no control character and is UTF-8 text; else ValueError naming ``what`` (found in
    review: a newline in ``--dir`` wrote a line of its own, ``ExecStartPre=...``, into the unit; a byte that is not
    UTF-8, which Python's argv holds as a lone surrogate, was an internal error, exit 70, as the file was encoded)."""
    if CONTROL_CHARACTERS.search(value):
        raise ValueError(f"{what} {value!r} holds a control character (a newline?): a service file cannot carry it")
    try:
        value.encode()
    except UnicodeEncodeError:
        raise ValueError(
            f"{what} {value!r} holds a byte that is not UTF-8 text: a service file cannot carry it"
        ) from None
    return value


def spilld_command() -> list[str]:
    """The absolute command that runs this spilld: the console script next to the interpreter, else ``-m``."""
    bindir = os.path.dirname(os.path.abspath(sys.executable))  # not resolved: a venv's python must stay the venv's
    script = os.path.join(bindir, "spilld")
    if os.path.isfile(script) and os.access(script, os.X_OK):
        return [script]
    return [os.path.abspath(sys.executable), "-m", "spilld"]


@dataclass(frozen=True)
class ServiceSpec:
    """What one installation runs: the command and the daemon options its service files pass."""

    command: tuple[str, ...] = field(default_factory=lambda: tuple(spilld_command()))
    cap: str = "4GiB"
    dir: str | None = None
    socket: str | None = None  # None: the daemon's default (and %t/spilld/spilld.sock for systemd's socket unit)
    drain_deadline: float = DRAIN_DEADLINE_S
    socket_activation: bool = True
    # the other daemon options (`service install -- OPTIONS`), word for word, checked by serve's parser already
    serve_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        words = [("--cap", self.cap), ("--dir", self.dir), ("--socket", self.socket)]
        words += [("the command", word) for word in self.command]
        for what, value in [*words, *(("the serve option", word) for word in self.serve_args)]:
            if value is not None:
                refuse_control_characters(value, what)

    def argv(self) -> list[str]:
        """ExecStart / ProgramArguments: the command, ``serve``, install's options, then the others (after
        ``--drain-deadline``, which ``install`` finds as the first of its name when it reads an installed file)."""
        args = [*self.command, "serve", "--cap", self.cap]
        if self.dir:
            args += ["--dir", self.dir]
        if self.socket:
            args += ["--socket", self.socket]
        return [*args, "--drain-deadline", seconds_arg(self.drain_deadline), *self.serve_args]

    @property
    def stop_timeout_s(self) -> int:
        return stop_timeout_s(self.drain_deadline)


def seconds_arg(seconds: float) -> str:
    """A number of seconds as the daemon's --drain-deadline reads it back exactly: positional, never an exponent
    (found in review: 14 days were written 1.2096e+06, which the daemon refused at every start)."""
    return format(decimal.Decimal(repr(float(seconds))).normalize(), "f")


def stop_timeout_s(drain_deadline: float) -> int:
    """launchd's ExitTimeOut (SIGTERM to SIGKILL): the drain deadline and a margin. It is also the longest a
    stop takes under systemd, whose extensions end at the deadline plus STOP_GRACE_S."""
    return math.ceil(drain_deadline) + STOP_MARGIN_S


# --- launchd -----------------------------------------------------------------------------------


def launchd_socket(spec: ServiceSpec, home: Path) -> str:
    return spec.socket or str(home / "Library" / "Application Support" / "spilld" / "spilld.sock")


def launchd_log(home: Path) -> Path:
    return home / "Library" / "Logs" / "spilld" / "spilld.log"


def launchd_job(spec: ServiceSpec, home: Path) -> dict[str, Any]:
    """The LaunchAgent as a dict (plistlib writes the XML, so paths need no escaping)."""
    log = refuse_control_characters(str(launchd_log(home)), "the log file")  # under the home folder
    job: dict[str, Any] = {
        "Label": LABEL,
        "ProgramArguments": spec.argv(),  # execvp, no shell: absolute paths only
        "RunAtLoad": True,
        "KeepAlive": {"SuccessfulExit": False},  # restart after a crash, never after a clean stop
        "ExitTimeOut": spec.stop_timeout_s,  # SIGTERM to SIGKILL: the daemon drains within its deadline first
        # launchd has no RestartPreventExitStatus: a job that exits 2 (bad options) is started again, at most
        # once per ThrottleInterval.
        "ThrottleInterval": THROTTLE_S,
        # Standard, not Background: Background throttles I/O all the time (more shedding) and slows the drain
        # that must end within ExitTimeOut. The writer threads run at nice 10 instead.
        "ProcessType": "Standard",
        "StandardOutPath": log,
        "StandardErrorPath": log,
        "EnvironmentVariables": {"PYTHONUNBUFFERED": "1"},
    }
    if spec.socket_activation:
        job["Sockets"] = {
            LAUNCHD_SOCKET_KEY: {
                "SockPathName": launchd_socket(spec, home),
                "SockPathMode": 0o600,
                "SockType": "stream",
            }
        }
    return job


def launchd_plist(spec: ServiceSpec, home: Path) -> str:
    text = plistlib.dumps(launchd_job(spec, home), sort_keys=False).decode()
    head, _, rest = text.partition("<plist ")  # the marker as an XML comment, which launchd and plistlib skip
    return f"{head}<!-- {MARKER} -->\n<plist {rest}"


# --- systemd -----------------------------------------------------------------------------------

# Every file spilld writes for a service manager says so: `service uninstall` removes, and `service install`
# replaces, only files that carry this line (a user's own unit or plist of the same name is left alone).
MARKER = "Written by `spilld service install`; `spilld service uninstall` removes it."

SERVICE_TEMPLATE = string.Template("""\
# ${marker}
[Unit]
Description=spilld, a write-behind cold tier for LLM KV caches
${socket_deps}
[Service]
Type=notify
NotifyAccess=main
ExecStart=${exec_start}
KillSignal=SIGTERM
# On SIGTERM the daemon writes out its queue within --drain-deadline. TimeoutStopSec= is short, so a hung
# daemon is killed soon. A drain that advances asks for more: every ${every} s, if the items or bytes left
# have fallen or a write is under way, EXTEND_TIMEOUT_USEC asks for ${window} s from then, never past the
# deadline + ${grace} s. SIGKILL comes at the later of TimeoutStopSec= and the end of the last request.
TimeoutStopSec=${stop_timeout}s
# READY=1 comes after the index scan. A scan that advances asks for more time the same way (no cap), so a
# big store does not run into TimeoutStartSec= (90 s by default); a scan that stalls does.
WatchdogSec=${watchdog}s
Restart=on-failure
RestartSec=2s
# 2: bad options, 5: another daemon serves the socket; a restart fixes neither.
RestartPreventExitStatus=2 5
# A cache is the first thing to lose when memory runs out, not the engine.
OOMScoreAdjust=100
UMask=0077
# Hardening that needs no privileges. ProtectSystem=, PrivateTmp= and the like need user namespaces in a
# user manager, which many kernels deny, so they are left out.
NoNewPrivileges=yes
LockPersonality=yes
RestrictRealtime=yes
RestrictSUIDSGID=yes
RestrictNamespaces=yes
SystemCallArchitectures=native
RestrictAddressFamilies=AF_UNIX

[Install]
WantedBy=default.target
${also}""")

SOCKET_TEMPLATE = string.Template("""\
# ${marker}
[Unit]
Description=spilld socket

[Socket]
ListenStream=${listen}
SocketMode=0600
DirectoryMode=0700
RemoveOnStop=yes

[Install]
WantedBy=sockets.target
""")

_SPECIAL = set(" \t\n\"'\\;")


def systemd_quote(arg: str) -> str:
    """One ExecStart word: specifiers (%) and variables ($) made literal, quoted when it has spaces or quotes; a
    control character is refused (ValueError): a newline would end the line."""
    arg = refuse_control_characters(arg, "a service argument").replace("%", "%%").replace("$", "$$")
    if arg and not _SPECIAL & set(arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def systemd_split(exec_start: str) -> list[str]:
    """The words of an ExecStart= value as ``systemd_quote`` wrote them (ValueError for a quote left open): the
    inverse of joining ``systemd_quote`` of each word, for ``service status`` and the round-trip test."""
    return [w.replace("%%", "%").replace("$$", "$") for w in shlex.split(exec_start)]


def systemd_service(spec: ServiceSpec) -> str:
    activation = spec.socket_activation
    return SERVICE_TEMPLATE.substitute(
        socket_deps=f"Requires={SOCKET_NAME}\nAfter={SOCKET_NAME}\n" if activation else "",
        exec_start=" ".join(systemd_quote(a) for a in spec.argv()),
        stop_timeout=SYSTEMD_STOP_S,
        every=f"{EXTEND_EVERY_S:g}",
        window=f"{EXTEND_WINDOW_S:g}",
        grace=f"{STOP_GRACE_S:g}",
        watchdog=WATCHDOG_S,
        also=f"Also={SOCKET_NAME}\n" if activation else "",
        marker=MARKER,
    )


def systemd_listen(spec: ServiceSpec) -> str:
    """The path the socket unit listens on, as said to the user (``%t`` is ``$XDG_RUNTIME_DIR``)."""
    return spec.socket or SYSTEMD_SOCKET.replace("%t", "$XDG_RUNTIME_DIR")


def systemd_socket(spec: ServiceSpec) -> str:
    listen = spec.socket.replace("%", "%%") if spec.socket else SYSTEMD_SOCKET
    return SOCKET_TEMPLATE.substitute(listen=listen, marker=MARKER)


# --- the shipped examples ----------------------------------------------------------------------

EXAMPLE_LAUNCHD = ServiceSpec(command=("/Users/you/.local/bin/spilld",))
EXAMPLE_SYSTEMD = ServiceSpec(command=("/home/you/.local/bin/spilld",))


# An example copied by hand is its user's file, never one ``service install`` may replace or ``uninstall`` remove
EXAMPLE_NOTE = "An example of what `spilld service install` writes; a copy installed by hand is yours alone."


def examples() -> dict[str, str]:
    """The files of ``deploy/``, by path relative to it: what ``install`` writes, without its marker."""
    files = {
        f"launchd/{PLIST_NAME}": launchd_plist(EXAMPLE_LAUNCHD, Path("/Users/you")),
        f"systemd/{SERVICE_NAME}": systemd_service(EXAMPLE_SYSTEMD),
        f"systemd/{SOCKET_NAME}": systemd_socket(EXAMPLE_SYSTEMD),
    }
    return {rel: text.replace(MARKER, EXAMPLE_NOTE) for rel, text in files.items()}


if __name__ == "__main__":
    root = Path(sys.argv[1] if len(sys.argv) > 1 else "deploy")
    for rel, text in examples().items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
        print(root / rel)
