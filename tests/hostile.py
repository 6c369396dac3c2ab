"""Hostile headers made from valid ones, and what each user of the validator makes of them.

Shared by scripts/make_hostile_corpus.py (the checked-in corpus under tests/data/hostile/) and the
property test (tests/test_hostile_headers.py). A mutant is a header map as msgpack decodes it, with one
or more leaves replaced, over the data region of the valid file it came from.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Iterator
from typing import Any

import msgpack

from spilld import errors
from spilld import format as fmt
from spilld.daemon.ingest import accept_header
from spilld.loader import read_header

DATA = os.path.join(os.path.dirname(__file__), "data")
CORPUS = os.path.join(DATA, "hostile")
PREFIX_VERSION = ("<prefix>", "version")  # a pseudo path: the version in the file's prefix
OK = "ok"
Path = tuple[Any, ...]


def golden(kind: str) -> bytes:
    with open(os.path.join(DATA, f"v{fmt.FORMAT_VERSION}", f"{kind}.spilld"), "rb") as f:
        return f.read()


def wire_align(wire: Any) -> int:
    """The alignment a header map asks for, where it is one a reader takes (a mutant's may not be)."""
    a = wire.get("align", fmt.ALIGN) if isinstance(wire, dict) else fmt.ALIGN
    return a if a in fmt.ALIGNS and not isinstance(a, bool) else fmt.ALIGN


def split(data: bytes) -> tuple[dict[str, Any], bytes]:
    """A file's header map and its data region."""
    prefix = fmt.decode_prefix(data[: fmt.PREFIX_LEN], len(data))
    wire = msgpack.unpackb(data[fmt.PREFIX_LEN : fmt.PREFIX_LEN + prefix.header_len], raw=False)
    return wire, data[prefix.data_start :]


def join(wire: Any, body: bytes, version: int = fmt.FORMAT_VERSION) -> bytes:
    """A file with this header, its hash right, under a prefix of ``version``."""
    hb = msgpack.packb(wire, use_bin_type=True)
    head = bytearray(fmt.encode_prefix(hb, align=wire_align(wire))[0])
    fmt.PREFIX.pack_into(head, 0, fmt.MAGIC, version, len(hb), len(head), int.from_bytes(fmt.xxh3(hb), "big"))
    return bytes(head) + body


def paths(obj: Any, at: Path = ()) -> Iterator[Path]:
    """Every node of a header map (containers and leaves), the root excluded."""
    if at:
        yield at
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from paths(v, (*at, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from paths(v, (*at, i))


def get(obj: Any, path: Path) -> Any:
    for p in path:
        obj = obj[p]
    return obj


def put(obj: Any, path: Path, value: Any) -> None:
    get(obj, path[:-1])[path[-1]] = value


DROP = object()  # a value that removes the node (a map key or a list element)
DUP = object()  # a value that repeats a list element


def apply(wire: dict[str, Any], edits: list[tuple[Path, Any]]) -> tuple[dict[str, Any], int]:
    """A mutant of ``wire`` and its prefix version. Edits whose path no longer exists are skipped."""
    out = copy.deepcopy(wire)
    version = fmt.FORMAT_VERSION
    for path, value in edits:
        if path == PREFIX_VERSION:
            version = value
            continue
        try:
            parent = get(out, path[:-1])
            _ = parent[path[-1]]
        except (KeyError, IndexError, TypeError):
            continue
        if not isinstance(parent, (dict, list)):  # an earlier edit replaced a container by a scalar
            continue
        node = parent[path[-1]]
        if value is DROP:
            del parent[path[-1]]
        elif value is DUP:  # one more of the list's last element (a tensor, an entry, a dimension)
            if isinstance(node, list) and node:
                node.append(copy.deepcopy(node[-1]))
        else:
            parent[path[-1]] = copy.deepcopy(value)
    return out, version


KINDS = ["kv", "concat", "chunked", "rotating", "quantized", "arrays", "list", "batch_kv", "batch_rotating", "nonsense"]


PREFIX_VALUES = [0, 2, 99]


def values_for(v: Any) -> list[Any]:
    """A fixed list of hostile replacements for a node holding ``v`` (the corpus uses these)."""
    common: list[Any] = [None, DROP]
    if isinstance(v, bool):
        return [not v, int(v), *common]
    if isinstance(v, int):
        return [*sorted({0, 1, max(v - 1, 0), v + 1, 2 * v, v + 256, 4_194_304, 2**31, 2**63}), -1, "9", *common]
    if isinstance(v, str):
        return ["", "nonsense", "float64", "uint32", *(k for k in KINDS if k != v), 5, *common]
    if isinstance(v, bytes):
        return [b"", v[:-1], v + b"\0", v + b"\xff" * 4, v * 2, "x", *common]
    if isinstance(v, list):
        extra = [[], [*v[:-1]], DUP] if v else [[0], [True]]
        return [*extra, {}, *common]
    if isinstance(v, dict):
        return [{}, [], {**v, "extra": 1}, {**v, b"raw": 1}, *common]
    return [0, "", [], {}, DROP]  # None


def outcome(fn: Any, *args: Any, **kw: Any) -> str:
    """``ok`` or the code of the typed error ``fn`` raised (anything else is a bug: it propagates)."""
    try:
        fn(*args, **kw)
    except errors.SpillError as exc:
        return exc.code
    return OK


def spill_check(wire: Any) -> None:
    """What the daemon runs on a spill's header before it accepts it (on a copy: it fills left-out fields)."""
    accept_header(copy.deepcopy(wire))


def spill_outcome(wire: Any) -> str:
    return outcome(spill_check, wire)


def file_outcome(path: str) -> str:
    """The header checks shared by the loader, ``spilld verify`` and the scan."""
    return outcome(read_header, path)


def spill_blind(edits: list[tuple[Path, Any]]) -> bool:
    """True when an edit is to something a spill never carries or the daemon fills in itself (a tensor's ``off``
    or ``hash``, the header's ``created_at_ms`` and ``align``, the prefix, a v2 header's ``blocks`` and ``block``
    left out, a ``format`` the daemon reads): a file can then be refused for it, a spill not."""
    filled = ("off", "hash", "created_at_ms", "align")
    return any(
        p == PREFIX_VERSION
        or (p and p[-1] in filled)
        or (p in (("blocks",), ("block",)) and v is DROP)
        or (p == ("format",) and v in fmt.SUPPORTED_VERSIONS)  # the daemon writes any version it reads as its own
        for p, v in edits
    )
