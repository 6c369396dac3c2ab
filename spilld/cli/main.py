"""``main``: run one command; every failure is one line on stderr and an exit code (never a traceback)."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Sequence

from .. import errors
from .common import (
    EXIT_ALREADY_RUNNING,
    EXIT_BAD_FILE,
    EXIT_BROKEN_PIPE,
    EXIT_DAEMON_ERROR,
    EXIT_INTERNAL,
    EXIT_INTERRUPTED,
    EXIT_SIGNAL_BASE,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    UsageError,
)
from .parser import build_parser, split_serve_options, subcommands, with_command

DEBUG_ENV = "SPILLD_DEBUG"  # set to 1: an internal error shows its traceback
UNREACHABLE_CODES = {"connection_lost", "busy", "timeout", "not_a_daemon"}  # gone, stopping, silent, or not spilld
USAGE_CODES = {"unusable_folder", "foreign_daemon", "activation_error"}


def _exit_for(exc: errors.SpillError) -> int:
    if isinstance(exc, errors.FileFormatError):
        return EXIT_BAD_FILE
    if exc.code in UNREACHABLE_CODES:
        return EXIT_UNREACHABLE
    if exc.code == "already_running":
        return EXIT_ALREADY_RUNNING
    if exc.code in USAGE_CODES:
        return EXIT_USAGE
    return EXIT_DAEMON_ERROR


def _fail(message: str, code: int) -> int:
    print(f"spilld: {message}", file=sys.stderr)
    return code


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; every failure is one line on stderr and an exit code (never a traceback)."""
    parser = build_parser()
    commands = list(subcommands(parser))
    args_list, serve_options = split_serve_options(with_command(list(sys.argv[1:] if argv is None else argv), commands))
    if "service" in args_list and serve_options is None:  # (found in review: `install --remote URL` said no more)
        parser.unrecognized_hint = (
            "; the daemon's other options go after `--` (`spilld service install -- --remote URL`)"
        )
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:  # --help, --version, or a refusal already printed
        return int(exc.code or 0) if not isinstance(exc.code, str) else EXIT_USAGE
    if serve_options is not None:  # `spilld service ... -- OPTIONS`
        args.serve_options = serve_options
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    for opt, takers in args.global_takers.items():  # given before a command that has no use for it
        if getattr(args, opt[2:]) is not None and args.command not in takers:
            return _fail(
                f"{opt} means nothing to `spilld {args.command}` (taken by: {', '.join(sorted(takers))})", EXIT_USAGE
            )
    try:
        return int(args.func(args))
    except UsageError as exc:
        return _fail(str(exc), EXIT_USAGE)
    except errors.SpillError as exc:
        return _fail(f"{exc} [{exc.code}]", _exit_for(exc))
    except KeyboardInterrupt:
        return _fail("interrupted", EXIT_INTERRUPTED)
    except errors.StopSignal as exc:  # `demo`, once it has cleaned up: the code of a process the signal killed
        return _fail(f"stopped by {signal.Signals(exc.signum).name}", EXIT_SIGNAL_BASE + exc.signum)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return EXIT_BROKEN_PIPE
    except OSError as exc:
        return _fail(f"{exc.strerror or exc}{f': {exc.filename}' if exc.filename else ''}", EXIT_USAGE)
    except Exception as exc:
        if os.environ.get(DEBUG_ENV):
            raise
        return _fail(f"internal error: {exc!r} (set {DEBUG_ENV}=1 for the traceback)", EXIT_INTERNAL)
