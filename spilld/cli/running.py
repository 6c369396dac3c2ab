"""``drain``, ``pin`` and ``status``: commands to a running daemon."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any

from .. import errors
from ..config import format_size
from ..protocol import DRAIN_DEFAULT_S
from .common import EXIT_BAD_FILE, EXIT_OK, EXIT_TIMEOUT, Progress, ask, control, plural, socket_path

ANSWER_GRACE_S = 5.0  # past the drain's timeout, how long its answer may take to come back (never the hello's)
HELLO_FLOOR_S = 1.0  # the least time a drain's hello is given (`--timeout 0` asks what is queued now)


def _hello_bound(wait: float) -> float:
    """The hello's bound: ``--timeout`` alone, floored, at most ``CONNECT_TIMEOUT_S`` as for every command (found
    in review: the answer's grace applied to it too, so `drain --timeout 2` on a hung daemon took 7 s, exit 3)."""
    from ..control import CONNECT_TIMEOUT_S

    return min(max(wait, HELLO_FLOOR_S), CONNECT_TIMEOUT_S)


def _ask_drain(c: Any, end: float, show: Any) -> dict[str, Any] | None:
    """The drain's answer, given what is left until ``end`` and ``ANSWER_GRACE_S`` more (``Timeout`` past them);
    None if the daemon went away after its hello."""
    left = max(0.0, end - time.monotonic())
    try:
        return dict(c.call("drain", {"timeout": left}, timeout=left + ANSWER_GRACE_S, on_note=show))
    except errors.ConnectionLost:
        return None


def cmd_drain(args: argparse.Namespace) -> int:
    progress = Progress("draining")

    def show(note: Any) -> None:
        if note.method == "drain_progress":
            progress.show(int(note.params["pending_items"]), int(note.params["pending_bytes"]), force=True)

    wait = DRAIN_DEFAULT_S if args.timeout is None else args.timeout
    t0 = time.monotonic()
    try:  # a hello never answered is Timeout, exit 4 (the daemon cannot be reached), as for `status`
        with control(args, _hello_bound(wait)) as c:
            try:  # bounded here too: a daemon that stopped answering (hung, SIGSTOP) must not hold a shutdown script
                r = _ask_drain(c, t0 + wait, show)
            except errors.Timeout:
                print(f"timeout: the daemon did not answer within {time.monotonic() - t0:.1f} s")
                return EXIT_TIMEOUT
    finally:
        progress.done()
    if r is None:  # it answered the hello, then went away (found in review: exit 4, "cannot be reached")
        print("the daemon went away during the drain: what it had queued may not be durable")
        return EXIT_TIMEOUT
    lost = int(r.get("not_stored", 0))
    if r["done"] and lost:  # settled, but not durable: dropped by the cap, failed, or cancelled by a stop
        print(
            f"drained, but {plural(lost, 'item')} ended not stored (dropped, failed or cancelled: see the daemon's log)"
        )
        return EXIT_TIMEOUT
    if r["done"]:
        print("drained: everything acknowledged is durable")
        return EXIT_OK
    left = plural(int(r["pending_items"]), "item")
    print(f"timeout: {left} ({format_size(r['pending_bytes'])}) still queued")
    return EXIT_TIMEOUT


def as_the_daemon_names_it(path: str, served: str) -> str:
    """``path`` spelled from ``served``, the daemon's folder as it names it, when the file lies in that folder under
    another name: a symbolic link on the way, or a path relative to the current folder inside it, which the system
    spells from the real folder (found in review: `cd DIR && spilld pin F` of a listed entry was "not an entry"
    whenever DIR held a link, since the daemon knows its entries by its own spelling only)."""
    if not served:
        return path
    real, root = os.path.realpath(path), os.path.realpath(served)
    if os.path.commonpath([real, root]) != root:
        return path  # not in its folder: refused as it is
    return os.path.normpath(os.path.join(served, os.path.relpath(real, root)))


def cmd_pin(args: argparse.Namespace) -> int:
    """Pin or unpin an entry through the daemon (evicted last, never superseded; kept across restarts)."""
    with control(args) as c:
        path = as_the_daemon_names_it(os.path.abspath(args.path), str(c.server.get("dir") or ""))
        r = c.call("pin", {"path": path, "on": not args.unpin})
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
        f"entry files written {format_size(q['bytes_written'])} (blocks: below)"
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
        # files still stored that it could not read (EIO: a failing disk) are said too (found in review: only in
        # --json and the log, the text said "0 bad files found")
        unreadable = f", {s['unreadable']} stored files could not be read" if s.get("unreadable") else ""
        print(
            f"scrub   {state} in this pass ({format_size(s['bytes'])}), {s['passes']} passes done, "
            f"{s['bad']} bad files found{unreadable}"
        )
    if "remote" in st:
        r = st["remote"]
        # two counts apart that share some names (bad_bytes): each shown under its own label
        remote_misses = ", ".join(f"{k} {v}" for k, v in r.get("misses", {}).items() if v)
        not_filled = ", ".join(f"{k} {v}" for k, v in r.get("fill_misses", {}).items() if v)
        print(
            f"remote  {r.get('state')}, push {r.get('push')}: fills {r.get('fills')}, hits {r.get('hits')}, "
            f"fetched {format_size(int(r.get('bytes_fetched', 0)))}, pushed {format_size(int(r.get('bytes_pushed', 0)))}"
            f", queue {r.get('queue', {}).get('len', 0)}, bad values removed {r.get('bad_removed', 0)}"
            f"; misses: {remote_misses or 'none'}; fills not done: {not_filled or 'none'}"
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
        st = dict(ask(args, "status"))
    except errors.SpillError as exc:
        if form == "json":  # a script still gets an object to read
            print(json.dumps({"ok": False, "code": exc.code, "error": str(exc), "socket": socket_path(args)}))
        raise
    if form == "json":
        print(json.dumps(st, indent=2))
    elif form == "prometheus":
        from ..metrics import exposition

        sys.stdout.write(exposition(st).decode())
    else:
        _print_status(st)
    return EXIT_OK
