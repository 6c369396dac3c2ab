"""The ``spilld`` command line.

Exit codes: 0 success; 1 a file failed a check; 2 usage error.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections.abc import Sequence
from typing import Any

from . import __version__, errors
from . import format as fmt

EXIT_OK = 0
EXIT_BAD_FILE = 1
EXIT_USAGE = 2

EPILOG = """exit codes:
  0  success
  1  a file failed a check (corrupt, truncated, foreign)
  2  usage error
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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="spilld",
        description="A write-behind cold tier for the KV caches of local mlx LLM engines.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--version", action="version", version=f"spilld {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")

    ins = sub.add_parser(
        "inspect",
        help="show a cache file's header and tensors, and check its hashes",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ins.add_argument("file")
    ins.add_argument("--json", action="store_true", help="machine-readable output")
    ins.add_argument(
        "--no-verify", dest="verify", action="store_false", help="read the header only; skip the tensor hashes"
    )
    ins.set_defaults(func=cmd_inspect)

    ver = sub.add_parser(
        "verify",
        help="check files end to end (header, layout, every tensor hash)",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ver.add_argument("files", nargs="+")
    ver.set_defaults(func=cmd_verify)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
