"""Metrics (Prometheus, through prometheus_client) and logs (JSON fields, debug lines) of a real daemon."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

import spilld
from spilld.client import AsyncClient
from spilld.metrics import METRICS_EVERY_S, LatencyHistogram, exposition
from tests.daemons import Daemon, cleanup, new_root
from tests.promtext import parse


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


@pytest.fixture
def daemon() -> Iterator[Daemon]:
    d = Daemon(new_root())
    d.args = ["--cap", "64MiB", "--log-level", "debug", "--metrics-file", os.path.join(d.root, "spilld.prom")]
    d.start()
    try:
        yield d
    finally:
        d.kill()
        cleanup(d.root)


def log_lines(d: Daemon) -> list[dict[str, Any]]:
    return [json.loads(line) for line in d.read_log().splitlines() if line.startswith("{")]


async def traffic(d: Daemon) -> None:
    """One store, one miss, one restore kept, one restore not worth reading (memory had as much)."""
    from mlx_lm.models import cache as C

    from tests.caches import fill

    client = await AsyncClient.open(d.socket, identity=spilld.Identity("m"), name="metrics")
    assert (await client.spill(list(range(16)), [fill(C.KVCache(), 16)])).stored
    assert await client.load([99, 98, 97]) is None  # no_entry
    assert await client.load([*range(16), 7]) is not None  # a hit
    assert await client.load([*range(16), 7], longer_than=16) is None  # not read, not a hit
    await client.close()


def test_metrics_file_status_prometheus_and_debug_logs(daemon: Daemon) -> None:
    asyncio.run(traffic(daemon))
    r = subprocess.run(
        [sys.executable, "-m", "spilld", "status", "--format", "prometheus", "--socket", daemon.socket],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    parse(r.stdout)  # the exposition format's every rule (tests/promtext.py), not only what prometheus_client reads
    got = samples(r.stdout)
    assert got[("spilld_hits_total", ())] == 1 and got[("spilld_lookups_total", ())] == 3
    assert got[("spilld_misses_total", (("reason", "no_entry"),))] == 1
    assert got[("spilld_queue_outcomes_total", (("outcome", "stored"),))] == 1
    assert got[("spilld_written_bytes_total", ())] > 0 and got[("spilld_disk_entries", ())] == 1
    assert got[("spilld_restore_seconds_count", ())] == 1 and got[("spilld_restore_seconds_sum", ())] > 0
    assert got[("spilld_store_written_bytes_total", ())] > 0 and ("spilld_blocks", ()) in got
    assert got[("spilld_shed_total", (("reason", "admit_after"),))] == 0
    # what status shows is in the metrics too (found in review: the week's writes, the budget, ingest were not)
    assert got[("spilld_written_week_bytes", ())] >= got[("spilld_written_day_bytes", ())] > 0
    assert ("spilld_write_budget_bytes", ()) not in got  # no budget, no gauge (found in review: 0 fired alerts)
    assert got[("spilld_ingest_open_spills", ())] == 0
    assert got[("spilld_ingest_expired_total", ())] == 0 and ("spilld_ingest_held_bytes_total", ()) in got
    # the textfile catches up within a few seconds, and is never seen half written
    prom = os.path.join(daemon.root, "spilld.prom")
    deadline = time.monotonic() + 3 * METRICS_EVERY_S
    while time.monotonic() < deadline:
        text = Path(prom).read_text() if os.path.exists(prom) else ""
        if text and samples(text).get(("spilld_hits_total", ())) == 1:
            break
        time.sleep(0.2)
    assert samples(text)[("spilld_restore_seconds_count", ())] == 1
    parse(text)
    assert [n for n in os.listdir(daemon.root) if n.startswith("spilld.prom")] == ["spilld.prom"]  # no temp left
    assert daemon.stop() == 0
    lines = log_lines(daemon)
    msgs = [ln["msg"] for ln in lines]
    assert "stored" in msgs and "lookup: hit" in msgs and "restored" in msgs
    miss = next(ln for ln in lines if ln["msg"] == "lookup: miss")
    assert miss["reason"] == "no_entry" and miss["tokens"] == 3
    assert any(ln["msg"].endswith("disconnected") and ln["client_name"] == "metrics" for ln in lines)
    connected = next(ln for ln in lines if "connected: metrics" in ln["msg"])
    assert connected["client_name"] == "metrics" and isinstance(connected["client"], int)
    stopped = lines[-1]
    assert stopped["msg"] == "stopped" and stopped["queue"]["stored"] == 1 and stopped["exit"] == 0  # fields, not text


def test_histogram_buckets_are_cumulative_in_the_exposition() -> None:
    h = LatencyHistogram((0.01, 0.1))
    for s in (0.005, 0.05, 0.05, 3.0):
        h.observe(s)
    st = {
        "queue": {"pending_items": 0, "pending_bytes": 0},
        "store": {"entries": 0, "bytes": 0, "disk_cap": 1, "hits": 0, "misses": {}},
        "restore_seconds": h.to_wire(),
    }
    got = samples(exposition(st).decode())
    buckets = [got[("spilld_restore_seconds_bucket", (("le", le),))] for le in ("0.01", "0.1", "+Inf")]
    assert buckets == [1, 3, 4] and got[("spilld_restore_seconds_count", ())] == 4


def test_a_metrics_file_in_a_missing_folder_is_refused(tmp_path: Any) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "spilld", "--metrics-file", str(tmp_path / "no" / "x.prom"), "--socket",
         str(tmp_path / "s.sock"), "--dir", str(tmp_path / "d")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_the_scrub_and_the_warm_start_are_in_the_metrics_when_status_has_them() -> None:
    """Found in review: ``status`` showed the scrub's and the warm start's progress, the metrics did not."""
    from prometheus_client.exposition import generate_latest
    from prometheus_client.registry import Collector, CollectorRegistry

    from spilld.metrics import families

    st = {
        "queue": {"pending_items": 0, "pending_bytes": 0},
        "store": {"entries": 0, "bytes": 0, "disk_cap": 1, "hits": 0, "misses": {}},
        "scrub": {"passes": 2, "files": 5, "bytes": 10, "planned_files": 9, "bad": 1, "unreadable": 3, "paused": False},
        "warm": {"planned_bytes": 100, "read_bytes": 60, "files": 2, "done": False},
    }

    class Once(Collector):
        def collect(self) -> Any:
            return families(st)

    reg = CollectorRegistry()
    reg.register(Once())
    got = samples(generate_latest(reg).decode())
    assert got[("spilld_scrub_passes_total", ())] == 2 and got[("spilld_scrub_bad_files_total", ())] == 1
    assert got[("spilld_scrub_unreadable_files_total", ())] == 3 and got[("spilld_scrub_pass_files", ())] == 5
    assert got[("spilld_warm_read_bytes", ())] == 60 and got[("spilld_warm_done", ())] == 0


def test_the_write_budget_gauge_is_there_only_with_a_budget() -> None:
    """Found in review: with no budget the gauge read 0, and an alert on written_day_bytes > write_budget_bytes
    fired on every daemon that wrote anything."""
    for budget in (None, 5000):
        st = {
            "queue": {"pending_items": 0, "pending_bytes": 0},
            "store": {"entries": 0, "bytes": 0, "disk_cap": 1, "hits": 0, "misses": {}, "blocks": 0,
                      "bytes_written": 0, "write_budget": budget},
        }  # fmt: skip
        got = samples(exposition(st).decode())
        assert got.get(("spilld_write_budget_bytes", ())) == budget


@pytest.mark.asyncio
async def test_a_lookup_filled_from_the_shared_tier_never_takes_a_miss_back() -> None:
    """Found in review: a lookup that missed locally counted its miss, asked the shared tier, and took the miss back
    once the fill kept the prompt; a status (or the metrics file) made while the fill ran read the miss, the next
    one read it gone, and ``spilld_misses_total`` went down: a counter reset to Prometheus. A miss is counted once
    the answer kept is known."""
    from mlx_lm.models import cache as C

    from spilld.daemon import Daemon as InProcess
    from tests.caches import fill
    from tests.daemons import quiet_config

    root = new_root()
    daemon = InProcess(quiet_config(root, block_tokens=16))
    await daemon.start()
    ident, prompt = spilld.Identity("fill"), list(range(40))
    asked, fetched = asyncio.Event(), asyncio.Event()

    class SlowTier:
        """A shared tier whose fill takes a while, then keeps the prompt (as one fetched would be)."""

        async def fill(self, ident: Any, namespace: str, tokens: Any, provider: str) -> bool:
            if [int(t) for t in tokens] != [*prompt, 1]:
                return False  # not held there either
            asked.set()
            await fetched.wait()
            await daemon.store.put(prompt, [fill(C.KVCache(), len(prompt))], ident)
            return True

        def counters(self) -> dict[str, Any]:
            return {"state": "closed"}

    def misses() -> float:
        got = samples(exposition(daemon.status()).decode())
        return sum(v for (name, _), v in got.items() if name == "spilld_misses_total")

    daemon.remote = SlowTier()  # type: ignore[assignment]
    try:
        async with AsyncClient(daemon.cfg.socket, identity=ident, shm=False) as c:
            looking = asyncio.ensure_future(c.lookup([*prompt, 1]))
            await asyncio.wait_for(asked.wait(), 30)
            during = misses()
            fetched.set()
            assert isinstance(await looking, spilld.Hit)
            assert during <= misses() == 0  # the answer was a hit: no miss was ever counted
            assert isinstance(await c.lookup([999, 998, 997]), spilld.Miss)
            assert misses() == 1  # a miss the shared tier did not fill is counted, once
    finally:
        daemon.remote = None
        await daemon.stop()
        cleanup(root)


def test_the_exposition_keeps_the_format_in_every_state_and_types_running_totals_as_counters() -> None:
    """Read by a strict reader of the text format: a daemon's first status (no restore yet, no shared tier), one
    with every section, counters past 2**53 and label values to escape. Found in review: ``ingest_held_bytes``, a
    running total since the start, was a gauge (its ``rate()`` wrong across a restart, its HELP read as a level)."""
    from spilld.metrics import RESTORE_BUCKETS_S

    first = {
        "version": "0.1",
        "queue": {"pending_items": 0, "pending_bytes": 0},
        "store": {"entries": 0, "bytes": 0, "disk_cap": 1, "hits": 0, "misses": {}},
        "restore_seconds": LatencyHistogram(RESTORE_BUCKETS_S).to_wire(),
    }
    huge = 2**70
    h = LatencyHistogram(RESTORE_BUCKETS_S)
    for s in (0.0, 0.001, 0.3, 100.0):
        h.observe(s)
    full = first | {
        "version": 'a "quoted" \\ version\nline',
        "ingest": {"open_spills": 1, "receiving": 2, "buffers": 3, "expired": huge, "held_bytes": huge},
        "store": first["store"] | {
            "hits": huge, "misses": {"no_entry": huge}, "errors": {'odd"code\\\n': 1}, "blocks": 3,
            "bytes_written": huge, "write_budget": 10, "quarantine_removed": 2,
        },
        "remote": {"state": "half_open", "misses": {"down": 1}, "fill_misses": {}, "push_failed": {"oom": huge},
                   "queue": {"len": 1, "dropped": huge}},
        "scrub": {"passes": huge, "files": 1, "bytes": 2, "planned_files": 3, "bad": 0, "unreadable": 0},
        "warm": {"planned_bytes": 1, "read_bytes": 1, "files": 1, "done": True},
        "restore_seconds": h.to_wire(),
    }  # fmt: skip
    for st in (first, full):
        fams = parse(exposition(st).decode())
        assert fams["spilld_restore_seconds"].type == "histogram" and fams["spilld_hits_total"].type == "counter"
    fams = parse(exposition(full).decode())
    held = fams["spilld_ingest_held_bytes_total"]
    assert held.type == "counter" and held.samples == [("spilld_ingest_held_bytes_total", {}, float(huge))]
    assert fams["spilld_info"].samples[0][1] == {"version": full["version"]}  # escaped, and read back whole
