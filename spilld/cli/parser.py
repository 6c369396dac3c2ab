"""The argument parser: every command, its options and their help, and the implicit ``serve``."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from .. import __version__
from ..blocks import DEFAULT_BLOCK_TOKENS
from ..config import (
    DEFAULT_IO_TIMEOUT_S,
    DEFAULT_SCRUB_INTERVAL_S,
    DEFAULT_SCRUB_RATE,
    DEFAULT_WARM_BUDGET,
    DEFAULT_WARM_RATE,
    format_size,
    parse_size,
)
from ..control import CONNECT_TIMEOUT_S
from ..fileio import Durability
from ..format import MAX_BLOCK_TOKENS, MIN_BLOCK_TOKENS
from .common import (
    EXIT_NOT_INSTALLED,
    Parser,
    duration_arg,
    fingerprint_arg,
    path_arg,
    positive_duration_arg,
    size_arg,
    size_or_zero_arg,
    size_text_arg,
    socket_arg,
    text_arg,
    whole_seconds_arg,
)
from .evict import cmd_evict
from .files import cmd_inspect, cmd_ls, cmd_verify
from .running import cmd_drain, cmd_pin, cmd_status
from .serve import cmd_demo, cmd_serve
from .service import cmd_service

EPILOG = """exit codes:
  0  success (drain: everything acknowledged is durable)
  1  a file failed a check (corrupt, truncated, foreign, unreadable); pin/unpin: not an entry of the store
  2  usage or configuration error (a bad option, an unusable folder or socket path)
  3  timeout: drain (or a stop) left work unfinished, or drain saw items end not stored; a daemon stopped by a
     second signal
  4  the daemon cannot be reached (or what answers on the socket is not spilld)
  5  another daemon already serves this socket or folder
  6  service: launchctl or systemctl refused a command, or did not finish in time
  7  the daemon refused the request (its error code is printed)
  8  service status: the service is not installed, or not loaded
  70 internal error (a bug: SPILLD_DEBUG=1 shows the traceback)
  130, 141  interrupted (Ctrl-C), or the reader of the output went away (a closed pipe)
  129, 143  demo: stopped by SIGHUP or SIGTERM (its daemon stopped, its temp folder removed)
