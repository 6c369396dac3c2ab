"""Prometheus exposition of the daemon's ``status``, through ``prometheus_client``.

One source of truth: the ``status`` answer (a dict). The daemon renders it into a textfile for node_exporter's
textfile collector (``--metrics-file``, rewritten atomically every ``METRICS_EVERY_S``); ``spilld status --format
prometheus`` renders the same dict fetched over the socket. The restore latency is measured by the client (from
its lookup to the caches in hand) and reported with its ``touch``; the daemon keeps the histogram.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

METRICS_EVERY_S = 5.0  # the textfile is rewritten this often (node_exporter reads it on each scrape)
# seconds from lookup to loaded caches: a small cache restores in a millisecond, a 4 GiB one in seconds
RESTORE_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
PREFIX = "spilld"


class LatencyHistogram:
    """Counts per bucket (upper bounds ``buckets``, then +Inf), their sum and count; carried in ``status``."""

    def __init__(self, buckets: Sequence[float]) -> None:
        self.buckets = tuple(buckets)
        self.counts = [0] * (len(self.buckets) + 1)
        self.sum = 0.0

    def observe(self, seconds: float) -> None:
        i = next((i for i, b in enumerate(self.buckets) if seconds <= b), len(self.buckets))
        self.counts[i] += 1
        self.sum += seconds

    def to_wire(self) -> dict[str, Any]:
        return {"buckets": list(self.buckets), "counts": list(self.counts), "sum": self.sum, "count": sum(self.counts)}


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(f"{PREFIX}_{name}", doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(f"{PREFIX}_{name}", doc, value=value)


def _labelled(name: str, doc: str, label: str, values: dict[str, Any]) -> CounterMetricFamily:
    m = CounterMetricFamily(f"{PREFIX}_{name}", doc, labels=[label])
    for k, v in sorted(values.items()):
        m.add_metric([str(k)], float(v))
    return m


def _histogram(name: str, doc: str, h: dict[str, Any]) -> HistogramMetricFamily:
    bounds = [*h.get("buckets", []), math.inf]
    counts = list(h.get("counts", [0] * len(bounds)))
    cumulative, running = [], 0
    for b, c in zip(bounds, counts, strict=False):
        running += int(c)
        cumulative.append(("+Inf" if b == math.inf else repr(float(b)), running))
    return HistogramMetricFamily(f"{PREFIX}_{name}", doc, buckets=cumulative, sum_value=float(h.get("sum", 0.0)))


def families(st: dict[str, Any]) -> list[Metric]:
    """Every metric of a daemon's ``status`` answer: the daemon's own, then its queue's and store's (``store_families``),
    then its other parts'."""
    info = GaugeMetricFamily(f"{PREFIX}_info", "spilld's version (always 1)", labels=["version"])
    info.add_metric([str(st.get("version", ""))], 1)
    out: list[Metric] = [
        info,
        _gauge("uptime_seconds", "seconds since the daemon started", st.get("uptime_s", 0)),
        _gauge("clients", "connected clients", st.get("clients", 0)),
        _counter("client_errors", "connections ended for a client's fault", st.get("client_errors", 0)),
        _gauge("queue_cap_bytes", "the soft cap on queued bytes (--cap)", st.get("cap", 0)),
        _counter("lookups", "lookup requests answered", st.get("lookups", 0)),
        *store_families(st),
    ]
    if "remote" in st:
        out += _remote(st["remote"])
    if "ingest" in st:
        out += _ingest(st["ingest"])
    if "scrub" in st or "warm" in st:
        out += _background(st.get("scrub"), st.get("warm"))
    if "restore_seconds" in st:
        out.append(
            _histogram("restore_seconds", "seconds from a client's lookup to its loaded caches", st["restore_seconds"])
        )
    return out


