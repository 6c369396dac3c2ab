"""Write the hostile-header corpus: every node of every golden file's header, replaced by fixed hostile values.

python scripts/make_hostile_corpus.py     # rewrites tests/data/hostile/<kind>.msgpack.z from tests/data/v1/

Each corpus file (zlib-compressed msgpack) holds, for one codec's golden file, a list of mutants: the mutated
header map, the prefix version it sits under, and what the validator's users answer: ``file`` (the loader,
``spilld verify`` and the scan read the header the same way) and ``spill`` (the daemon's check of a spill's
header). ``ok`` means admitted. tests/test_hostile_headers.py replays it against every user.
"""

from __future__ import annotations

import os
import sys
import tempfile
import zlib
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import msgpack

from tests.golden_cases import GOLDEN
from tests.hostile import (
    CORPUS,
    DROP,
    DUP,
    PREFIX_VALUES,
    PREFIX_VERSION,
    apply,
    file_outcome,
    get,
    golden,
    join,
    paths,
    spill_blind,
    spill_outcome,
    split,
    values_for,
)


def _label(v: Any) -> str:
    if v is DROP or v is DUP:
        return "<drop>" if v is DROP else "<dup>"
    text = repr(v) if not isinstance(v, bytes) else f"bin[{len(v)}]"
    return text if len(text) <= 40 else text[:37] + "..."


def mutants(kind: str, scratch: str) -> list[dict[str, Any]]:
    wire, body = split(golden(kind))
    edits = [(PREFIX_VERSION, v) for v in PREFIX_VALUES]
    edits += [(p, v) for p in paths(wire) for v in values_for(get(wire, p))]
    out = []
    for path, value in edits:
        header, version = apply(wire, [(path, value)])
        file = os.path.join(scratch, "m.spilld")
        with open(file, "wb") as f:
            f.write(join(header, body, version))
        name = ".".join(map(str, path)) + "=" + _label(value)
        out.append(
            {
                "name": name,
                "header": header,
                "prefix_version": version,
                "file": file_outcome(file),
                "spill": spill_outcome(header),
                "blind": spill_blind([(path, value)]),  # an edit a spill cannot carry (off, hash, prefix)
            }
        )
    return out


def main() -> None:
    os.makedirs(CORPUS, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        for kind in GOLDEN:
            ms = mutants(kind, scratch)
            blob = msgpack.packb({"kind": kind, "mutants": ms}, use_bin_type=True)
            path = os.path.join(CORPUS, f"{kind}.msgpack.z")
            with open(path, "wb") as f:
                f.write(zlib.compress(blob, 9))
            refused = sum(m["file"] != "ok" for m in ms)
            print(f"wrote {path}: {len(ms)} mutants, {refused} refused ({os.path.getsize(path)} bytes)")


if __name__ == "__main__":
    main()
