"""``inspect``, ``verify`` and ``ls``: commands that read a store's files (no daemon needed, nothing written)."""

from __future__ import annotations

import argparse
import datetime
import errno
import json
import os
import stat
import sys
from dataclasses import dataclass
from typing import Any

from .. import errors
from .. import format as fmt
from ..config import format_size
from .common import EXIT_BAD_FILE, EXIT_OK, Progress, UsageError, folder_arg, plural, refuse_not_a_store, regular_file

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
    """``o`` with every bytes value as hex, tuples as lists (a msgpack extension in a field of a codec this build
    does not know: [type, data]), and anything else JSON has no type for as its ``repr``."""
    if isinstance(o, bytes):
        return o.hex()
    if isinstance(o, dict):
        return {str(k) if not isinstance(k, str) else k: _jsonable(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_jsonable(v) for v in o]
    if o is None or isinstance(o, str | int | float | bool):
        return o
    return repr(o)


def _created(ms: int) -> str:
    """A header's creation time as UTC, or its raw number where no calendar reaches (a hostile file's)."""
    try:
        return f"{datetime.datetime.fromtimestamp(ms / 1000, tz=datetime.UTC):%Y-%m-%d %H:%M:%S} UTC"
    except (ValueError, OverflowError, OSError):
        return f"at {ms} ms since 1970 (out of the calendar's range)"


def _local_minute(t: float) -> str:
    """A file's time (seconds since 1970) in local time, or its raw number where no calendar reaches (a file
    touched to a time past the year 9999: found in review, ``ls`` failed with an internal error)."""
    try:
        return datetime.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M")
    except (ValueError, OverflowError, OSError):
        return f"@{t:.0f}"


def _print_header(h: fmt.Header, path: str) -> None:
    ident = h.identity
    print(f"file         {path}")
    packed = ", packed (64-byte alignment)" if h.align == fmt.COMPACT_ALIGN else ""
    print(
        f"format       v{h.version}, {h.file_size} bytes, data at {h.data_start}{packed}, "
        f"created {_created(h.created_at_ms)}"
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
    if h.blocks is not None:  # (found in review: a manifest's blocks went unsaid, its tokens beside short tensors)
        print(f"blocks       {len(h.blocks.keys)} of {h.blocks.size} tokens (their rows are in the block files)")
    print(f"caches       {len(h.caches)} ({h.data_bytes} bytes of tensors)")
    for i, e in enumerate(h.caches):
        for line in _entry_summary(e):
            print(f"  [{i}] {line}" if not line.startswith(" ") else f"      {line}")
    for a in h.attachments:
        print(f"attachment   {a.schema} {a.metadata} tensors={len(a.tensors)}")


def cmd_inspect(args: argparse.Namespace) -> int:
    from ..loader import read_header, verify_file

    path = regular_file(args.file)
    try:
        h = verify_file(path) if args.verify else read_header(path)
    except errors.SpillError as exc:
        return _inspect_failed(path, exc, args.json)
    if args.json:
        print(json.dumps({"ok": True, "hashes_checked": args.verify, "header": header_json(h)}, indent=2))
    else:
        _print_header(h, path)
        print("hashes       " + ("all tensor hashes match" if args.verify else "not checked (--no-verify)"))
    return EXIT_OK


def _inspect_failed(path: str, exc: errors.SpillError, as_json: bool) -> int:
    """A file that failed its check: its header still shown where it reads alone (found in review: a manifest with a
    bad block showed nothing but the block's error)."""
    from ..loader import read_header

    try:
        h: fmt.Header | None = read_header(path)
    except errors.SpillError:
        h = None
    if as_json:
        out = {"ok": False, "code": exc.code, "error": str(exc)}
        print(json.dumps(out if h is None else out | {"header": header_json(h)}))
    else:
        if h is not None:
            _print_header(h, path)
        print(f"spilld: {exc} [{exc.code}]", file=sys.stderr)
    return EXIT_BAD_FILE


def store_files(root: str) -> list[tuple[str, str]]:
    """(path, identity folder) of every entry file under a store's root, temp files and quarantine left out."""
    from ..fileio import is_regular, is_temp_name
    from ..store import EXT
    from ..store.folders import folder_names, namespace_folders

    found = []
    for folder, fp, _ in namespace_folders(root):  # only folders named as spilld names them: a user's are theirs
        found += [
            (os.path.join(folder, n), fp)
            for n in sorted(folder_names(folder))
            # a symbolic link named like an entry is someone else's, never checked, as the scan never indexes it
            # (found in review: verify --dir followed links the scan skips); one unreadable now is checked, said bad
            if n.endswith(EXT) and not is_temp_name(n) and is_regular(os.path.join(folder, n), unreadable=True)
        ]
    return found


@dataclass
class Checked:
    """One file's check: why it is bad (None: good), its header where it read, and whether the failure was a file
    not there (the file itself, or a block it names): on a live store, what an eviction during the check does."""

    why: str | None
    header: fmt.Header | None = None
    missing: bool = False


def _check_file(path: str, folder_fp: str | None) -> Checked:
    """Every hash, and for a store's file, that it sits in its identity's folder and is read as the store reads its
    own files (``fileio.OWN_OPS``: a block that is a symbolic link is refused, never checked through it; found in
    review, verify said such an entry good where the store's scan quarantined it)."""
    from ..entries import identity_fingerprint
    from ..fileio import DEFAULT_OPS, OWN_OPS
    from ..loader import verify_file

    try:
        h = verify_file(path, DEFAULT_OPS if folder_fp is None else OWN_OPS)
    except errors.SpillError as exc:  # a manifest's bad block is named (found in review: only the manifest was)
        where = f" in its block {exc.path}" if exc.path and os.path.abspath(exc.path) != os.path.abspath(path) else ""
        missing = isinstance(exc, errors.BlockMissing) or (
            isinstance(exc, errors.StorageError) and exc.errno in (errno.ENOENT, errno.ENOTDIR)
        )
        return Checked(f"{exc.reason}{where} [{exc.code}]", missing=missing)
    if folder_fp is not None and identity_fingerprint(h.identity) != folder_fp:
        return Checked("sits in the folder of another identity [header_malformed]", h)
    return Checked(None, h)


def _removed_meanwhile(c: Checked, path: str) -> bool:
    """A failed check of a file removed during it: it failed for a file not there (itself, or a block it names) and
    is gone itself now. An eviction or supersede unlinks a manifest before its blocks and a manifest's name is never
    used again, so a manifest still there still names the block found missing: not this, bad."""
    from ..fileio import known_absent

    return c.why is not None and c.missing and known_absent(path)


def _size(path: str) -> int:
    """A listed file's bytes; 0 once it is gone (a live store's eviction; found in review: an entry removed between
    an exists and a getsize ended the whole verify with a misleading refusal, exit 2)."""
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0


def _verify_store(root: str, quiet: bool) -> tuple[int, int]:
    """Check every entry of a store: (files checked, bad ones); bad ones are printed as they are found. A folder
    that is not a store is a usage error (found in review: a mistyped --dir passed, "0 entries checked, 0 bad").

    A daemon may use the store meanwhile: an entry that failed for a file not there, its manifest found gone once
    the failure is judged, was evicted or superseded during the check (found in review: reported bad, a false
    alarm). It is said gone and counted apart, never bad. The store unlinks a manifest before its blocks and never
    reuses a manifest's name, so a manifest still there still names the block found missing: that stays bad."""
    from ..store.folders import unlistable_folders

    unlistable = unlistable_folders(root)  # (a store's folder it cannot list: said below, a failed check)
    if not unlistable:
        refuse_not_a_store(root, "nothing to verify")

    files = store_files(root)
    sizes = {p: _size(p) for p, _ in files}
    progress = Progress(f"verifying {root}", quiet=quiet)
    left_bytes, bad, gone = sum(sizes.values()), 0, 0
    for folder in unlistable:  # its entries cannot be checked: a failed check, said
        bad += 1
        print(f"BAD  {folder}: a folder of the store that cannot be listed (permission denied)")
    for i, (path, fp) in enumerate(files):
        progress.show(len(files) - i, left_bytes)
        c = _check_file(path, fp)
        left_bytes -= sizes[path]
        if _removed_meanwhile(c, path):
            gone += 1
            progress.done()
            print(f"gone {path}: evicted or superseded during the check ({c.why})")
        elif c.why is not None:
            bad += 1
            progress.done()
            print(f"BAD  {path}: {c.why}")
    progress.done()
    evicted = f", {gone} evicted during the check" if gone else ""
    print(
        f"{root}: {plural(len(files), 'entry', 'entries')} ({format_size(sum(sizes.values()))}) checked, "
        f"{bad} bad{evicted}"
    )
    return len(files), bad


def cmd_verify(args: argparse.Namespace) -> int:
    from ..config import default_dir

    if not args.files and args.dir is None:
        raise UsageError("verify needs FILE... or --dir DIR (a whole store)")
    bad = 0
    if args.dir is not None:
        bad += _verify_store(folder_arg(args.dir, default_dir, must_exist=True), args.quiet)[1]
    for path in args.files:
        if os.path.isdir(path):  # a folder named as a file: checked as a store
            bad += _verify_store(os.path.abspath(path), args.quiet)[1]
            continue
        try:
            regular_file(path)
        except UsageError as exc:  # missing or not a file: a failed check (a typo must not pass), the others checked
            bad += 1
            print(f"BAD  {path}: {exc}")
            continue
        c = _check_file(path, None)
        if c.why is None and c.header is not None:
            print(f"ok   {path} ({len(c.header.slots())} tensors, {c.header.data_bytes} bytes)")
        elif _removed_meanwhile(c, path):  # there when verify looked, gone when it was read: not bad, as with --dir
            # (found in review: a file a daemon evicted between the two was reported bad, exit 1)
            print(f"gone {path}: removed during the check ({c.why})")
        else:
            bad += 1
            print(f"BAD  {path}: {c.why}")
    return EXIT_BAD_FILE if bad else EXIT_OK


# --- ls ------------------------------------------------------------------------------------------------


def quarantine_files(root: str) -> list[dict[str, Any]]:
    """The files moved aside as bad, oldest first (their names start with the time they were moved)."""
    from ..store.quarantine import is_quarantined_name, quarantine_dir

    qdir = quarantine_dir(root)  # a symbolic link or a file at its name: no quarantine (found in review)
    if qdir is None:
        return []
    rows = []
    for name in sorted(os.listdir(qdir)):
        if not is_quarantined_name(name):  # not a file spilld moved there: never listed, never removed
            continue
        path = os.path.join(qdir, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue  # removed meanwhile
        if stat.S_ISREG(st.st_mode):
            rows.append({"path": path, "bytes": st.st_size, "moved": st.st_mtime})
    return rows


def cmd_ls(args: argparse.Namespace) -> int:
    from ..config import default_dir
    from ..store import list_entries
    from ..store.folders import unlistable_folders

    root = folder_arg(args.dir, default_dir, must_exist=args.dir is not None)  # the default may not be made yet
    if args.quarantine:
        qrows = quarantine_files(root)
        if args.json:
            print(json.dumps(qrows, indent=2))
            return EXIT_OK
        for r in qrows:
            when = _local_minute(r["moved"])
            print(f"{when}  {format_size(r['bytes']):>10}  {r['path']}")
        total = format_size(sum(r["bytes"] for r in qrows))
        print(f"{plural(len(qrows), 'quarantined file')}, {total} in {root}")
        return EXIT_OK
    rows = list_entries(root)  # none under a root no daemon has made yet (the default)
    for folder in unlistable_folders(root) if os.path.isdir(root) else []:  # left out: said, on stderr
        print(f"spilld: {folder}: cannot be listed (permission denied); its entries are left out", file=sys.stderr)
    if args.json:
        print(json.dumps(rows, indent=2))
        return EXIT_OK
    for r in rows:  # an entry's size: its file and the blocks it names (a block shared by entries: in each)
        when = _local_minute(r["last_used"])
        size = format_size(r["bytes"] + r["block_bytes"])
        pin = "  pinned" if r["pinned"] else ""
        print(
            f"{when}  {r['tokens']:>7} tok  {size:>10}  {r['model_id'] or r['fingerprint']:<20} ns={r['namespace']!r}  "
            f"{r['path']}{pin}"
        )
    folders = {os.path.dirname(r["path"]): r["folder_block_bytes"] for r in rows}
    total = format_size(sum(r["bytes"] for r in rows) + sum(folders.values()))
    print(f"{plural(len(rows), 'entry', 'entries')}, {total} on disk (each block once) in {root}")
    return EXIT_OK
