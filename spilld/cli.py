"""The ``spilld`` command line: the daemon (``spilld`` = ``spilld serve``) and its tools.

Every size and duration goes through one parser (``config.parse_size`` / ``parse_duration``), every refusal is
one line on stderr with exit 2, and no input ends in a traceback: errors map to the exit codes of ``EPILOG``.
``--socket`` and ``--dir`` are accepted before or after the command.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import stat
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, NoReturn

from . import __version__, errors
from . import format as fmt
from .blocks import DEFAULT_BLOCK_TOKENS
from .config import (
    DEFAULT_IO_TIMEOUT_S,
    DEFAULT_SCRUB_INTERVAL_S,
    DEFAULT_SCRUB_RATE,
    DEFAULT_WARM_BUDGET,
    DEFAULT_WARM_RATE,
    Config,
    check_socket_path,
    format_size,
    parse_duration,
    parse_size,
)
from .fileio import Durability

EXIT_OK = 0
EXIT_BAD_FILE = 1
EXIT_USAGE = 2
EXIT_TIMEOUT = 3
EXIT_UNREACHABLE = 4
EXIT_ALREADY_RUNNING = 5
EXIT_SERVICE = 6
EXIT_DAEMON_ERROR = 7
EXIT_NOT_INSTALLED = 8  # `service status`: not installed or not loaded (4 stays 'cannot reach the daemon')
EXIT_INTERNAL = 70  # sysexits' EX_SOFTWARE: a bug of ours
EXIT_INTERRUPTED = 130  # 128 + SIGINT
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: whoever read our output went away

PROGRESS_EVERY_S = 0.1  # a terminal's progress line is redrawn at most this often
DEBUG_ENV = "SPILLD_DEBUG"  # set to 1: an internal error shows its traceback

EPILOG = """exit codes:
  0  success (drain: everything acknowledged is durable)
  1  a file failed a check (corrupt, truncated, foreign, unreadable)
  2  usage or configuration error (a bad option, an unusable folder or socket path)
  3  timeout: drain (or a stop) left work unfinished; a daemon stopped by a second signal
  4  the daemon cannot be reached
  5  another daemon already serves this socket or folder
  6  service: launchctl or systemctl refused a command, or did not finish in time
  7  the daemon refused the request (its error code is printed)
  8  service status: the service is not installed, or not loaded
  70 internal error (a bug: SPILLD_DEBUG=1 shows the traceback)
"""

GLOBAL_OPTIONS = ("--socket", "--dir")  # each takes one value; accepted before or after the command
UNREACHABLE_CODES = {"connection_lost", "busy", "timeout"}  # the daemon is gone, stopping, or silent
USAGE_CODES = {"unusable_folder", "foreign_daemon", "activation_error"}


class UsageError(Exception):
    """A bad option or path found after parsing: one line, exit 2."""


def plural(n: int, word: str, words: str | None = None) -> str:
    """'1 entry', '2 entries', '0 clients'."""
    return f"{n} {word if n == 1 else (words or word + 's')}"


class Progress:
    """A progress line on a terminal (stderr), redrawn at most every PROGRESS_EVERY_S; silent otherwise."""

    def __init__(self, label: str, *, quiet: bool = False) -> None:
        self.label = label
        self.on = not quiet and sys.stderr.isatty()
        self._last = 0.0
        self._shown = False

    def show(self, items_left: int, bytes_left: int, *, force: bool = False) -> None:
        now = time.monotonic()
        if not self.on or (not force and now - self._last < PROGRESS_EVERY_S):
            return
        self._last, self._shown = now, True
        left = f"{plural(items_left, 'item')}, {format_size(bytes_left)} left"
        print(f"\r{self.label}: {left}   ", end="", file=sys.stderr, flush=True)

    def done(self) -> None:
        if self._shown:
            print(file=sys.stderr)
            self._shown = False


# --- argument types: one parser for every size and duration --------------------------------------


def _arg_type(parse: Callable[[str], Any], name: str) -> Callable[[str], Any]:
    def convert(text: str) -> Any:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = name  # argparse names the type in its messages
    return convert


size_arg = _arg_type(parse_size, "size")
size_or_zero_arg = _arg_type(lambda t: parse_size(t, minimum=0), "size")
duration_arg = _arg_type(parse_duration, "duration")
positive_duration_arg = _arg_type(lambda t: parse_duration(t, positive=True), "duration")
socket_arg = _arg_type(check_socket_path, "socket path")


def _checked_text(text: str) -> str:
    parse_size(text)
    return text


size_text_arg = _arg_type(_checked_text, "size")  # checked, kept as written (service files pass it on)


class Parser(argparse.ArgumentParser):
    """argparse with one-line refusals (exit 2) instead of a usage block."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USAGE, f"{self.prog}: {message} (see `{self.prog} --help`)\n")


