"""A strict reader of the Prometheus text exposition format (version 0.0.4), for tests: every rule a scraper may
hold a target to, checked, and the first one broken raised as ``ValueError`` with its line.

Checked: metric and label names; HELP and TYPE at most once a family and before its samples; a family's lines in
one group; each sample's name its family's (a histogram's ``_bucket``, ``_sum``, ``_count``); label values'
escapes; values Go can parse; no series twice; a histogram's buckets by rising ``le``, cumulative, ending at
``+Inf``, which equals its ``_count``; counters not negative."""

from __future__ import annotations

import itertools
import math
import re
from dataclasses import dataclass, field

METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")
TYPES = {"counter", "gauge", "histogram", "summary", "untyped"}
_FLOAT = re.compile(r"[+-]?(?:\d+\.?\d*(?:[eE][+-]?\d+)?|\.\d+(?:[eE][+-]?\d+)?|Inf|NaN)")
_HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
_SUMMARY_SUFFIXES = ("_sum", "_count")


@dataclass
class Family:
    name: str
    type: str = "untyped"
    help: str | None = None
    typed: bool = False  # a TYPE line was read
    samples: list[tuple[str, dict[str, str], float]] = field(default_factory=list)


def _value(text: str, line: str) -> float:
    if not _FLOAT.fullmatch(text):
        raise ValueError(f"not a float: {text!r} in {line!r}")
    return float(text.replace("Inf", "inf").replace("NaN", "nan"))


def _labels(text: str, line: str) -> tuple[dict[str, str], str]:
    """The label set at the start of ``text`` (just after its ``{``), and what follows its ``}``."""
    labels: dict[str, str] = {}
    i = 0
    while True:
        if text[i : i + 1] == "}":
            return labels, text[i + 1 :]
        m = LABEL_NAME.match(text, i)
        if m is None or text[m.end() : m.end() + 2] != '="':
            raise ValueError(f"bad label in {line!r}")
        name, i, value = m.group(), m.end() + 2, []
        if name.startswith("__") or name in labels:
            raise ValueError(f"reserved or repeated label {name!r} in {line!r}")
        while True:
            if i >= len(text):
                raise ValueError(f"unterminated label value in {line!r}")
            c = text[i]
            if c == "\\":
                nxt = text[i + 1 : i + 2]
                if nxt not in ('"', "\\", "n"):
                    raise ValueError(f"bad escape in a label value of {line!r}")
                value.append("\n" if nxt == "n" else nxt)
                i += 2
            elif c == '"':
                i += 1
                break
            elif c == "\n":
                raise ValueError(f"raw newline in a label value of {line!r}")
            else:
                value.append(c)
                i += 1
        labels[name] = "".join(value)
        if text[i : i + 1] == ",":
            i += 1


def _owner(sample: str, fam: Family) -> bool:
    if fam.type == "histogram":
        return any(sample == fam.name + s for s in _HISTOGRAM_SUFFIXES)
    if fam.type == "summary":
        return sample == fam.name or any(sample == fam.name + s for s in _SUMMARY_SUFFIXES)
    return sample == fam.name


def parse(text: str) -> dict[str, Family]:
    """Every family of ``text``, each checked as the module says; ``ValueError`` at the first rule broken."""
    if text and not text.endswith("\n"):
        raise ValueError("the exposition does not end with a newline")
    families: dict[str, Family] = {}
    done: set[str] = set()  # families whose group has ended: one seen again is split
    current: Family | None = None
    series: set[tuple[str, tuple[tuple[str, str], ...]]] = set()

    def family(name: str) -> Family:
        nonlocal current
        if current is not None and current.name == name:
            return current
        if name in done or name in families:
            raise ValueError(f"the lines of {name} are not one group")
        if current is not None:
            done.add(current.name)
        current = families[name] = Family(name)
        return current

    for line in text.split("\n")[:-1] if text else []:
        if not line.strip():
            continue
        if line.startswith("#"):
            parts = line.split(None, 3)
            if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                name = parts[2]
                if not METRIC_NAME.fullmatch(name):
                    raise ValueError(f"bad metric name in {line!r}")
                fam = family(name)
                if fam.samples:
                    raise ValueError(f"{parts[1]} after samples of {name}")
                if parts[1] == "HELP":
                    if fam.help is not None:
                        raise ValueError(f"a second HELP for {name}")
                    doc = parts[3] if len(parts) > 3 else ""
                    if re.search(r"\\[^\\n]", doc.replace("\\\\", "")):
                        raise ValueError(f"bad escape in the HELP of {name}")
                    fam.help = doc
                else:
                    if len(parts) != 4 or parts[3] not in TYPES:
                        raise ValueError(f"bad TYPE line {line!r}")
                    if fam.typed:
                        raise ValueError(f"a second TYPE for {name}")
                    fam.type, fam.typed = parts[3], True
            continue
        m = METRIC_NAME.match(line)
        if m is None:
            raise ValueError(f"bad sample line {line!r}")
        name, rest = m.group(), line[m.end() :]
        labels: dict[str, str] = {}
        if rest.startswith("{"):
            labels, rest = _labels(rest[1:], line)
        fields = rest.split()
        if not rest.startswith(" ") or len(fields) not in (1, 2):
            raise ValueError(f"bad sample line {line!r}")
        value = _value(fields[0], line)
        if len(fields) == 2 and not re.fullmatch(r"-?\d+", fields[1]):
            raise ValueError(f"bad timestamp in {line!r}")
        # a sample of the open family, else an untyped family of its own, which must not be one seen before
        fam = current if current is not None and _owner(name, current) else family(name)
        key = (name, tuple(sorted(labels.items())))
        if key in series:
            raise ValueError(f"a series twice: {line!r}")
        series.add(key)
        if fam.type == "counter" and not value >= 0:
            raise ValueError(f"a counter below 0 or NaN: {line!r}")
        fam.samples.append((name, labels, value))
    for fam in families.values():
        if fam.type == "histogram":
            _check_histogram(fam)
    return families


def _check_histogram(fam: Family) -> None:
    groups: dict[tuple[tuple[str, str], ...], list[tuple[float, float]]] = {}
    counts: dict[tuple[tuple[str, str], ...], float] = {}
    for name, labels, value in fam.samples:
        rest = tuple(sorted((k, v) for k, v in labels.items() if k != "le"))
        if name == fam.name + "_bucket":
            if "le" not in labels:
                raise ValueError(f"a bucket of {fam.name} without le")
            groups.setdefault(rest, []).append((_value(labels["le"], name), value))
        elif name == fam.name + "_count":
            counts[rest] = value
        elif "le" in labels:
            raise ValueError(f"le on {name}")
    if set(groups) != set(counts):
        raise ValueError(f"{fam.name}: buckets and _count do not match")
    for rest, buckets in groups.items():
        bounds = [b for b, _ in buckets]
        if bounds != sorted(bounds) or len(set(bounds)) != len(bounds):
            raise ValueError(f"{fam.name}: buckets not by rising le")
        if not bounds or bounds[-1] != math.inf:
            raise ValueError(f"{fam.name}: no +Inf bucket")
        values = [v for _, v in buckets]
        if any(b < a for a, b in itertools.pairwise(values)):
            raise ValueError(f"{fam.name}: buckets not cumulative")
        if values[-1] != counts[rest]:
            raise ValueError(f"{fam.name}: the +Inf bucket is not _count")
