"""``serve`` (the daemon in the foreground) and ``demo``."""

from __future__ import annotations

import argparse
import os
import stat
import sys

from .. import errors
from ..config import Config
from ..fileio import Durability
from .common import (
    EXIT_ALREADY_RUNNING,
    EXIT_OK,
    EXIT_UNREACHABLE,
    UsageError,
    daemon_dir,
    folder_arg,
    refuse_another_folder,
)


def cmd_serve(args: argparse.Namespace) -> int:
    from ..daemon import AlreadyRunning, run, setup_logging
    from ..service.activation import ActivationError

    cfg = serve_config(args)
    _check_socket_target(cfg.socket)
    setup_logging(args.log_level, {"json": True, "text": False, "auto": None}[args.log_format])
    try:
        return run(cfg)
    except AlreadyRunning as exc:
        print(f"spilld: {exc}", file=sys.stderr)
        return EXIT_ALREADY_RUNNING
    except (ActivationError, errors.UnusableFolder) as exc:  # a wrong socket passed, or a folder we must not use
        raise UsageError(str(exc)) from None
    except errors.StorageError as exc:  # a folder the OS refuses at start (EACCES, EROFS, ENOENT under /proc...)
        raise UsageError(f"cannot serve: {exc}") from None
    except OSError as exc:
        raise UsageError(f"cannot serve: {exc.strerror or exc}{f': {exc.filename}' if exc.filename else ''}") from None


def serve_config(args: argparse.Namespace) -> Config:
    """The daemon's settings from ``serve``'s options, checked as far as they can be without serving (the shared
    tier's URL, password and key files included): ``UsageError`` names the bad one. ``service install`` checks the
    options it passes to ``serve`` here too, so a service never fails at every start on one."""
    from ..config import default_dir

    try:
        cfg = Config(
            cap=args.cap,
            disk_cap=args.disk_cap,
            dir=folder_arg(args.dir, default_dir, must_exist=False),
            socket=args.socket or "",
            durability=Durability(args.durability),
            drain_deadline=args.drain_deadline,
            idle_timeout=args.idle_timeout,
            request_timeout=args.request_timeout,
            metrics_file=_metrics_file(args.metrics_file),
            block_tokens=args.block_tokens,
            write_budget=args.write_budget,
            namespace_quota=args.namespace_quota,
            pin_cap=args.pin_cap,
            admit_after=args.admit_after,
            warm_bytes=args.warm_bytes,
            warm_rate=args.warm_rate,
            io_timeout=args.io_timeout,
            scrub_rate=args.scrub_rate,
            scrub_every=args.scrub_every,
            remote=args.remote,
            remote_cluster=args.remote_cluster,
            remote_push=args.remote_push,
            remote_ttl=args.remote_ttl,
            remote_password_file=args.remote_password_file,
            remote_key_file=args.remote_key_file,
            remote_host_name=args.remote_host_name,
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    _check_remote(cfg)
    return cfg


def _check_remote(cfg: Config) -> None:
    """``--remote``: the extra installed, the URL, the password and key files usable (nothing is connected). The
    other ``--remote-*`` options without it would be ignored: refused instead (a key file given for nothing may
    be one the user believes encrypts what is pushed)."""
    if not cfg.remote:
        given = [
            opt for opt, on in (
                ("--remote-cluster", cfg.remote_cluster), ("--remote-push", cfg.remote_push != "all"),
                ("--remote-ttl", cfg.remote_ttl is not None), ("--remote-password-file", cfg.remote_password_file),
                ("--remote-key-file", cfg.remote_key_file), ("--remote-host-name", cfg.remote_host_name),
            ) if on
        ]  # fmt: skip
        if given:
            raise UsageError(f"{', '.join(given)} without --remote: give --remote URL, or leave them out")
        return
    try:
        from ..remote import RemoteConfigError
        from ..remote.link import check_remote
    except ImportError:
        raise UsageError("--remote needs the remote extra: pip install 'spilld[remote]'") from None
    try:
        check_remote(cfg)
    except RemoteConfigError as exc:
        raise UsageError(f"--remote: {exc}") from None


def _metrics_file(path: str | None) -> str | None:
    """``--metrics-file``: its folder must exist (node_exporter's textfile folder is made by its owner)."""
    if not path:
        return None
    full = os.path.abspath(os.path.expanduser(path))
    if os.path.isdir(full) or not os.path.isdir(os.path.dirname(full)):
        raise UsageError(f"--metrics-file {full}: names a folder, or its folder does not exist")
    return full


def _check_socket_target(path: str) -> None:
    """The socket's path may hold a socket (stale or live: the daemon decides) but nothing else; its folder must
    be a folder (or not exist yet)."""
    if os.path.lexists(path) and not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise UsageError(f"--socket {path} exists and is not a socket")
    parent = os.path.dirname(path)
    while not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise UsageError(f"--socket {path} is below {parent}, which is not a folder")


def cmd_demo(args: argparse.Namespace) -> int:
    from ..demo import run_demo

    if args.dir is not None:  # for a daemon the demo starts; one already answering must serve it (found in review:
        refuse_another_folder(args, args.dir, daemon_dir(args))  # it was ignored without a word)
    try:
        run_demo(args.socket, args.dir, as_json=args.json)
    except errors.SpillError as exc:
        if exc.code != errors.SpillError.code:
            raise  # typed: mapped like any command's
        print(f"spilld demo: {exc}", file=sys.stderr)  # no daemon could be started or reached
        return EXIT_UNREACHABLE
    return EXIT_OK
