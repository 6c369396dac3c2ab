"""The ``spilld`` command line: the daemon (``spilld`` = ``spilld serve``) and its tools."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from . import __version__, errors
from . import format as fmt
from .config import format_size
from .fileio import Durability

EXIT_OK = 0
EXIT_BAD_FILE = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 3
EXIT_UNREACHABLE = 4
EXIT_ALREADY_RUNNING = 5
EXIT_SERVICE = 6

EPILOG = """exit codes:
  0  success (drain: everything acknowledged is durable)
  1  a file failed a check (corrupt, truncated, foreign)
  2  usage error
  3  timeout: drain (or a stop) left work unfinished
  4  the daemon cannot be reached
  5  another daemon already serves this socket
  6  service: launchctl or systemctl refused a command, or did not finish in time
"""


def _entry_summary(e: fmt.CacheEntry, depth: int = 0) -> list[str]:
    pad = "  " * depth
    fields = " ".join(f"{k}={v}" for k, v in e.fields.items())
    size = sum(s.nbytes for s in e.tensors)
    lines = [
        f"{pad}{e.kind} v{e.version} offset={e.offset} min_reusable={e.min_reusable} "
        f"trimmable={e.trimmable} tensors={len(e.tensors)} bytes={size} {fields}".rstrip()
    ]
    for s in e.tensors:
        lines.append(f"{pad}  @{s.off:<12} {s.dtype:<9} {list(s.shape)} {s.nbytes} B xxh3={s.hash.hex()}")
    for c in e.children:
        lines.extend(_entry_summary(c, depth + 1))
    return lines


def header_json(h: fmt.Header) -> dict[str, Any]:
    d = h.to_wire()
    d["tokens"] = h.tokens
    d["data_start"] = h.data_start
    d["file_size"] = h.file_size
    d["trimmable"] = h.trimmable
    d["min_reusable_offset"] = h.min_reusable_offset

    def fix(o: Any) -> Any:
        if isinstance(o, bytes):
            return o.hex()
        if isinstance(o, dict):
            return {k: fix(v) for k, v in o.items()}
        if isinstance(o, list):
            return [fix(v) for v in o]
        return o

    return dict(fix(d))


def _print_header(h: fmt.Header, path: str) -> None:
    when = datetime.datetime.fromtimestamp(h.created_at_ms / 1000, tz=datetime.UTC)
    ident = h.identity
    print(f"file         {path}")
    print(
        f"format       v{h.version}, {h.file_size} bytes, data at {h.data_start}, created {when:%Y-%m-%d %H:%M:%S} UTC"
    )
    print(f"codecs       {h.codec_provider}")
    print(
        f"identity     model={ident.model_id!r} config={ident.config_fingerprint!r} tokenizer={ident.tokenizer_hash!r} ns={ident.namespace!r}"
    )
    print(f"tokens       {len(h.tokens)}  trimmable={h.trimmable}  min_reusable={h.min_reusable_offset}")
    if h.checkpoint:
        print(f"checkpoint   {h.checkpoint.to_wire()}")
    for k, v in h.meta.items():
        print(f"meta         {k}={v}")
    print(f"caches       {len(h.caches)} ({h.data_bytes} bytes of tensors)")
    for i, e in enumerate(h.caches):
        for line in _entry_summary(e):
            print(f"  [{i}] {line}" if not line.startswith(" ") else f"      {line}")
    for a in h.attachments:
        print(f"attachment   {a.schema} {a.metadata} tensors={len(a.tensors)}")


def cmd_inspect(args: argparse.Namespace) -> int:
    from .loader import read_header, verify_file

    try:
        h = verify_file(args.file) if args.verify else read_header(args.file)
    except errors.SpillError as exc:
        if args.json:
            print(json.dumps({"ok": False, "code": exc.code, "error": str(exc)}))
        else:
            print(f"spilld: {exc} [{exc.code}]", file=sys.stderr)
        return EXIT_BAD_FILE
    if args.json:
        print(json.dumps({"ok": True, "hashes_checked": args.verify, "header": header_json(h)}, indent=2))
    else:
        _print_header(h, args.file)
        print("hashes       " + ("all tensor hashes match" if args.verify else "not checked (--no-verify)"))
    return EXIT_OK


def cmd_verify(args: argparse.Namespace) -> int:
    from .loader import verify_file

    bad = 0
    for path in args.files:
        try:
            h = verify_file(path)
            print(f"ok   {path} ({len(h.slots())} tensors, {h.data_bytes} bytes)")
        except errors.SpillError as exc:
            bad += 1
            print(f"BAD  {path}: {exc.reason} [{exc.code}]")
    return EXIT_BAD_FILE if bad else EXIT_OK


def _client(args: argparse.Namespace) -> Any:
    from .client import AsyncClient

    return AsyncClient.connect(args.socket, identity=fmt.Identity(), name=f"spilld {args.command}", timeout=10.0)


def _async(fn: Any) -> int:
    import asyncio

    from .protocol import ConnectionLost

    try:
        return int(asyncio.run(fn()))
    except ConnectionLost as exc:
        print(f"spilld: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE


def cmd_serve(args: argparse.Namespace) -> int:
    from .config import Config, parse_size
    from .daemon import AlreadyRunning, run, setup_logging
    from .service.activation import ActivationError

    try:
        cfg = Config(
            cap=parse_size(args.cap),
            disk_cap=parse_size(args.disk_cap) if args.disk_cap else None,
            dir=os.path.expanduser(args.dir or ""),
            socket=args.socket or "",
            durability=Durability(args.durability),
            drain_deadline=args.drain_deadline,
            idle_timeout=args.idle_timeout,
        )
    except ValueError as exc:
        print(f"spilld: {exc}", file=sys.stderr)
        return EXIT_USAGE
    setup_logging(args.log_level, {"json": True, "text": False, "auto": None}[args.log_format])
    try:
        return run(cfg)
    except AlreadyRunning as exc:
        print(f"spilld: {exc}", file=sys.stderr)
        return EXIT_ALREADY_RUNNING
    except ActivationError as exc:  # a unit or plist that passes the wrong socket: a configuration error
        print(f"spilld: {exc}", file=sys.stderr)
        return EXIT_USAGE


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo

    try:
        run_demo(args.socket, args.dir, as_json=args.json)
    except errors.SpillError as exc:
        print(f"spilld demo: {exc} [{exc.code}]", file=sys.stderr)
        return EXIT_UNREACHABLE
    return EXIT_OK


def cmd_drain(args: argparse.Namespace) -> int:
    tty = sys.stderr.isatty()

    def show(p: dict[str, Any]) -> None:
        if tty:
            print(
                f"\rdraining: {p['pending_items']} items, {format_size(p['pending_bytes'])} left   ",
                end="",
                file=sys.stderr,
            )

    async def go() -> int:
        client = await _client(args)
        try:
            r = await client.drain(args.timeout, progress=show)
        finally:
            await client.close()
        if tty:
            print(file=sys.stderr)
        if r["done"]:
            print("drained: everything acknowledged is durable")
            return EXIT_OK
        print(f"timeout: {r['pending_items']} items ({format_size(r['pending_bytes'])}) still queued")
        return EXIT_TIMEOUT

    return _async(go)


def cmd_status(args: argparse.Namespace) -> int:
    async def go() -> int:
        client = await _client(args)
        try:
            st = await client.status()
        finally:
            await client.close()
        if args.json:
            print(json.dumps(st, indent=2))
            return EXIT_OK
        q, d = st["queue"], st["store"]
        misses = ", ".join(f"{k} {v}" for k, v in d["misses"].items() if v) or "none"
        print(
            f"spilld {st['version']} pid {st['pid']}, up {st['uptime_s']:.0f} s, {st['clients']} clients, socket {st['socket']}"
        )
        print(f"queue   {q['pending_items']} items, {format_size(q['pending_bytes'])} of {format_size(st['cap'])} cap")
        print(
            f"        stored {q['stored']}, dropped {q['dropped']}, cancelled {q['cancelled']}, failed {q['failed']}, written {format_size(q['bytes_written'])}"
        )
        print(
            f"disk    {d['entries']} entries, {format_size(d['bytes'])} of {format_size(d['disk_cap'])} cap in {st['dir']}"
        )
        print(f"lookups hits {d['hits']}; misses: {misses}")
        by_code = ", ".join(f"{k} {v}" for k, v in d.get("errors", {}).items() if v)
        print(
            f"errors  store {d['store_errors']}{f' ({by_code})' if by_code else ''}, "
            f"quarantined {d['quarantined']}, evicted {d['evicted']}"
        )
        return EXIT_OK

    return _async(go)


def cmd_ls(args: argparse.Namespace) -> int:
    from .config import default_dir
    from .store import list_entries

    root = os.path.expanduser(args.dir or default_dir())
    rows = list_entries(root)
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    for r in rows:
        when = datetime.datetime.fromtimestamp(r["last_used"]).strftime("%Y-%m-%d %H:%M")
        print(
            f"{when}  {r['tokens']:>7} tok  {format_size(r['bytes']):>10}  {r['model_id'] or r['fingerprint']:<20} ns={r['namespace']!r}  {r['path']}"
        )
    print(f"{len(rows)} entries, {format_size(sum(r['bytes'] for r in rows))}")
    return EXIT_OK


def cmd_evict(args: argparse.Namespace) -> int:
    from .config import default_dir, parse_duration

    try:
        older = parse_duration(args.older_than) if args.older_than else None
    except ValueError as exc:
        print(f"spilld: {exc}", file=sys.stderr)
        return EXIT_USAGE
    params: dict[str, Any] = {"fingerprint": args.fingerprint, "older_than_s": older}

    async def via_daemon() -> int:
        client = await _client(args)
        try:
            r = await client.call("evict", params)
        finally:
            await client.close()
        print(f"evicted {r['evicted']} entries ({format_size(r['bytes'])})")
        return EXIT_OK

    code = _async(via_daemon)
    if code != EXIT_UNREACHABLE:
        return code
    from .store import Store

    store = Store(os.path.expanduser(args.dir or default_dir()), disk_cap=2**62)
    store.scan()
    n, nbytes = store.evict_matching(args.fingerprint, older)
    print(f"evicted {n} entries ({format_size(nbytes)}) (no daemon running: evicted from the folder directly)")
    return EXIT_OK


def _service_spec(args: argparse.Namespace) -> Any:
    from .config import parse_size
    from .service.units import ServiceSpec

    parse_size(args.cap)  # a bad size fails here, not at the service's first start
    if args.drain_deadline <= 0:
        raise ValueError(f"--drain-deadline must be positive, not {args.drain_deadline}")
    absolute = lambda p: os.path.abspath(os.path.expanduser(p)) if p else None  # noqa: E731
    return ServiceSpec(
        cap=args.cap,
        dir=absolute(args.dir),
        socket=absolute(args.socket),
        drain_deadline=args.drain_deadline,
        socket_activation=args.socket_activation,
    )


def _service_status(manager: Any, home: Path) -> int:
    from .service import install as svc

    st = svc.status(manager, home, svc.run_command)
    for path, present in st.files.items():
        print(f"{'installed' if present else 'missing  '}  {path}")
    for line in st.detail:
        print(line)
    return EXIT_OK if st.installed and st.loaded else EXIT_UNREACHABLE


def cmd_service(args: argparse.Namespace) -> int:
    from .service import install as svc

    manager = args.manager or svc.default_manager()
    if manager is None:
        print(f"spilld: no service manager for {sys.platform} (launchd or systemd)", file=sys.stderr)
        return EXIT_USAGE
    home = Path.home()
    if args.action == "status":
        return _service_status(manager, home)
    if args.action == "install":
        try:
            plan = svc.install_plan(manager, _service_spec(args), home)
        except ValueError as exc:
            print(f"spilld: {exc}", file=sys.stderr)
            return EXIT_USAGE
    else:
        plan = svc.uninstall_plan(manager, home)
    if args.dry_run:
        svc.show(plan, sys.stdout)
        return EXIT_OK
    if not svc.apply(plan, svc.run_command, sys.stderr):
        return EXIT_SERVICE
    print(f"{args.action}ed: {', '.join(str(p) for p in [*plan.write, *plan.remove])}")
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    from .config import default_dir, default_socket

    p = argparse.ArgumentParser(
        prog="spilld",
        description="A write-behind cold tier for the KV caches of local mlx LLM engines. "
        "Without a command, runs the daemon (same as `spilld serve`).",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"spilld {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    def add(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name, help=help, description=help, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
        )

    def with_socket(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--socket", default=None, help=f"the daemon's socket (default {default_socket()})")

    srv = add("serve", "run the daemon")
    srv.add_argument(
        "--cap", default="4GiB", help="soft cap on queued bytes in memory (default 4GiB; e.g. 512MiB, 2G, 10GB)"
    )
    srv.add_argument(
        "--disk-cap",
        default=None,
        help="cap on the folder's size (default: the smaller of 64 GiB and a quarter of the free space)",
    )
    srv.add_argument("--dir", default=None, help=f"where cache files live (default {default_dir()})")
    with_socket(srv)
    srv.add_argument(
        "--durability",
        default="fsync",
        choices=[d.value for d in Durability],
        help="full (F_FULLFSYNC on macOS), fsync (default) or none",
    )
    srv.add_argument(
        "--drain-deadline", type=float, default=60.0, help="seconds to finish queued work on SIGTERM (default 60)"
    )
    srv.add_argument(
        "--idle-timeout", type=float, default=300.0, help="disconnect clients silent this long (default 300 s)"
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
    de.add_argument("--dir", help="the store folder of a daemon the demo starts (default: the platform cache folder)")
    de.add_argument("--json", action="store_true", help="print the figures as one JSON line")
    de.set_defaults(func=cmd_demo)

    dr = add("drain", "wait until everything queued in the daemon is durable")
    with_socket(dr)
    dr.add_argument("--timeout", type=float, default=None, help="give up after this many seconds (exit code 3)")
    dr.set_defaults(func=cmd_drain)

    st = add("status", "queue, disk, hits and misses, errors")
    with_socket(st)
    st.add_argument("--json", action="store_true")
    st.set_defaults(func=cmd_status)

    ls = add("ls", "list the stored entries (reads the folder; needs no daemon)")
    ls.add_argument("--dir", default=None)
    ls.add_argument("--json", action="store_true")
    ls.set_defaults(func=cmd_ls)

    ev = add("evict", "remove entries (all, or of one model, or unused for a while) and empty model folders")
    with_socket(ev)
    ev.add_argument("--dir", default=None)
    ev.add_argument("--fingerprint", default=None, help="only entries in this identity folder")
    ev.add_argument("--older-than", default=None, help="only entries unused for this long (e.g. 7d, 12h, 30m)")
    ev.set_defaults(func=cmd_evict)

    ins = add("inspect", "show a cache file's header and tensors, and check its hashes")
    ins.add_argument("file")
    ins.add_argument("--json", action="store_true", help="machine-readable output")
    ins.add_argument(
        "--no-verify", dest="verify", action="store_false", help="read the header only; skip the tensor hashes"
    )
    ins.set_defaults(func=cmd_inspect)

    ver = add("verify", "check files end to end (header, layout, every tensor hash)")
    ver.add_argument("files", nargs="+")
    ver.set_defaults(func=cmd_verify)

    svc = add(
        "service",
        "install, remove or show spilld as a user service (launchd on macOS, systemd on Linux); "
        "the service files run `spilld serve` with the options below",
    )
    svc.add_argument(
        "action",
        choices=["install", "uninstall", "status"],
        help="install: write the files, load and start the service; uninstall: stop it (it drains), unload, "
        "remove the files; status: are the files there and is it loaded (exit 4 if not)",
    )
    svc.add_argument("--dry-run", action="store_true", help="print the files and the commands; change nothing")
    svc.add_argument("--cap", default="4GiB", help="the daemon's --cap (default 4GiB)")
    svc.add_argument("--dir", default=None, help="the daemon's --dir (default: its own default)")
    svc.add_argument("--socket", default=None, help="the daemon's --socket (default: its own default)")
    svc.add_argument(
        "--drain-deadline",
        type=float,
        default=60.0,
        help="the daemon's --drain-deadline (default 60); launchd's ExitTimeOut is this plus 30 s, systemd's stop "
        "timeout is 30 s, extended by the daemon while its drain advances",
    )
    svc.add_argument(
        "--socket-activation",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="let the manager own the socket and hand it to the daemon (default: on)",
    )
    svc.add_argument("--manager", choices=["launchd", "systemd"], default=None, help="default: the platform's own")
    svc.set_defaults(func=cmd_service)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help", "--version")):
        argv = ["serve", *argv]
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
