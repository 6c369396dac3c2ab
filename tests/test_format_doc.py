"""docs/format.md's byte-level statements, read back with struct, msgpack, xxhash and hashlib alone (never spilld's
own decoder): the prefix and its hash's byte order (§2), the header's keys, their order and the 10-byte hash (§3),
the layout and its alignment (§1, §4), the worked example of the root key and key 0 (§5.2), a block file's name,
folder and header and a manifest's (§5.2, §7 "Folder names"), and the error tables (§8). Found in review: none of
these statements had a test of its own (the golden files are read back by the code that wrote them)."""

from __future__ import annotations

import glob
import hashlib
import inspect
import math
import os
import re
import struct
from pathlib import Path
from typing import Any

import msgpack
import pytest
import xxhash

import spilld
from spilld import errors
from spilld.store import Store
from tests.blocks_corpus import B, conversation, toks

DOCS = Path(__file__).resolve().parent.parent / "docs" / "format.md"
DATA = Path(__file__).resolve().parent / "data"
MAGIC = bytes.fromhex("89 53 50 49 4C 4C 44 0A")
ITEM = {"bool": 1, "uint8": 1, "uint16": 2, "uint32": 4, "uint64": 8, "int8": 1, "int16": 2, "int32": 4, "int64": 8}
ITEM |= {"float16": 2, "float32": 4, "float64": 8, "bfloat16": 2, "complex64": 8}
KEYS_V1 = ["format", "created_at_ms", "codec_provider", "identity", "tokens", "caches", "attachments", "checkpoint"]
KEYS_V1 += ["meta"]
ENTRY_KEYS = ["kind", "v", "offset", "min_reusable", "trimmable", "fields", "tensors", "children"]
SLOT_KEYS = ["off", "bytes", "shape", "dtype", "hash"]