"""

GLOBAL_OPTIONS = ("--socket", "--dir")  # each takes one value; accepted before or after the command


# --- the parser ------------------------------------------------------------------------------------------


def build_parser() -> Parser:
    from ..config import default_dir, default_socket

    p = Parser(
        prog="spilld",
        description="A write-behind cold tier for the KV caches of local mlx LLM engines. "
        "Without a command, runs the daemon (same as `spilld serve`). "
        "--socket and --dir may come before or after a command that takes them.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"spilld {__version__}")
    p.add_argument("--socket", type=socket_arg, default=None, help=f"the daemon's socket (default {default_socket()})")
    p.add_argument("--dir", type=path_arg, default=None, help=f"the store's folder (default {default_dir()})")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)

    def add(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name, help=help, description=help, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
        )

    # Given after the command, the global options land in the same place; SUPPRESS keeps one given before.
    takers: dict[str, set[str]] = {opt: set() for opt in GLOBAL_OPTIONS}
    p.set_defaults(global_takers=takers)  # the commands that take each global option (the rest refuse it)

    def with_socket(sp: argparse.ArgumentParser, help: str | None = None) -> None:
        takers["--socket"].add(sp.prog.split()[-1])
        sp.add_argument(
            "--socket",
            type=socket_arg,
            default=argparse.SUPPRESS,
            help=help or f"the daemon's socket (default {default_socket()})",
        )

    def with_dir(sp: argparse.ArgumentParser, help: str) -> None:
        takers["--dir"].add(sp.prog.split()[-1])
        sp.add_argument("--dir", type=path_arg, default=argparse.SUPPRESS, help=help)

    srv = add("serve", "run the daemon")
    srv.add_argument(
        "--cap",
        type=size_arg,
        default=parse_size("4GiB"),
        help="soft cap on queued bytes in memory (default 4GiB; e.g. 512MiB, 2G, 10GB)",
    )
    srv.add_argument(
        "--disk-cap",
        type=size_arg,
        default=None,
        help="cap on the folder's size (default: the smaller of 64 GiB and a quarter of the free space plus the "
        "store's own bytes)",
    )
    with_dir(srv, f"where cache files live (default {default_dir()})")
    with_socket(srv)
    srv.add_argument(
        "--durability",
        default="fsync",
        choices=[d.value for d in Durability],
        help="full (F_FULLFSYNC on macOS), fsync (default) or none",
    )
    srv.add_argument(
        "--block-tokens",
        type=int,
        default=DEFAULT_BLOCK_TOKENS,
        help=f"tokens per prefix block: conversations that share a prefix share its blocks on disk, and a turn "
        f"writes only its new blocks ({MIN_BLOCK_TOKENS} to {MAX_BLOCK_TOKENS}, default {DEFAULT_BLOCK_TOKENS}; 0 "
        "writes every entry whole)",
    )
    srv.add_argument(
        "--write-budget",
        type=size_arg,
        default=None,
        help="bytes written a day, at most (e.g. 20GiB): past it, droppable spills and fills from --remote are shed "
        "and counted, non-droppable spills still written; the count is kept across restarts in the folder "
        "(default: no budget)",
    )
    srv.add_argument(
        "--namespace-quota",
        type=size_arg,
        default=None,
        help="bytes on disk one namespace (tenant) may hold, e.g. 8GiB: its own least recently used entries go "
        "first, so one tenant's spills never evict another's (default: only the disk cap)",
    )
    srv.add_argument(
        "--pin-cap",
        type=size_arg,
        default=None,
        help="pinned entries (spill(pin=True), spilld pin) are evicted last, up to this many bytes with their "
        "blocks; older pins beyond it are evicted like the rest (default: a quarter of the disk cap)",
    )
    srv.add_argument(
        "--admit-after",
        type=int,
        default=0,
        help="the write gate: a droppable spill's new blocks (or a fill's from --remote) are written only once a "
        "lookup asked for their prefix this many times (one-off prompts never reach the disk); the counts are kept in "
        "memory (default 0: off)",
    )
    srv.add_argument(
        "--warm-bytes",
        type=size_or_zero_arg,
        default=DEFAULT_WARM_BUDGET,
        help="after a start, read this much of the most recently used entries into the page cache, so the first "
        f"restores after a reboot are warm (default {format_size(DEFAULT_WARM_BUDGET)}; 0: none)",
    )
    srv.add_argument(
        "--warm-rate",
        type=size_arg,
        default=DEFAULT_WARM_RATE,
        help=f"bytes a second the warm start reads at most, paused while serving (default "
        f"{format_size(DEFAULT_WARM_RATE)}, e.g. 100MiB)",
    )
    srv.add_argument(
        "--io-timeout",
        type=positive_duration_arg,
        default=DEFAULT_IO_TIMEOUT_S,
        help="a write step, restore read or unlink that takes longer fails its work, so a hung disk never stalls "
        "serving: the spill fails or the restore is a miss (io_timeout), lookups and other clients go on "
        "(default 30s)",
    )
    srv.add_argument(
        "--scrub-rate",
        type=size_or_zero_arg,
        default=DEFAULT_SCRUB_RATE,
        help="the scrub checks every stored file's hashes in idle time, at most this many bytes a second, and moves "
        f"a bad one aside before a restore needs it (default {format_size(DEFAULT_SCRUB_RATE)}; 0: no scrub)",
    )
    srv.add_argument(
        "--scrub-every",
        type=positive_duration_arg,
        default=DEFAULT_SCRUB_INTERVAL_S,
        help="a scrub pass starts at most this often (default 1d); the first one 10 minutes after a start, or one interval if shorter",
    )
    srv.add_argument(
        "--remote",
        metavar="URL",
        type=text_arg,
        default=None,
        help="a shared tier on Redis or Valkey (redis://HOST:PORT/DB, rediss:// for TLS, unix:///path): entries "
        "stored here are pushed there, and a prompt another host stored is fetched from there; needs the remote "
        "extra. A password comes from $SPILLD_REMOTE_PASSWORD or --remote-password-file, never the URL",
    )
    srv.add_argument("--remote-cluster", action="store_true", help="the --remote URL names a node of a Redis Cluster")
    srv.add_argument(
        "--remote-push",
        choices=["all", "evicted", "none"],
        default="all",
        help="all (default): push every entry stored with blocks; evicted: push an entry when this disk evicts it "
        "(the shared tier keeps what this host cannot); none: only fetch",
    )
    srv.add_argument(
        "--remote-ttl",
        type=whole_seconds_arg,
        default=None,
        metavar="DURATION",
        help="keys pushed expire after this long unused, in whole seconds (e.g. 3600, 12h, 7d; each fetch renews "
        "them; default: kept until Redis evicts)",
    )
    srv.add_argument(
        "--remote-password-file",
        type=path_arg,
        default=None,
        help="a file (mode 0600) holding the remote tier's password",
    )
    srv.add_argument(
        "--remote-key-file",
        type=path_arg,
        default=None,
        help="a file (mode 0600, 32 bytes or more) whose key encrypts everything pushed (AES-GCM, a key per "
        "namespace): a host without it gets misses, never plaintext",
    )
    srv.add_argument(
        "--remote-host-name",
        type=text_arg,
        default=None,
        metavar="NAME",
        help="this daemon's name in the shared tier's events, which routers read to send a prompt to the daemon "
        "holding it (default: the machine's host name); give each daemon on one machine a name of its own",
    )
    srv.add_argument(
        "--drain-deadline",
        type=positive_duration_arg,
        default=60.0,
        help="time to finish queued work on SIGTERM, SIGINT or SIGHUP (default 60 s; e.g. 90, 2m)",
    )
    srv.add_argument(
        "--idle-timeout",
        type=positive_duration_arg,
        default=300.0,
        help="disconnect clients silent this long (default 300 s)",
    )
    srv.add_argument(
        "--request-timeout",
        type=positive_duration_arg,
        default=30.0,
        help="time a client has to finish a frame it began, and an engine to grant its lease for a write step "
        "(default 30 s)",
    )
    srv.add_argument(
        "--metrics-file",
        type=path_arg,
        default=None,
        help="write Prometheus metrics to this file every few seconds, atomically (for node_exporter's textfile "
        "collector: a name ending in .prom in its --collector.textfile.directory)",
    )
    srv.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    srv.add_argument(
        "--log-format",
        default="auto",
        choices=["auto", "json", "text"],
        help="auto: JSON lines unless stderr is a terminal",
    )
    srv.set_defaults(func=cmd_serve)

    de = add("demo", "a one-minute tour: a tiny model, a chat spilled behind decode, a restart served from disk")
    with_socket(de)
    with_dir(de, "the store folder of a daemon the demo starts (default: the platform cache folder)")
    de.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    de.set_defaults(func=cmd_demo)

    dr = add("drain", "wait until everything queued in the daemon is durable (progress on a terminal)")
    with_socket(dr)
    dr.add_argument(
        "--timeout",
        type=duration_arg,
        default=None,
        help="give up after this long (default 1h; e.g. 30, 5m): exit code 3, also when the daemon stops answering "
        f"during the drain; 4 when it never answers (its hello, bounded by this too, at most {CONNECT_TIMEOUT_S:g} s)",
    )
    dr.set_defaults(func=cmd_drain)

    st = add("status", "queue, disk, hits and misses, errors")
    with_socket(st)
    st.add_argument("--format", default="text", choices=["text", "json", "prometheus"], help="default: text")
    st.add_argument("--json", action="store_true", help="same as --format json")
    st.set_defaults(func=cmd_status)

    ls = add("ls", "list the stored entries (reads the folder; needs no daemon)")
    with_dir(ls, f"the store's folder (default {default_dir()})")
    ls.add_argument("--quarantine", action="store_true", help="list the files moved aside as bad instead")
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_ls)

    ev = add(
        "evict",
        "remove entries (all, of one model, or unused for a while) and empty model folders; through the daemon "
        "when it serves the folder, else from the folder itself",
    )
    with_socket(ev)
    with_dir(ev, "the store's folder (default: the daemon's, else the platform cache folder); never created")
    ev.add_argument(
        "--fingerprint", type=fingerprint_arg, default=None,
        help="only entries in this identity folder (its 16 hex digits, as `spilld ls --json` shows)",
    )  # fmt: skip
    ev.add_argument(
        "--older-than", type=duration_arg, default=None, help="only entries unused for this long (e.g. 7d, 12h, 30m)"
    )
    ev.add_argument("--all", action="store_true", help="every entry (needed when no other filter is given)")
    ev.add_argument("--quarantine", action="store_true", help="remove the files moved aside as bad")
    ev.add_argument("--json", action="store_true", help="print what was removed as one JSON line (no progress)")
    ev.set_defaults(func=cmd_evict)

    for name, what in (
        ("pin", "pin an entry: evicted last (within --pin-cap), never superseded"),
        ("unpin", "unpin an entry"),
    ):
        pn = add(name, what)
        with_socket(pn)
        pn.add_argument("path", help="the entry's file (see spilld ls)")
        pn.set_defaults(func=cmd_pin, unpin=name == "unpin")

    ins = add("inspect", "show a cache file's header and tensors, and check its hashes")
    ins.add_argument("file")
    ins.add_argument("--json", action="store_true", help="machine-readable output")
    ins.add_argument(
        "--no-verify", dest="verify", action="store_false", help="read the header only; skip the tensor hashes"
    )
    ins.set_defaults(func=cmd_inspect)

    ver = add("verify", "check files end to end (header, layout, every tensor hash), or a whole store (--dir)")
    ver.add_argument(
        "files",
        nargs="*",
        help="files (a folder is checked as a store); one removed during the check (a daemon's eviction) is said "
        "gone, not bad; one not there at all fails",
    )
    with_dir(ver, "check every entry of this store")
    ver.add_argument("--quiet", action="store_true", help="no progress line")
    ver.set_defaults(func=cmd_verify)

    svc = add(
        "service",
        "install, remove or show spilld as a user service (launchd on macOS, systemd on Linux); "
        "the service files run `spilld serve` with the options below",
    )
    svc.description = (
        f"{svc.description}, and with any other daemon option given after `--` (spilld service install --cap 8GiB "
        "-- --remote redis://HOST:6379/0 --write-budget 50GiB): checked now as `spilld serve` checks them, each "
        "given in full, a file's path made absolute"
    )
    svc.usage = "%(prog)s [-h] [OPTIONS] {install,uninstall,status} [-- SERVE_OPTIONS]"
    svc.add_argument(
        "action",
        choices=["install", "uninstall", "status"],
        help="install: write the files, load and start the service; uninstall: stop it (it drains), unload, "
        "remove the files; status: are the files there and is it loaded "
        f"(exit {EXIT_NOT_INSTALLED} if not)",
    )
    svc.add_argument(
        "--dry-run", action="store_true", help="install, uninstall: print the files and the commands; change nothing"
    )
    svc.add_argument("--cap", type=size_text_arg, default=None, help="the daemon's --cap (default 4GiB)")
    with_dir(svc, "the daemon's --dir (default: its own default)")
    with_socket(svc, "the daemon's --socket (default: $SPILLD_SOCKET where set, else its own default)")
    svc.add_argument(
        "--drain-deadline",
        type=positive_duration_arg,
        default=None,
        help="the daemon's --drain-deadline (default 60); launchd's ExitTimeOut is this plus 30 s, systemd's stop "
        "timeout is 30 s, extended by the daemon while its drain advances",
    )
    svc.add_argument(
        "--socket-activation",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="let the manager own the socket and hand it to the daemon (default: on)",
    )
    svc.add_argument("--manager", choices=["launchd", "systemd"], default=None, help="default: the platform's own")
    svc.set_defaults(func=cmd_service, serve_options=None)  # the words after `--` (split_serve_options)
    return p


def with_command(argv: list[str], commands: Sequence[str]) -> list[str]:
    """``argv`` with ``serve`` put where the command would be, when none is given (``spilld --cap 2G``).

    The global options (``GLOBAL_OPTIONS``) before it are skipped over with their values."""
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok in ("-h", "--help", "--version") or tok in commands:
            return argv
        if tok in GLOBAL_OPTIONS:
            if i + 1 >= len(argv):
                return argv  # its value is missing: argparse says so (not "serve" taken for the value)
            i += 2
        elif tok.split("=", 1)[0] in GLOBAL_OPTIONS:
            i += 1
        elif tok.startswith("-"):
            break  # a daemon option: the command is the implicit serve
        else:
            return argv  # not a command: argparse says so
    return [*argv[:i], "serve", *argv[i:]]


def subcommands(parser: argparse.ArgumentParser) -> dict[str, Parser]:
    """``parser``'s commands, each by name with its own parser (argparse keeps them in a private action)."""
    return next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices


SERVE_OPTIONS_MARK = "--"  # `spilld service install [OPTIONS] -- SERVE OPTIONS`


def split_serve_options(argv: list[str]) -> tuple[list[str], list[str] | None]:
    """``argv`` without the daemon options of ``spilld service ... -- OPTIONS`` (the words after the first ``--``
    that follows ``service``), and those options; None where there is no such ``--``. argparse cannot take them:
    a list of positionals after ``install`` is matched, empty, before the parser reaches the ``--``."""
    i = 0
    while i < len(argv) and argv[i].split("=", 1)[0] in GLOBAL_OPTIONS:
        i += 1 if "=" in argv[i] else 2
    if argv[i : i + 1] == ["service"] and SERVE_OPTIONS_MARK in argv[i + 1 :]:
        mark = argv.index(SERVE_OPTIONS_MARK, i + 1)
        return argv[:mark], argv[mark + 1 :]
    return argv, None