# --- paths ---------------------------------------------------------------------------------------------


def folder_arg(path: str | None, default: Callable[[], str], *, must_exist: bool) -> str:
    """An absolute folder for ``--dir``; UsageError if it names a file or sits below one (or, with
    ``must_exist``, is missing). Nothing is created here."""
    full = os.path.abspath(os.path.expanduser(path or default()))
    probe = full
    while not os.path.lexists(probe):
        if must_exist:
            raise UsageError(f"no such folder: {full}")
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        where = "is not a folder" if probe == full else f"is below {probe}, which is not a folder"
        raise UsageError(f"--dir {full} {where}")
    return full


def regular_file(path: str) -> str:
    """``path`` if it is a file we can read as one (a folder or a FIFO would fail or hang): else UsageError."""
    try:
        st = os.stat(path)
    except OSError as exc:
        raise UsageError(f"{path}: {exc.strerror}") from None
    if stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{path} is a folder (`spilld verify --dir {path}` checks a whole store)")
    if not stat.S_ISREG(st.st_mode):
        raise UsageError(f"{path} is not a regular file")
    return path


def _socket(args: argparse.Namespace) -> str:
    """``--socket``, else the default (``$SPILLD_SOCKET`` included), checked like the option."""
    from .config import default_socket

    try:
        return check_socket_path(args.socket or default_socket())
    except ValueError as exc:
        raise UsageError(f"{exc} (from SPILLD_SOCKET or the default)") from None


# --- inspect, verify ---------------------------------------------------------------------------------


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
    return dict(_jsonable(d))


def _jsonable(o: Any) -> Any:
    """``o`` with every bytes value as hex."""
    if isinstance(o, bytes):
        return o.hex()
    if isinstance(o, dict):
        return {k: _jsonable(v) for k, v in o.items()}
    if isinstance(o, list):
        return [_jsonable(v) for v in o]
    return o