def store_families(st: dict[str, Any]) -> list[Metric]:
    """The metrics of a status's ``queue`` and ``store``: a daemon's, and the mlx-lm integration's embedded tier's
    (``Spiller.stats``, which has nothing else), under the same names so that one dashboard reads both."""
    q, d = st["queue"], st["store"]
    out: list[Metric] = [
        _gauge("queue_items", "items queued in memory, not yet written", q["pending_items"]),
        _gauge("queue_bytes", "bytes queued in memory, not yet written", q["pending_bytes"]),
        _gauge("queue_peak_bytes", "the most bytes ever queued at once", q.get("peak_bytes", 0)),
        _labelled(
            "queue_outcomes",
            "queued items by how they ended",
            "outcome",
            {k: q.get(k, 0) for k in ("stored", "dropped", "cancelled", "failed")},
        ),
        _counter("queue_barriers", "barriers settled (counted apart: they store nothing)", q.get("barriers", 0)),
        _counter(
            "written_bytes",
            "bytes of the entry files (manifests, or whole entries) the queue's items wrote durably; blocks: "
            "store_written_bytes",
            q.get("bytes_written", 0),
        ),
        _gauge("disk_entries", "entries in the store", d["entries"]),
        _gauge("disk_bytes", "bytes of the store's entries", d["bytes"]),
        _gauge("disk_cap_bytes", "the cap on the store (--disk-cap)", d["disk_cap"]),
        _counter("hits", "restores completed and kept (a daemon's client reports each with its touch)", d["hits"]),
        _labelled("misses", "lookups that found nothing usable, by reason", "reason", d["misses"]),
        _labelled("store_errors", "failed writes by error code", "code", d.get("errors", {})),
        _labelled(
            "store_events",
            "entries that left the store, and temp files reaped",
            "event",
            {k: d.get(k, 0) for k in ("superseded", "evicted", "quarantined", "reaped_temp")},
        ),
    ]
    if "quarantine_removed" in d:
        out.append(_counter("quarantine_removed", "quarantined files removed to keep its cap", d["quarantine_removed"]))
    if "blocks" in d:
        out += _blocks_and_wear(d)
    return out


def _blocks_and_wear(d: dict[str, Any]) -> list[Metric]:
    # no budget, no gauge (found in review: a 0 made an alert on written_day_bytes > write_budget_bytes fire)
    budget = d.get("write_budget")
    limit = [] if budget is None else [_gauge("write_budget_bytes", "the write budget a day (--write-budget)", budget)]
    return [
        *limit,
        _gauge("blocks", "prefix blocks on disk", d["blocks"]),
        _gauge("block_bytes", "bytes of the prefix blocks on disk (each once)", d.get("block_bytes", 0)),
        _labelled(
            "block_events",
            "prefix blocks written, named without writing, reclaimed, fetched from the remote tier",
            "event",
            {k: d.get(f"blocks_{k}", 0) for k in ("written", "reused", "reclaimed", "fetched")},
        ),
        _counter("store_written_bytes", "bytes of every file the store published, blocks included", d["bytes_written"]),
        _counter("unique_added_bytes", "cache bytes of tokens the store did not hold before", d.get("unique_added", 0)),
        _gauge("written_day_bytes", "bytes written in the last 24 hours", d.get("written_day", 0)),
        _gauge("written_week_bytes", "bytes written in the last 7 days", d.get("written_week", 0)),
        _labelled(
            "shed",
            "droppable spills the store declined, by why",
            "reason",
            {"write_budget": d.get("dropped_budget", 0), "admit_after": d.get("dropped_admit", 0)},
        ),
    ]


def _ingest(i: dict[str, Any]) -> list[Metric]:
    """Spills being received over the socket, as ``status`` shows them (found in review: not in the metrics)."""
    return [
        _gauge("ingest_open_spills", "spills being received", i.get("open_spills", 0)),
        _gauge("ingest_receiving_bytes", "bytes held for spills being received", i.get("receiving", 0)),
        _gauge("ingest_buffer_bytes", "bytes held for big messages being received", i.get("buffers", 0)),
        _counter(  # a running total since the start (found in review: a gauge, whose rate() a restart breaks)
            "ingest_held_bytes",
            "tensor bytes clients left out of their spills since the start, because the daemon held their blocks",
            i.get("held_bytes", 0),
        ),
        _counter("ingest_expired", "open spills aborted for silence or a pace too slow", i.get("expired", 0)),
    ]


