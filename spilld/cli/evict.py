"""``evict``: through the daemon that serves the folder, else straight from the folder under its lock."""

from __future__ import annotations

import argparse
import json
import os
import time
from typing import Any

from .. import errors
from ..config import format_size
from .common import (
    EXIT_OK,
    Progress,
    UsageError,
    ask,
    daemon_dir,
    folder_arg,
    plural,
    refuse_another_folder,
    refuse_not_a_store,
    same_folder,
    socket_path,
)
from .files import quarantine_files

EVICT_SILENCE_S = 120.0  # an evict through the daemon gives up when it says nothing this long (it reports progress)


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
    from ..fileio import DEFAULT_OPS
    from ..lockfile import LOCK_NAME, FileLock
    from ..store import list_entries, remove_empty_folders
    from ..store.scan import scan_root

    lock = FileLock(os.path.join(root, LOCK_NAME), f"the folder {root}")
    try:
        lock.acquire()
    except errors.AlreadyRunning:
        raise
    except errors.SpillError as exc:  # no daemon involved: a folder this user cannot lock is a usage error (exit 2)
        raise UsageError(f"{root}: cannot evict from it: {exc}") from None
    try:
        cutoff = time.time() - older if older is not None else None
        rows = [
            r
            for r in list_entries(root)
            if (args.fingerprint is None or r["fingerprint"] == args.fingerprint)
            and (cutoff is None or r["last_used"] < cutoff)
        ]
        n, nbytes = _remove_files(rows, f"evicting from {root}", args.json)
        # the blocks no entry names any more go too, as a daemon's scan would take them (the lock is ours)
        orphans = [{"path": b.path, "bytes": b.nbytes} for b in scan_root(root, DEFAULT_OPS, reap=True).orphans]
        nbytes += _remove_files(orphans, f"removing the blocks they named from {root}", args.json)[1]
        remove_empty_folders(root)
    finally:
        lock.release()
    return n, nbytes


def cmd_evict(args: argparse.Namespace) -> int:
    """Evict through the daemon that serves the folder, else from the folder itself; say which."""
    from ..config import default_dir

    if not (args.all or args.fingerprint or args.older_than is not None or args.quarantine):
        raise UsageError("evict needs --fingerprint, --older-than, --quarantine or --all (every entry)")
    served = daemon_dir(args)
    root = folder_arg(args.dir or served, default_dir, must_exist=True)
    if served is not None and args.socket is None and not same_folder(root, served):
        # the default socket's daemon serves another folder: this one is evicted from itself, under its lock (found
        # in review: it was refused, with no socket of its own to name); a --socket named is never ignored
        served = None
    refuse_another_folder(args, root, served)
    if served is None:
        refuse_not_a_store(root, "nothing evicted, nothing made")
    out: dict[str, Any] = {"dir": root, "through_daemon": served is not None, "evicted": 0, "bytes": 0}
    if args.all or args.fingerprint or args.older_than is not None:
        params = {"fingerprint": args.fingerprint, "older_than_s": args.older_than}
        if served is not None:
            progress = Progress(f"evicting from {root}", quiet=args.json)

            def show(note: Any) -> None:
                if note.method == "evict_progress":
                    progress.show(int(note.params["pending_items"]), int(note.params["pending_bytes"]), force=True)

            try:
                # as long as it takes, while the daemon reports progress (found in review: a hung one held it for ever)
                r = ask(args, "evict", params, timeout=None, on_note=show, silence=EVICT_SILENCE_S)
            finally:
                progress.done()
            out["evicted"], out["bytes"] = int(r["evicted"]), int(r["bytes"])
        else:
            out["evicted"], out["bytes"] = _evict_direct(root, args, args.older_than)
    if args.quarantine:
        out["quarantine_removed"], out["quarantine_bytes"] = _remove_files(
            quarantine_files(root), "removing quarantined files", args.json
        )
    _print_evicted(out, socket_path(args), args.json)
    return EXIT_OK


def _print_evicted(out: dict[str, Any], sock: str, as_json: bool) -> None:
    if as_json:
        print(json.dumps(out))
        return
    how = f"through the daemon on {sock}" if out["through_daemon"] else "from the folder (no daemon serves it)"
    print(f"evicted {plural(out['evicted'], 'entry', 'entries')} ({format_size(out['bytes'])}) from {out['dir']} {how}")
    if "quarantine_removed" in out:
        n, nbytes = out["quarantine_removed"], out["quarantine_bytes"]
        print(f"removed {plural(n, 'quarantined file')} ({format_size(nbytes)})")