def align_up(n: int, a: int) -> int:
    return -(-n // a) * a


def slots_of(entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for e in entries:
        assert list(e) == ENTRY_KEYS
        out += e["tensors"]
        out += slots_of(e["children"])
    return out


def read_doc_file(path: str) -> tuple[int, dict[str, Any], int]:
    """(version, header, data start) of a file, checked byte by byte as format.md §1-§4 say."""
    with open(path, "rb") as f:
        b = f.read()
    magic, version, hlen, data_start, hash_int = struct.unpack("<8sIIQQ", b[:32])
    assert magic == MAGIC and version in (1, 2, 3)
    raw = b[32 : 32 + hlen]
    digest = xxhash.xxh3_64_digest(raw)
    assert b[24:32] == digest[::-1] and hash_int == xxhash.xxh3_64_intdigest(raw)  # §2: the digest reversed
    h = msgpack.unpackb(raw, raw=False)
    keys = KEYS_V1 + (["blocks", "block"] if version >= 2 else []) + (["align"] if version >= 3 else [])
    assert list(h) == keys and h["format"] == version  # §3: the order the writer emits
    align = h["align"] if version >= 3 else 16384
    assert data_start == align_up(32 + hlen, align) and b[32 + hlen : data_start] == bytes(data_start - 32 - hlen)
    slots = slots_of(h["caches"]) + [s for a in h["attachments"] for s in a["tensors"]]
    cursor = end = 0
    for s in slots:
        assert list(s) == SLOT_KEYS and s["bytes"] == ITEM[s["dtype"]] * math.prod(s["shape"])
        assert s["off"] == align_up(cursor, align)  # §4 rule 3
        cursor = s["off"] + s["bytes"]
        end = cursor if s["bytes"] else end
        at = data_start + s["off"]
        assert xxhash.xxh3_64_digest(b[at : at + s["bytes"]]) == s["hash"]  # big-endian digest bytes
    assert raw.count(b"\xc4\x08") >= len(slots)  # each hash a bin 8
    assert len(b) == data_start + end  # §4 rule 4: no trailer, a trailing empty tensor adds nothing
    if version >= 3:  # §1: packed below COMPACT_BELOW tensor bytes, else pages
        assert align == (64 if sum(s["bytes"] for s in slots) < 1024 * 1024 else 16384)
    return version, h, data_start


@pytest.mark.parametrize("path", sorted(glob.glob(str(DATA / "v[0-9]" / "*.spilld"))), ids=os.path.basename)
def test_golden_files_are_laid_out_byte_for_byte_as_format_md_says(path: str) -> None:
    read_doc_file(path)


def test_the_worked_example_of_the_root_key_and_key_0() -> None:
    """§5.2's example, computed from the text's own rule (msgpack of the root array, SHA-256), and by blocks.py."""
    from spilld import blocks

    doc = DOCS.read_text()
    layout = [["kv", 1, [], [["float16", [1, 8, 128]], ["float16", [1, 8, 128]]]]]
    packed = msgpack.packb(["spilld-blocks/1", "", "", "", "", "spilld/mlx-lm/1", 256, layout], use_bin_type=True)
    shown = re.search(r"the msgpack of\s+the root array is `([0-9a-f \n]+)`", doc)
    assert shown is not None and bytes.fromhex(shown.group(1).replace("\n", " ")) == packed
    root = hashlib.sha256(packed).digest()
    key0 = hashlib.sha256(root + struct.pack("<256I", *range(256))).digest()
    assert f"the root key is\n`{root.hex()}`" in doc and f"key₀ is `{key0.hex()}`" in doc
    assert blocks.root_key(spilld.Identity(), "spilld/mlx-lm/1", 256, layout) == root
    assert blocks.next_key(root, list(range(256))) == key0


@pytest.mark.asyncio
async def test_a_manifest_and_its_blocks_are_named_placed_and_filled_as_format_md_says(tmp_path: Path) -> None:
    ident = spilld.Identity("model-d", "cfg-d", "tok-d", "tenant")
    tokens = toks(2 * B + 5)
    s = Store(tmp_path, block_tokens=B, durability="none")
    result = await s.put(tokens, conversation(tokens), ident)
    folder = (
        tmp_path
        / xxhash.xxh3_64_hexdigest(msgpack.packb(["model-d", "cfg-d", "tok-d"]))
        / (xxhash.xxh3_64_hexdigest(b"tenant"))
    )  # §7 "Folder names"
    assert os.path.dirname(result.path) == str(folder) and result.path.endswith(".spilld")
    _, m, _ = read_doc_file(result.path)
    assert m["block"] is None and m["blocks"]["size"] == B and len(m["blocks"]["keys"]) == 2
    names = sorted(n for n in os.listdir(folder) if n.endswith(".spilld-block"))
    assert len(names) == 2 and all(re.fullmatch(r"[0-9a-f]{64}-[0-9a-f]{8}\.spilld-block", n) for n in names)
    by_key = {bytes.fromhex(n[:64]): n for n in names}
    parent = None
    for i, key in enumerate(m["blocks"]["keys"]):
        _, h, _ = read_doc_file(str(folder / by_key[key]))
        assert h["format"] == 3 and h["blocks"] is None and h["block"]["key"] == key and h["block"]["index"] == i
        assert h["identity"] == m["identity"] and h["codec_provider"] == m["codec_provider"]
        assert h["tokens"] == struct.pack(f"<{B}I", *tokens[i * B : (i + 1) * B])
        assert (h["attachments"], h["checkpoint"], h["meta"]) == ([], None, {})
        assert all(
            (e["offset"], e["min_reusable"], e["trimmable"], e["children"]) == (B, 0, True, []) for e in h["caches"]
        )
        if parent is not None:
            assert h["block"]["parent"] == parent
        assert hashlib.sha256(h["block"]["parent"] + h["tokens"]).digest() == key  # keyᵢ = SHA-256(parent ‖ tokens)
        parent = key
    for e in m["caches"]:  # a positional leaf keeps its offset; its tensors hold the rows after the blocks
        for slot in slots_of([e]):
            assert slot["shape"][-2] == e["offset"] - 2 * B


def test_the_error_tables_are_the_classes_and_codes_of_errors_py() -> None:
    """§8's tables and §10's list of the protocol's codes name every error class with the code it has."""
    doc = DOCS.read_text()
    sec8 = doc[doc.index("## 8. Error codes") : doc.index("## 9. Versioning")]
    pairs = dict(re.findall(r"`([A-Z][A-Za-z]+)`[²³⁴⁵⁶]* \| `([a-z_]+)`", sec8))
    classes = {n: c for n, c in vars(errors).items() if inspect.isclass(c) and issubclass(c, errors.SpillError)}
    assert {n: classes[n].code for n in pairs if n in classes} == pairs and set(pairs) <= set(classes)
    sec10 = doc[doc.index("Codes of the protocol") : doc.index("### Limits")]
    protocol_codes = set(re.findall(r"`([a-z_]+)`", sec10))
    assert {c.code for c in classes.values()} <= set(pairs.values()) | protocol_codes
    header_rules = sec8[sec8.index("**Header rules**") :]
    for name in re.findall(r"^\| `([A-Z][A-Za-z]+)` \|", header_rules, re.M):
        assert issubclass(classes[name], errors.LayoutError if name == "SlotSizeMismatch" else errors.HeaderMalformed)
    # footnote 2, the first table read down its left column, then its right: FileFormatError is the parent of every
    # class from BadMagic through BlockMissing; the ones after derive from SpillError (or a class of the table)
    table = sec8[: sec8.index("**Header rules**")]
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in table.splitlines() if "`" in line]
    cells = [c for c in cells if len(c) == 5]
    order = [re.sub(r"[`²³⁴⁵⁶]", "", c[col]) for col in (0, 3) for c in cells]
    order = [n for n in order if n and n != "Class"]
    assert set(order) <= set(pairs)
    first, last = order.index("BadMagic"), order.index("BlockMissing")
    assert all(issubclass(classes[n], errors.FileFormatError) for n in order[first : last + 1])
    assert not any(issubclass(classes[n], errors.FileFormatError) for n in order[last + 1 :])