def _print_header(h: fmt.Header, path: str) -> None:
    when = datetime.datetime.fromtimestamp(h.created_at_ms / 1000, tz=datetime.UTC)
    ident = h.identity
    print(f"file         {path}")
    packed = ", packed (64-byte alignment)" if h.align == fmt.COMPACT_ALIGN else ""
    print(
        f"format       v{h.version}, {h.file_size} bytes, data at {h.data_start}{packed}, "
        f"created {when:%Y-%m-%d %H:%M:%S} UTC"
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

    path = regular_file(args.file)
    try:
        h = verify_file(path) if args.verify else read_header(path)
    except errors.SpillError as exc:
        if args.json:
            print(json.dumps({"ok": False, "code": exc.code, "error": str(exc)}))
        else:
            print(f"spilld: {exc} [{exc.code}]", file=sys.stderr)
        return EXIT_BAD_FILE
    if args.json:
        print(json.dumps({"ok": True, "hashes_checked": args.verify, "header": header_json(h)}, indent=2))
    else:
        _print_header(h, path)
        print("hashes       " + ("all tensor hashes match" if args.verify else "not checked (--no-verify)"))
    return EXIT_OK


def store_files(root: str) -> list[tuple[str, str]]:
    """(path, identity folder) of every entry file under a store's root, temp files and quarantine left out."""
    from .fileio import is_temp_name
    from .store import EXT

    found = []
    for fp in sorted(os.listdir(root)):
        fp_dir = os.path.join(root, fp)
        if fp.startswith(".") or not os.path.isdir(fp_dir):
            continue
        for dirpath, _, names in os.walk(fp_dir):
            found += [(os.path.join(dirpath, n), fp) for n in sorted(names) if n.endswith(EXT) and not is_temp_name(n)]
    return found


def _check_file(path: str, folder_fp: str | None) -> tuple[str | None, fmt.Header | None]:
    """(why it is bad or None, its header): every hash, and for a store's file, that it sits in its identity's
    folder."""
    from .entries import identity_fingerprint
    from .loader import verify_file

    try:
        h = verify_file(path)
    except errors.SpillError as exc:
        return f"{exc.reason} [{exc.code}]", None
    if folder_fp is not None and identity_fingerprint(h.identity) != folder_fp:
        return "sits in the folder of another identity [header_malformed]", h
    return None, h


def _verify_store(root: str, quiet: bool) -> tuple[int, int]:
    """Check every entry of a store: (files checked, bad ones); bad ones are printed as they are found."""
    files = store_files(root)
    sizes = {p: os.path.getsize(p) if os.path.exists(p) else 0 for p, _ in files}
    progress = Progress(f"verifying {root}", quiet=quiet)
    left_bytes, bad = sum(sizes.values()), 0
    for i, (path, fp) in enumerate(files):
        progress.show(len(files) - i, left_bytes)
        why, _ = _check_file(path, fp)
        left_bytes -= sizes[path]
        if why is not None:
            bad += 1
            progress.done()
            print(f"BAD  {path}: {why}")
    progress.done()
    print(f"{root}: {plural(len(files), 'entry', 'entries')} ({format_size(sum(sizes.values()))}) checked, {bad} bad")
    return len(files), bad


def cmd_verify(args: argparse.Namespace) -> int:
    from .config import default_dir

    if not args.files and args.dir is None:
        raise UsageError("verify needs FILE... or --dir DIR (a whole store)")
    bad = 0
    if args.dir is not None:
        bad += _verify_store(folder_arg(args.dir, default_dir, must_exist=True), args.quiet)[1]
    for path in args.files:
        if os.path.isdir(path):  # a folder named as a file: checked as a store
            bad += _verify_store(os.path.abspath(path), args.quiet)[1]
            continue
        regular_file(path)
        why, h = _check_file(path, None)
        if why is None and h is not None:
            print(f"ok   {path} ({len(h.slots())} tensors, {h.data_bytes} bytes)")
        else:
            bad += 1
            print(f"BAD  {path}: {why}")
    return EXIT_BAD_FILE if bad else EXIT_OK


# --- talking to the daemon ------------------------------------------------------------------------------


def _control(args: argparse.Namespace) -> Any:
    from .control import Control

    return Control(_socket(args), name=f"spilld {args.command}")


def _ask(args: argparse.Namespace, method: str, params: dict[str, Any] | None = None, **kw: Any) -> Any:
    with _control(args) as c:
        return c.call(method, params or {}, **kw)


def cmd_serve(args: argparse.Namespace) -> int:
    from .config import Config, default_dir
    from .daemon import AlreadyRunning, run, setup_logging
    from .service.activation import ActivationError

    try:
        cfg = Config(
            cap=args.cap,
            disk_cap=args.disk_cap,
            dir=folder_arg(args.dir, default_dir, must_exist=False),
            socket=args.socket or "",
            durability=Durability(args.durability),
            drain_deadline=args.drain_deadline,
            idle_timeout=args.idle_timeout,
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
        )
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    _check_socket_target(cfg.socket)
    _check_remote(cfg)
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


def _check_remote(cfg: Config) -> None:
    """``--remote``: the extra installed, the URL, the password and key files usable (nothing is connected)."""
    if not cfg.remote:
        return
    try:
        from .remote import RemoteConfigError
        from .remote.link import check_remote
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
    from .demo import run_demo

    try:
        run_demo(args.socket, args.dir, as_json=args.json)
    except errors.SpillError as exc:
        if exc.code != errors.SpillError.code:
            raise  # typed: mapped like any command's
        print(f"spilld demo: {exc}", file=sys.stderr)  # no daemon could be started or reached
        return EXIT_UNREACHABLE
    return EXIT_OK


def cmd_drain(args: argparse.Namespace) -> int:
    progress = Progress("draining")

    def show(note: Any) -> None:
        if note.method == "drain_progress":
            progress.show(int(note.params["pending_items"]), int(note.params["pending_bytes"]), force=True)

    wait = 3600.0 if args.timeout is None else args.timeout  # the daemon's own default
    try:
        r = _ask(args, "drain", {"timeout": wait}, timeout=None, on_note=show)
    finally:
        progress.done()
    if r["done"]:
        print("drained: everything acknowledged is durable")
        return EXIT_OK
    left = plural(int(r["pending_items"]), "item")
    print(f"timeout: {left} ({format_size(r['pending_bytes'])}) still queued")
    return EXIT_TIMEOUT


def cmd_pin(args: argparse.Namespace) -> int:
    """Pin or unpin an entry through the daemon (evicted last, never superseded; kept across restarts)."""
    path = os.path.abspath(args.path)
    r = _ask(args, "pin", {"path": path, "on": not args.unpin})
    if not r["found"]:
        print(f"spilld: {path}: not an entry of the daemon's store (see spilld ls)", file=sys.stderr)
        return EXIT_BAD_FILE
    print(f"{'unpinned' if args.unpin else 'pinned'} {path}")
    return EXIT_OK


def _print_status(st: dict[str, Any]) -> None:
    q, d = st["queue"], st["store"]
    misses = ", ".join(f"{k} {v}" for k, v in d["misses"].items() if v) or "none"
    clients = plural(int(st["clients"]), "client")
    print(f"spilld {st['version']} pid {st['pid']}, up {st['uptime_s']:.0f} s, {clients}, socket {st['socket']}")
    items = plural(int(q["pending_items"]), "item")
    print(f"queue   {items}, {format_size(q['pending_bytes'])} of {format_size(st['cap'])} cap")
    print(
        f"        stored {q['stored']}, dropped {q['dropped']}, cancelled {q['cancelled']}, failed {q['failed']}, "
        f"written {format_size(q['bytes_written'])}"
    )
    entries = plural(int(d["entries"]), "entry", "entries")
    print(f"disk    {entries}, {format_size(d['bytes'])} of {format_size(d['disk_cap'])} cap in {st['dir']}")
    if "blocks" in d:
        print(
            f"blocks  {d['blocks']} ({format_size(d['block_bytes'])}), written {d['blocks_written']}, "
            f"reused {d['blocks_reused']}, reclaimed {d['blocks_reclaimed']}"
            + (f"; not sent by clients (held) {format_size(st['ingest']['held_bytes'])}" if "ingest" in st else "")
        )
    if "written_day" in d:
        budget = f" of a {format_size(d['write_budget'])} budget" if d.get("write_budget") else ""
        print(
            f"wear    written {format_size(d['written_day'])} in 24 h{budget}, {format_size(d['written_week'])} in 7 days,"
            f" {format_size(d['bytes_written'])} since start; shed for the budget {d['dropped_budget']}"
        )
        unique = int(d.get("unique_added", 0))
        amp = f"{int(d['bytes_written']) / unique:.2f}x" if unique else "-"
        gate = (
            f", shed by the gate (--admit-after {d['admit_after']}) {d['dropped_admit']}"
            if d.get("admit_after")
            else ""
        )
        print(f"        unique bytes added {format_size(unique)}, write amplification {amp}{gate}")
    if "warm" in st:
        w = st["warm"]
        print(
            f"warm    read {format_size(w['read_bytes'])} of {format_size(w['planned_bytes'])} ahead "
            f"({w['files']} files), {'done' if w['done'] else 'reading'}"
        )
    if "scrub" in st:
        s = st["scrub"]
        state = "paused (serving)" if s["paused"] else f"{s['files']} of {s['planned_files']} files checked"
        print(
            f"scrub   {state} in this pass ({format_size(s['bytes'])}), {s['passes']} passes done, "
            f"{s['bad']} bad files found"
        )
    if "remote" in st:
        r = st["remote"]
        misses = ", ".join(f"{k} {v}" for k, v in {**r.get("misses", {}), **r.get("fill_misses", {})}.items() if v)
        print(
            f"remote  {r.get('state')}, push {r.get('push')}: fills {r.get('fills')}, hits {r.get('hits')}, "
            f"fetched {format_size(int(r.get('bytes_fetched', 0)))}, pushed {format_size(int(r.get('bytes_pushed', 0)))}"
            f", queue {r.get('queue', {}).get('len', 0)}; misses: {misses or 'none'}"
        )
    lookups = f"{st['lookups']}, " if "lookups" in st else ""
    print(f"lookups {lookups}hits {d['hits']} (restores the clients kept); misses: {misses}")
    by_code = ", ".join(f"{k} {v}" for k, v in d.get("errors", {}).items() if v)
    print(
        f"errors  store {d['store_errors']}{f' ({by_code})' if by_code else ''}, "
        f"quarantined {d['quarantined']}, evicted {d['evicted']}"
    )


def cmd_status(args: argparse.Namespace) -> int:
    form = "json" if args.json else args.format
    try:
        st = dict(_ask(args, "status"))
    except errors.SpillError as exc:
        if form == "json":  # a script still gets an object to read
            print(json.dumps({"ok": False, "code": exc.code, "error": str(exc), "socket": _socket(args)}))
        raise
    if form == "json":
        print(json.dumps(st, indent=2))
    elif form == "prometheus":
        from .metrics import exposition

        sys.stdout.write(exposition(st).decode())
    else:
        _print_status(st)
    return EXIT_OK


# --- ls, evict -------------------------------------------------------------------------------------------


def quarantine_files(root: str) -> list[dict[str, Any]]:
    """The files moved aside as bad, oldest first (their names start with the time they were moved)."""
    from .store import QUARANTINE

    qdir = os.path.join(root, QUARANTINE)
    rows = []
    for name in sorted(os.listdir(qdir)) if os.path.isdir(qdir) else []:
        path = os.path.join(qdir, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue  # removed meanwhile
        if stat.S_ISREG(st.st_mode):
            rows.append({"path": path, "bytes": st.st_size, "moved": st.st_mtime})
    return rows


def cmd_ls(args: argparse.Namespace) -> int:
    from .config import default_dir
    from .store import list_entries

    root = folder_arg(args.dir, default_dir, must_exist=False)
    if args.quarantine:
        qrows = quarantine_files(root)
        if args.json:
            print(json.dumps(qrows, indent=2))
            return EXIT_OK
        for r in qrows:
            when = datetime.datetime.fromtimestamp(r["moved"]).strftime("%Y-%m-%d %H:%M")
            print(f"{when}  {format_size(r['bytes']):>10}  {r['path']}")
        total = format_size(sum(r["bytes"] for r in qrows))
        print(f"{plural(len(qrows), 'quarantined file')}, {total} in {root}")
        return EXIT_OK
    rows = list_entries(root)
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    for r in rows:
        when = datetime.datetime.fromtimestamp(r["last_used"]).strftime("%Y-%m-%d %H:%M")
        print(
            f"{when}  {r['tokens']:>7} tok  {format_size(r['bytes']):>10}  {r['model_id'] or r['fingerprint']:<20} ns={r['namespace']!r}  {r['path']}"
        )
    total = format_size(sum(r["bytes"] for r in rows))
    print(f"{plural(len(rows), 'entry', 'entries')}, {total} in {root}")
    return EXIT_OK


def _remove_files(rows: list[dict[str, Any]], label: str, quiet: bool) -> tuple[int, int]:
    """Unlink each row's path, with progress: (files removed, their bytes)."""
    progress = Progress(label, quiet=quiet)
    left, n, nbytes = sum(r["bytes"] for r in rows), 0, 0
    for i, r in enumerate(rows):
        progress.show(len(rows) - i, left)
        left -= r["bytes"]
        try:
            os.unlink(r["path"])
        except FileNotFoundError:
            continue  # gone meanwhile (superseded, evicted by a daemon)
        n, nbytes = n + 1, nbytes + r["bytes"]
    progress.done()
    return n, nbytes


def _evict_direct(root: str, args: argparse.Namespace, older: float | None) -> tuple[int, int]:
    """Evict from a folder no daemon answers for, under the folder's lock: a daemon serving it on another socket
    holds it (AlreadyRunning names its pid), and none can start on it meanwhile."""
    from .lockfile import LOCK_NAME, FileLock
    from .store import list_entries, remove_empty_folders

    lock = FileLock(os.path.join(root, LOCK_NAME), f"the folder {root}")
    lock.acquire()
    try:
        cutoff = time.time() - older if older is not None else None
        rows = [
            r
            for r in list_entries(root)
            if (args.fingerprint is None or r["fingerprint"] == args.fingerprint)
            and (cutoff is None or r["last_used"] < cutoff)
        ]
        got = _remove_files(rows, f"evicting from {root}", args.json)
        remove_empty_folders(root)
    finally:
        lock.release()
    return got


def _daemon_dir(args: argparse.Namespace) -> str | None:
    """The folder of the daemon answering on the socket, or None when none answers."""
    from .protocol import ConnectionLost

    try:
        with _control(args) as c:
            return str(c.server.get("dir") or "") or None
    except ConnectionLost:
        return None


def _same_folder(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def cmd_evict(args: argparse.Namespace) -> int:
    """Evict through the daemon that serves the folder, else from the folder itself; say which."""
    from .config import default_dir

    if not (args.all or args.fingerprint or args.older_than is not None or args.quarantine):
        raise UsageError("evict needs --fingerprint, --older-than, --quarantine or --all (every entry)")
    served = _daemon_dir(args)
    root = folder_arg(args.dir or served, default_dir, must_exist=True)
    if served is not None and not _same_folder(root, served):
        raise UsageError(
            f"the daemon on {_socket(args)} serves {served}, not {root}: stop it, or name its socket with --socket"
        )
    out: dict[str, Any] = {"dir": root, "through_daemon": served is not None, "evicted": 0, "bytes": 0}
    if args.all or args.fingerprint or args.older_than is not None:
        params = {"fingerprint": args.fingerprint, "older_than_s": args.older_than}
        if served is not None:
            progress = Progress(f"evicting from {root}", quiet=args.json)

            def show(note: Any) -> None:
                if note.method == "evict_progress":
                    progress.show(int(note.params["pending_items"]), int(note.params["pending_bytes"]), force=True)

            try:
                r = _ask(args, "evict", params, timeout=None, on_note=show)
            finally:
                progress.done()
            out["evicted"], out["bytes"] = int(r["evicted"]), int(r["bytes"])
        else:
            out["evicted"], out["bytes"] = _evict_direct(root, args, args.older_than)
    if args.quarantine:
        out["quarantine_removed"], out["quarantine_bytes"] = _remove_files(
            quarantine_files(root), "removing quarantined files", args.json
        )
    _print_evicted(out, _socket(args), args.json)
    return EXIT_OK


def _print_evicted(out: dict[str, Any], sock: str, as_json: bool) -> None:
    if as_json:
        print(json.dumps(out))
        return
    how = f"through the daemon on {sock}" if out["through_daemon"] else "from the folder (no daemon answers)"
    print(f"evicted {plural(out['evicted'], 'entry', 'entries')} ({format_size(out['bytes'])}) from {out['dir']} {how}")
    if "quarantine_removed" in out:
        n, nbytes = out["quarantine_removed"], out["quarantine_bytes"]
        print(f"removed {plural(n, 'quarantined file')} ({format_size(nbytes)})")


# --- service ---------------------------------------------------------------------------------------------


def _service_spec(args: argparse.Namespace) -> Any:
    from .service.units import ServiceSpec

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
    return EXIT_OK if st.installed and st.loaded else EXIT_NOT_INSTALLED


def cmd_service(args: argparse.Namespace) -> int:
    from .service import install as svc

    manager = args.manager or svc.default_manager()
    if manager is None:
        raise UsageError(f"no service manager for {sys.platform} (launchd or systemd)")
    home = Path.home()
    if args.action == "status":
        return _service_status(manager, home)
    if args.action == "install":
        plan = svc.install_plan(manager, _service_spec(args), home)
    else:
        plan = svc.uninstall_plan(manager, home)
    if args.dry_run:
        svc.show(plan, sys.stdout)
        return EXIT_OK
    if not svc.apply(plan, svc.run_command, sys.stderr):
        return EXIT_SERVICE
    print(f"{args.action}ed: {', '.join(str(p) for p in [*plan.write, *plan.remove])}")
    return EXIT_OK


# --- the parser ------------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    from .config import default_dir, default_socket

    p = Parser(
        prog="spilld",
        description="A write-behind cold tier for the KV caches of local mlx LLM engines. "
        "Without a command, runs the daemon (same as `spilld serve`). "
        "--socket and --dir may come before or after the command.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"spilld {__version__}")
    p.add_argument("--socket", type=socket_arg, default=None, help=f"the daemon's socket (default {default_socket()})")
    p.add_argument("--dir", default=None, help=f"the store's folder (default {default_dir()})")
    sub = p.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)

    def add(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(
            name, help=help, description=help, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
        )

    # Given after the command, the global options land in the same place; SUPPRESS keeps one given before.
    def with_socket(sp: argparse.ArgumentParser) -> None:
        sp.add_argument(
            "--socket",
            type=socket_arg,
            default=argparse.SUPPRESS,
            help=f"the daemon's socket (default {default_socket()})",
        )

    def with_dir(sp: argparse.ArgumentParser, help: str) -> None:
        sp.add_argument("--dir", default=argparse.SUPPRESS, help=help)

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
        help="cap on the folder's size (default: the smaller of 64 GiB and a quarter of the free space)",
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
        f"writes only its new blocks (default {DEFAULT_BLOCK_TOKENS}; 0 writes every entry whole)",
    )
    srv.add_argument(
        "--write-budget",
        type=size_arg,
        default=None,
        help="bytes written a day, at most (e.g. 20GiB): past it, droppable spills are shed and counted, "
        "non-droppable ones still written; the count restarts with the daemon (default: no budget)",
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
        help="the write gate: a droppable spill's new blocks are written only once a lookup asked for their prefix "
        "this many times (one-off prompts never reach the disk); the counts are kept in memory (default 0: off)",
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
        help="a write step or an unlink that takes longer fails its work, so a hung disk never stalls serving: "
        "the spill fails (io_timeout), lookups and other clients go on (default 30s)",
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
        help="a scrub pass starts at most this often (default 1d); the first one 10 minutes after a start",
    )
    srv.add_argument(
        "--remote",
        metavar="URL",
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
        type=int,
        default=None,
        metavar="SECONDS",
        help="keys pushed expire after this long unused (each fetch renews them; default: kept until Redis evicts)",
    )
    srv.add_argument(
        "--remote-password-file", default=None, help="a file (mode 0600) holding the remote tier's password"
    )
    srv.add_argument(
        "--remote-key-file",
        default=None,
        help="a file (mode 0600, 32 bytes or more) whose key encrypts everything pushed (AES-GCM, a key per "
        "namespace): a host without it gets misses, never plaintext",
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
        "--metrics-file",
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
        "--timeout", type=duration_arg, default=None, help="give up after this long (e.g. 30, 5m; exit code 3)"
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
    ev.add_argument("--fingerprint", default=None, help="only entries in this identity folder")
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
    ver.add_argument("files", nargs="*", help="files (a folder is checked as a store)")
    with_dir(ver, "check every entry of this store")
    ver.add_argument("--quiet", action="store_true", help="no progress line")
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
    svc.add_argument("--cap", type=size_text_arg, default="4GiB", help="the daemon's --cap (default 4GiB)")
    with_dir(svc, "the daemon's --dir (default: its own default)")
    svc.add_argument(
        "--socket", type=socket_arg, default=argparse.SUPPRESS, help="the daemon's --socket (default: its own default)"
    )
    svc.add_argument(
        "--drain-deadline",
        type=positive_duration_arg,
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


def with_command(argv: list[str], commands: Sequence[str]) -> list[str]:
    """``argv`` with ``serve`` put where the command would be, when none is given (``spilld --cap 2G``).

    The global options (``GLOBAL_OPTIONS``) before it are skipped over with their values."""
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok in ("-h", "--help", "--version") or tok in commands:
            return argv
        if tok in GLOBAL_OPTIONS:
            i += 2
        elif tok.split("=", 1)[0] in GLOBAL_OPTIONS:
            i += 1
        elif tok.startswith("-"):
            break  # a daemon option: the command is the implicit serve
        else:
            return argv  # not a command: argparse says so
    return [*argv[:i], "serve", *argv[i:]]


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
    commands = [c for a in parser._actions if isinstance(a, argparse._SubParsersAction) for c in a.choices]
    args_list = with_command(list(sys.argv[1:] if argv is None else argv), commands)
    try:
        args = parser.parse_args(args_list)
    except SystemExit as exc:  # --help, --version, or a refusal already printed
        return int(exc.code or 0) if not isinstance(exc.code, str) else EXIT_USAGE
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return int(args.func(args))
    except UsageError as exc:
        return _fail(str(exc), EXIT_USAGE)
    except errors.SpillError as exc:
        return _fail(f"{exc} [{exc.code}]", _exit_for(exc))
    except KeyboardInterrupt:
        return _fail("interrupted", EXIT_INTERRUPTED)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error at exit's flush
        return EXIT_BROKEN_PIPE
    except OSError as exc:
        return _fail(f"{exc.strerror or exc}{f': {exc.filename}' if exc.filename else ''}", EXIT_USAGE)
    except Exception as exc:
        if os.environ.get(DEBUG_ENV):
            raise
        return _fail(f"internal error: {exc!r} (set {DEBUG_ENV}=1 for the traceback)", EXIT_INTERNAL)


if __name__ == "__main__":
    sys.exit(main())
