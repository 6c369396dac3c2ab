"""``service``: install, remove and query spilld under launchd or systemd."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

from ..config import default_dir, parse_size
from .common import EXIT_NOT_INSTALLED, EXIT_OK, EXIT_SERVICE, EXIT_USAGE, UsageError, folder_arg


def _service_spec(args: argparse.Namespace, manager: str, home: Path) -> Any:
    from ..service.units import ServiceSpec, launchd_socket, refuse_control_characters

    given = {k: v for k in ("cap", "drain_deadline", "socket_activation") if (v := getattr(args, k)) is not None}
    folder = folder_arg(args.dir, default_dir, must_exist=False) if args.dir else _env_dir(manager)  # refused now
    socket = _service_socket(args.socket, manager) if args.socket is not None else _env_socket(manager)
    try:  # a path a service file cannot carry (a newline: found in review, a line of its own in the unit)
        spec = ServiceSpec(dir=folder, socket=socket, **given)  # the rest: defaults
        if args.serve_options is not None:  # checked with install's own values, which the service runs with too
            spec = replace(spec, serve_args=_serve_options(args.serve_options, spec))
        if manager == "launchd":
            refuse_control_characters(str(home), "the home folder")  # the plist's log and default socket are in it
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    if manager == "launchd" and args.socket is None:  # the default under a long home (found in review: unchecked)
        _checked_path(launchd_socket(spec, home), manager)
    return spec


# `serve`'s options that `install` gives the service itself (its own options, or socket activation's)
OWNED_OPTIONS = {"cap": "--cap", "dir": "--dir", "socket": "--socket", "drain_deadline": "--drain-deadline"}
# `serve`'s options that name a file, each made absolute as `serve` resolves it (a service does not start in the
# folder `install` ran in): only --metrics-file expands a ~
FILE_OPTIONS: dict[str, Callable[[str], str]] = {
    "--remote-password-file": os.path.abspath,
    "--remote-key-file": os.path.abspath,
    "--metrics-file": lambda path: os.path.abspath(os.path.expanduser(path)),
}
# the files a rediss:// URL may name (redis-py opens them from the daemon's folder): a relative one is refused
URL_FILE_PARAMS = ("ssl_certfile", "ssl_keyfile", "ssl_ca_certs", "ssl_ca_path")
_NOT_GIVEN = object()


def _serve_options(words: list[str], spec: Any) -> tuple[str, ...]:
    """The daemon options given after ``install --``, checked now by ``serve``'s own parser and settings (a bad one
    would fail the service at every start: launchd starts it again every 30 s), each option named in full (an
    abbreviation that is unique today may not be after an upgrade), none that ``install`` sets itself; a file's
    path made absolute. ``UsageError`` for a refusal; SystemExit(0) after ``-- --help``."""
    from .parser import build_parser, subcommands
    from .serve import serve_config

    serve = subcommands(build_parser())["serve"]
    serve.raise_errors, serve.allow_abbrev = True, False  # this parser only, made for this check
    try:
        args = serve.parse_args(words, argparse.Namespace(**dict.fromkeys(OWNED_OPTIONS, _NOT_GIVEN)))
    except UsageError as exc:
        hint = " (each option in full, as `spilld serve --help` names it)" if "unrecognized" in str(exc) else ""
        raise UsageError(f"after --: {exc}{hint}") from None
    if owned := [opt for dest, opt in OWNED_OPTIONS.items() if getattr(args, dest) is not _NOT_GIVEN]:
        raise UsageError(
            f"after --: {', '.join(owned)} {'is an option' if len(owned) == 1 else 'are options'} of install's own: "
            f"give {'it' if len(owned) == 1 else 'them'} before -- (spilld service install {owned[0]} ...)"
        )
    args.cap, args.dir, args.socket = parse_size(spec.cap), spec.dir, spec.socket  # what the service will run with
    args.drain_deadline = spec.drain_deadline
    _refuse_relative_url_files(args.remote)  # (before serve's checks, which open them from this folder)
    cfg = serve_config(args)
    if cfg.remote and not cfg.remote_password_file:
        from ..remote.credentials import PASSWORD_ENV  # (the extra is there: serve_config checked)

        if os.environ.get(PASSWORD_ENV):  # a service file never holds a password, nor passes this shell's on
            print(
                f"spilld: the service does not see ${PASSWORD_ENV}: to give it the password, add "
                "--remote-password-file FILE (mode 0600) after --",
                file=sys.stderr,
            )
    out: list[str] = []
    at = iter(words)
    for word in at:  # every option is named in full (no abbreviation), so each file option is found by its name
        name, eq, value = word.partition("=")
        if name in FILE_OPTIONS:
            out += [name, FILE_OPTIONS[name](value if eq else next(at))]
        else:
            out.append(word)
    return tuple(out)


def _refuse_relative_url_files(url: str | None) -> None:
    """A file a ``--remote`` URL names (a TLS CA or client key) by a relative path: ``UsageError``. The service
    would open it from its own working folder, not this one; a URL is passed on as written."""
    params = parse_qs(urlsplit(url or "").query)
    for name in URL_FILE_PARAMS:
        for path in params.get(name, []):
            if not os.path.isabs(path):
                raise UsageError(
                    f"--remote: {name}={path} is a relative path, which a service would take from "
                    "another folder: give it absolute"
                )


def _checked_path(path: str, manager: str) -> str:
    """``path`` made absolute, if it fits a socket address where ``manager`` runs (launchd: macOS's 103 bytes)."""
    from ..config import MACOS_SOCKET_PATH_MAX, SOCKET_PATH_MAX, check_socket_path

    try:
        return check_socket_path(path, MACOS_SOCKET_PATH_MAX if manager == "launchd" else SOCKET_PATH_MAX)
    except ValueError as exc:
        raise UsageError(str(exc)) from None


def _service_socket(path: str | None, manager: str) -> str | None:
    """``--socket`` as ``serve`` would take it, checked now (a folder other users can write is refused: under
    socket activation the manager binds it, and ``serve``'s own check would never run)."""
    if path is None:
        return None
    from ..daemon.listen import check_socket_folder

    full = _checked_path(os.path.abspath(os.path.expanduser(path)), manager)
    if os.path.isdir(folder := os.path.dirname(full)):  # one that is missing is made, ours alone
        check_socket_folder(folder)
    return full


def _env_socket(manager: str) -> str | None:
    """``$SPILLD_SOCKET``, where set, for a service installed without ``--socket``: written into its files, so that
    the service serves the socket every other command here reaches (found in review: it was ignored, and the
    service served the default); said on stderr. Checked as ``--socket`` is, the variable named in a refusal."""
    from .. import errors
    from ..config import SOCKET_ENV

    if not (env := os.environ.get(SOCKET_ENV)):
        return None
    try:
        path = _service_socket(env, manager)
    except (UsageError, errors.UnusableFolder) as exc:
        raise UsageError(f"{exc} (from {SOCKET_ENV})") from None
    print(f"spilld: the service will serve ${SOCKET_ENV}, {path} (unset it for the default)", file=sys.stderr)
    return path


CACHE_ENV = "XDG_CACHE_HOME"  # the default --dir's base on Linux, which a systemd user manager rarely has


def _env_dir(manager: str) -> str | None:
    """``$XDG_CACHE_HOME/spilld``, where the variable is set, for a systemd service installed without ``--dir``:
    written into the unit, so that the service keeps its files where every other command here looks (found in
    review: it was left out, and the daemon, started by a manager whose environment seldom has the variable, filled
    ~/.cache/spilld while `spilld ls` and `verify` read the folder the variable names); said on stderr."""
    if manager != "systemd" or not os.environ.get(CACHE_ENV):
        return None
    try:
        folder = folder_arg(None, default_dir, must_exist=False)
    except UsageError as exc:
        raise UsageError(f"{exc} (from {CACHE_ENV})") from None
    print(
        f"spilld: the service will keep its files in {folder}, from ${CACHE_ENV} (--dir names another)", file=sys.stderr
    )
    return folder


INSTALL_ONLY = ("cap", "dir", "socket", "drain_deadline", "socket_activation")


def _refuse_install_options(args: argparse.Namespace) -> None:
    """An option ``install`` alone uses, given to ``status`` or ``uninstall``: refused, never ignored."""
    given = [f"--{n.replace('_', '-')}" for n in INSTALL_ONLY if getattr(args, n) is not None]
    if args.action == "status" and args.dry_run:
        given.append("--dry-run")
    if args.serve_options is not None:  # (a reinstall drops them; uninstall needs none)
        given.append("-- (daemon options)")
    if given:
        raise UsageError(f"service {args.action} takes no {', '.join(given)} (only install uses them)")


def _service_status(manager: Any, home: Path) -> int:
    from ..service import install as svc

    st = svc.status(manager, home, svc.run_command)
    for path, state in st.files.items():
        mark = " (not written by spilld: install and uninstall leave it alone)" if state == "yours" else ""
        print(f"{state:<9}  {path}{mark}")
    for line in st.detail:
        print(line)
    return EXIT_OK if st.installed and st.loaded else EXIT_NOT_INSTALLED


def cmd_service(args: argparse.Namespace) -> int:
    from ..service import install as svc

    manager = args.manager or svc.default_manager()
    if manager is None:
        raise UsageError(f"no service manager for {sys.platform} (launchd or systemd)")
    home = Path.home()
    if args.action != "install":
        _refuse_install_options(args)
    if args.action == "status":
        return _service_status(manager, home)
    if args.action == "install":
        try:
            spec = _service_spec(args, manager, home)
        except SystemExit as exc:  # `install -- --help`: serve's options shown, nothing installed
            return int(exc.code or 0)
        plan = svc.install_plan(manager, spec, home)
    else:
        plan = svc.uninstall_plan(manager, home)
    if args.dry_run:
        svc.show(plan, sys.stdout)
        return EXIT_USAGE if plan.refuse else EXIT_OK
    if not svc.apply(plan, svc.run_command, sys.stderr):  # refused (a file of the user's in the way): usage, as
        return EXIT_USAGE if plan.refuse else EXIT_SERVICE  # any path we cannot use (found in review: it was 6)
    touched = [str(p) for p in [*plan.write, *plan.remove]]
    if not touched:  # uninstall with nothing of ours installed
        print(f"nothing to {args.action}: no spilld service files for {manager}")
        return EXIT_OK
    print(f"{args.action}ed: {', '.join(touched)}")
    for note in plan.notes:
        print(note)
    return EXIT_OK
