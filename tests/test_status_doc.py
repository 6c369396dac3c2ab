"""docs/format.md §10, "Status: the shared tier's counters", against the code: every field of ``status.remote`` (a
real ``RemoteLink`` on a real ``Store``, its tier constructed and not started: no server is needed to read its
counters), its type, the reasons of each map by reason, and the Prometheus metric the doc names for it."""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections import Counter
from pathlib import Path
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from spilld.metrics import exposition
from spilld.remote import Reason, RemoteConfig, RemoteTier
from spilld.remote import link as link_module
from spilld.remote import tier as tier_module
from spilld.remote.breaker import State
from spilld.remote.link import PUSH_MODES, RemoteLink
from spilld.remote.stats import Stats
from spilld.store import Store

DOC = Path(__file__).resolve().parent.parent / "docs" / "format.md"
TITLE = "Status: the shared tier's counters"
TYPES: dict[str, tuple[type, ...]] = {
    "int": (int,),
    "str": (str,),
    "bool": (bool,),
    "str or nil": (str, type(None)),
    "map": (dict,),
}


@dataclasses.dataclass(frozen=True)
class Row:
    type: str
    meaning: str
    metric: str


def doc_rows(text: str) -> dict[str, Row]:
    """The table of the section: field -> its type, meaning and metric cells."""
    start = text.index(f"\n### {TITLE}\n")
    end = text.index("\n### ", start + 1)
    rows: dict[str, Row] = {}
    for line in text[start:end].splitlines():
        if not line.startswith("| `"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        assert len(cells) == 4, line
        name = cells[0].strip("`")
        assert name not in rows, f"{name} listed twice"
        rows[name] = Row(*cells[1:])
    return rows


def ticked(text: str) -> set[str]:
    return set(re.findall(r"`([^`]+)`", text))


def reasons_in(meaning: str) -> set[str]:
    """The reasons a map's row names: the backticked words after ``reasons:``."""
    assert "reasons:" in meaning, meaning
    return set(re.findall(r"`([a-z_]+)`", meaning.split("reasons:", 1)[1]))


def reasons_in_source(*functions: Any) -> set[str]:
    return {Reason[n].value for f in functions for n in re.findall(r"Reason\.([A-Z_]+)", inspect.getsource(f))}


def linked(tmp_path: Path) -> tuple[Store, RemoteLink]:
    """A link whose every counter holds a value of its own (so the metric of each field can be told apart)."""
    store = Store(str(tmp_path), disk_cap=2**30, block_tokens=16)
    tier = RemoteTier(RemoteConfig("redis://127.0.0.1:1/0"), environ={})
    for i, f in enumerate(dataclasses.fields(Stats)):
        value = getattr(tier.stats, f.name)
        if isinstance(value, Counter):
            for j, r in enumerate(Reason):
                value[r] = 1000 + 10 * i + j
        else:
            setattr(tier.stats, f.name, 100 + i)
    tier.queue.dropped, tier.queue.refused = 201, 202
    tier.breaker.entered[State.OPEN] = 203
    link = RemoteLink(tier, store)
    link.fills, link.fills_shared, link.evicted_skipped, link.pushes_too_large = 301, 302, 303, 304
    for j, why in enumerate(sorted(fill_reasons())):
        link.fill_misses[why] = 400 + j
    return store, link


def fill_reasons() -> set[str]:
    return (
        set(re.findall(r'_(?:missed|refuse)\((?:[^()"]*, )?"([a-z_]+)"[,)]', inspect.getsource(link_module)))
        | set(link_module.UNFETCHED.values())
        | set(link_module.UNREAD.values())
    )


def flat(counters: dict[str, Any], rows: dict[str, Row]) -> dict[str, Any]:
    """Fields as the doc names them: a map by reason (type ``map`` there) stays whole, another map is spelt
    ``outer.inner``."""
    out: dict[str, Any] = {}
    for k, v in counters.items():
        if isinstance(v, dict) and (k not in rows or rows[k].type != "map"):
            out.update({f"{k}.{sub}": x for sub, x in v.items()})
        else:
            out[k] = v
    return out


def samples(text: bytes) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text.decode())
        for s in fam.samples
    }


def test_status_remote_fields_are_the_ones_format_md_lists(tmp_path: Path) -> None:
    text = DOC.read_text()
    rows = doc_rows(text)
    store, link = linked(tmp_path)
    try:
        counters = link.counters()
        status = {"queue": {"pending_items": 0, "pending_bytes": 0}, "store": store.stats(), "remote": counters}
        got = samples(exposition(status))
    finally:
        store.close()
    fields = flat(counters, rows)

    # the status row points at the section; every field is listed, and nothing else
    (status_row,) = [line for line in text.splitlines() if line.startswith("| `status` |")]
    assert f'see "{TITLE}"' in status_row
    assert set(rows) - set(fields) == set(), "listed in docs/format.md, not in status.remote"
    assert set(fields) - set(rows) == set(), "in status.remote, not listed in docs/format.md"

    for name, row in rows.items():
        assert row.type in TYPES, f"{name}: unknown type {row.type!r}"
        value = fields[name]
        assert isinstance(value, TYPES[row.type]), f"{name} is {value!r}, not {row.type}"
        assert row.type != "int" or not isinstance(value, bool), name

    # the values that the str fields and the maps by reason can take
    assert ticked(rows["state"].meaning) >= {s.value for s in State} | set(
        re.findall(r'return "([a-z_]+)"', inspect.getsource(vars(RemoteTier)["state"].fget))
    )
    assert ticked(rows["push"].meaning) >= set(PUSH_MODES)
    assert reasons_in(rows["misses"].meaning) == set(counters["misses"])  # every reason, zeros included
    push_reasons = reasons_in_source(
        RemoteTier._call, RemoteTier._disable, RemoteTier._push_worker, tier_module._reason_of
    )
    assert reasons_in(rows["push_failed"].meaning) == push_reasons
    assert reasons_in(rows["fill_misses"].meaning) == fill_reasons()
    assert {"misses", "push_failed", "fill_misses"} == {n for n, r in rows.items() if r.type == "map"}

    # each metric named is the field's, value for value; every remote metric is named
    named = set()
    for name, row in rows.items():
        if not row.metric:
            continue
        metric, label = re.fullmatch(r"`(\w+)(?:\{(\w+)\})?`.*", row.metric).groups()  # type: ignore[union-attr]
        named.add(metric)
        value = fields[name]
        if isinstance(value, dict):
            for k, v in value.items():
                assert got[(metric, frozenset({(label, k)}))] == v, (name, k)
        elif isinstance(value, str):
            assert got[(metric, frozenset({(label, value)}))] == 1, name
        else:
            assert label is None and got[(metric, frozenset())] == value, name
    exported = {n for n, _ in got if n.startswith("spilld_remote_")}
    assert exported == named, "metrics of the remote tier not named in docs/format.md, or named and not exported"