def _background(scrub: dict[str, Any] | None, warm: dict[str, Any] | None) -> list[Metric]:
    """The scrub's and the warm start's progress and findings, as ``status`` shows them."""
    out: list[Metric] = []
    if scrub is not None:
        out += [
            _counter("scrub_passes", "scrub passes finished", scrub.get("passes", 0)),
            _gauge("scrub_pass_files", "files checked in the current pass", scrub.get("files", 0)),
            _counter("scrub_bad_files", "files the scrub found bad and quarantined", scrub.get("bad", 0)),
            _counter("scrub_unreadable_files", "stored files the scrub could not read", scrub.get("unreadable", 0)),
            _counter("scrub_gone_files", "stored files the scrub found gone from the disk", scrub.get("gone", 0)),
        ]
    if warm is not None:
        out += [
            _gauge("warm_read_bytes", "bytes the warm start read ahead since the start", warm.get("read_bytes", 0)),
            _gauge("warm_done", "1 once the warm start is done", 1 if warm.get("done") else 0),
        ]
    return out


def _remote(r: dict[str, Any]) -> list[Metric]:
    state = GaugeMetricFamily(
        f"{PREFIX}_remote_state", "the remote tier's state (1 for the current one)", labels=["state"]
    )
    for s in ("closed", "half_open", "open", "disabled", "stopped"):
        state.add_metric([s], 1 if r.get("state") == s else 0)
    return [
        state,
        _counter("remote_hits", "values fetched from the remote tier", r.get("hits", 0)),
        _counter("remote_refused", "values fetched, then refused by the local checks", r.get("refused", 0)),
        _labelled(
            "remote_misses", "values asked of the remote tier and not had, by why", "reason", r.get("misses", {})
        ),
        _counter("remote_fills", "prompts filled into the local tier from the remote one", r.get("fills", 0)),
        _labelled("remote_fill_misses", "fills tried and not done, by why", "reason", r.get("fill_misses", {})),
        _counter("remote_fetched_bytes", "bytes fetched from the remote tier", r.get("bytes_fetched", 0)),
        _counter("remote_pushed_bytes", "bytes pushed to the remote tier", r.get("bytes_pushed", 0)),
        _labelled("remote_push_failed", "pushes that failed, by why", "reason", r.get("push_failed", {})),
        _gauge("remote_queue_items", "pushes waiting", r.get("queue", {}).get("len", 0)),
        _counter("remote_queue_dropped", "pushes dropped from a full queue", r.get("queue", {}).get("dropped", 0)),
        _counter("remote_bad_removed", "bad values removed from the remote tier", r.get("bad_removed", 0)),
        _counter("remote_offers_refused", "pushes turned away at once", r.get("offers_refused", 0)),
        _counter("remote_events_failed", "event stream entries that failed to append", r.get("events_failed", 0)),
    ]


ENGINE_COUNTERS = {
    "restores": "prompts served in part from the cold tier",
    "restored_tokens": "prompt tokens loaded from the cold tier instead of computed",
    "cold_misses": "lookups the cold tier could not serve better than memory",
    "spills": "caches handed to the cold tier",
    "evictions_spilled": "entries the LRU evicted before their write-behind landed, spilled again (or that one kept)",
}


def engine_families(stats: dict[str, Any], prefix: str = f"{PREFIX}_mlx_lm") -> list[Metric]:
    """The mlx-lm integration's own counters (``ColdTierPromptCache.stats``)."""
    return [
        CounterMetricFamily(f"{prefix}_{k}", ENGINE_COUNTERS.get(k, k), value=float(v))
        for k, v in sorted(stats.items())
    ]


def engine_exposition(stats: dict[str, Any], status: dict[str, Any] | None = None) -> bytes:
    """The integration's counters; with ``status`` (its embedded tier's ``queue`` and ``store``), those too, as a
    daemon's metrics name them (``store_families``)."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(lambda: engine_families(stats) + ([] if status is None else store_families(status))))
    return bytes(generate_latest(registry))


class _Families(Collector):
    def __init__(self, make: Callable[[], list[Metric]]) -> None:
        self.make = make

    def collect(self) -> Iterator[Metric]:
        yield from self.make()


def exposition(st: dict[str, Any]) -> bytes:
    """The Prometheus text format of one ``status`` answer."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(lambda: families(st)))
    return bytes(generate_latest(registry))


def write_textfile(path: str, data: bytes) -> None:
    """Replace ``path`` atomically (a temp file beside it, then rename): the collector never reads half a file.

    The temp name does not end in ``.prom``, so node_exporter never picks it up."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
