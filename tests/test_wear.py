"""The write budget: once a day's bytes are written, droppable spills are shed (DROPPED, counted); others written."""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from mlx_lm.models import cache as C

import spilld
from spilld import errors
from spilld.entries import WEAR_BUCKET_S, Miss, Wear
from spilld.queue import Outcome
from spilld.store import Store
from tests.caches import fill

IDENT = spilld.Identity("wear")


def caches(n: int, seed: int = 0) -> list[C.KVCache]:
    return [fill(C.KVCache(), n, seed=seed + i) for i in range(2)]


@pytest.mark.asyncio
async def test_a_spent_budget_sheds_droppable_puts_and_writes_the_others(tmp_path: Path) -> None:
    s = Store(tmp_path, disk_cap=2**40, write_budget=1)  # one byte: spent by the first file
    await s.put(list(range(8)), caches(8), IDENT, droppable=True)  # the budget was not spent yet
    assert s.stats()["written_day"] > 1
    with pytest.raises(errors.WriteBudgetSpent) as got:
        await s.put(list(range(100, 108)), caches(8, seed=5), IDENT, droppable=True)
    assert got.value.code == "write_budget_spent" and isinstance(got.value, errors.Shed)
    assert s.count == 1 and s.counters.dropped_budget == 1
    await s.put(list(range(200, 208)), caches(8, seed=9), IDENT, droppable=False)  # never shed
    assert s.count == 2


@pytest.mark.asyncio
async def test_a_spent_budget_stays_spent_across_a_restart(tmp_path: Path) -> None:
    """Found in review: the day's count lived in memory alone, so each restart (a crash loop, an upgrade) gave a
    fresh budget: three runs of a 40,000-byte budget wrote 141,696 bytes in one day. A store adds what it wrote to
    its wear file at its stop (``record_wear``) and counts that file at its next scan; two runs add up."""
    from spilld.fileio import DEFAULT_OPS, Durability
    from spilld.store.wearfile import WEAR_FILE, add_wear, read_wear

    first = Store(tmp_path, disk_cap=2**40, write_budget=10**9)
    first.scan()
    await first.put(list(range(8)), caches(8), IDENT, droppable=True)
    wrote = first.stats()["written_day"]
    await first.record_wear()
    first.close()
    again = Store(tmp_path, disk_cap=2**40, write_budget=wrote)
    again.scan()
    assert again.stats()["written_day"] == again.stats()["written_week"] == wrote
    with pytest.raises(errors.WriteBudgetSpent):
        await again.put(list(range(100, 108)), caches(8, seed=5), IDENT, droppable=True)
    await again.put(list(range(200, 208)), caches(8, seed=9), IDENT, droppable=False)
    total = again.stats()["written_day"]
    await again.record_wear()
    again.close()
    third = Store(tmp_path, disk_cap=2**40)
    third.scan()
    assert third.stats()["written_day"] == total > wrote  # the second run's bytes added to the first's
    await third.record_wear()  # wrote nothing: the file as it was
    third.close()
    # garbage, a map keyed by a list (found in review: a TypeError stopped the start), too big: ignored
    for bad in (b"not msgpack", b"\x81\x92\x01\x02\x03", bytes(20_000)):
        (tmp_path / WEAR_FILE).write_bytes(bad)
        fresh = Store(tmp_path, disk_cap=2**40)
        fresh.scan()
        assert fresh.stats()["written_day"] == 0
    # found in review: an hour a week old, as the store itself keeps, made the whole file be ignored an hour later
    now = third.wear.hour()
    (tmp_path / WEAR_FILE).unlink()
    add_wear(str(tmp_path), {now - 7 * 24: 10, now: 40_000}, now, DEFAULT_OPS, Durability.NONE)
    assert read_wear(str(tmp_path), now + 1) == {now: 40_000}
    (tmp_path / WEAR_FILE).unlink()
    (tmp_path / WEAR_FILE).symlink_to(tmp_path / "elsewhere")  # never read through, never replaced
    linked = Store(tmp_path, disk_cap=2**40)
    linked.scan()
    await linked.put(list(range(300, 308)), caches(8, seed=11), IDENT)
    await linked.record_wear()  # (refused, said: the count is lost)
    linked.close()
    assert (tmp_path / WEAR_FILE).is_symlink() and not (tmp_path / "elsewhere").exists()


@pytest.mark.asyncio
async def test_a_spent_budget_never_sheds_a_checkpoint(tmp_path: Path) -> None:
    """Found in review: a checkpoint (droppable, as its spill's default) was shed once the budget was spent, and
    resume found none; design.md says checkpoints are written whatever the budget, as the write gate does."""
    from spilld.entries import checkpoint_namespace

    s = Store(tmp_path, disk_cap=2**40, write_budget=1)
    await s.put(list(range(8)), caches(8), IDENT, droppable=True)  # spends the budget
    ck = spilld.GenerationCheckpoint("gen", "", 6, 2, 5, 0, False)
    ident = spilld.Identity("wear", namespace=checkpoint_namespace("gen"))
    await s.put(list(range(100, 108)), caches(8, seed=5), ident, droppable=True, checkpoint=ck)
    assert s.count == 2 and s.counters.dropped_budget == 0


@pytest.mark.asyncio
async def test_no_budget_sheds_nothing(tmp_path: Path) -> None:
    s = Store(tmp_path, disk_cap=2**40)
    for i in range(3):
        await s.put([i, *range(8)], caches(9, seed=i), IDENT, droppable=True)
    assert s.count == 3 and s.counters.dropped_budget == 0


@pytest.mark.asyncio
async def test_a_shed_spill_settles_dropped_through_the_spiller(tmp_path: Path) -> None:
    sp = await spilld.Spiller.open(tmp_path, identity=IDENT)
    sp.store.write_budget = 1
    first = await sp.spill(list(range(8)), caches(8))
    shed = await sp.spill(list(range(50, 58)), caches(8, seed=3))
    kept = await sp.spill(list(range(90, 98)), caches(8, seed=6), droppable=False)
    assert (first.outcome, shed.outcome, kept.outcome) == (Outcome.STORED, Outcome.DROPPED, Outcome.STORED)
    assert isinstance(shed.error, errors.WriteBudgetSpent)
    assert sp.queue.dropped == 1 and sp.store.stats()["dropped_budget"] == 1
    written = sp.store.stats()["written_day"]
    await sp.close()
    again = await spilld.Spiller.open(tmp_path, identity=IDENT)  # its close recorded the day's bytes
    try:
        assert again.store.stats()["written_day"] == written > 0
    finally:
        await again.close()


@pytest.mark.asyncio
async def test_a_spiller_takes_a_write_budget_as_the_daemon_does(tmp_path: Path) -> None:
    """Found in review: ``Spiller`` took no write budget (the daemon's ``--write-budget``), so an embedded tier's
    disk wear could not be bounded. Given one, a droppable spill past it is shed (``write_budget_spent``), a
    non-droppable one still written, and its status says the budget as the daemon's does."""
    async with spilld.Spiller(tmp_path, identity=IDENT, write_budget=1) as sp:  # one byte: spent by the first file
        first = await sp.spill(list(range(8)), caches(8))
        shed = await sp.spill(list(range(50, 58)), caches(8, seed=3))
        kept = await sp.spill(list(range(90, 98)), caches(8, seed=6), droppable=False)
        assert (first.outcome, shed.outcome, kept.outcome) == (Outcome.STORED, Outcome.DROPPED, Outcome.STORED)
        assert isinstance(shed.error, errors.WriteBudgetSpent) and shed.error.code == "write_budget_spent"
        store = (await sp.status())["store"]
        assert store["write_budget"] == 1 and store["dropped_budget"] == 1 and store["written_day"] > 1


@pytest.mark.asyncio
async def test_a_spiller_takes_the_write_gate_as_the_daemon_does(tmp_path: Path) -> None:
    """Found in review: ``Spiller`` took no ``admit_after`` (the daemon's ``--admit-after``). Given 1, a droppable
    one-off is shed (``not_admitted``), and written once its lookup asked for it; a non-droppable one always is."""
    async with spilld.Spiller(tmp_path, identity=IDENT, block_tokens=16, admit_after=1) as sp:
        toks = list(range(40))
        shed = await sp.spill(toks, caches(40))
        assert shed.outcome is Outcome.DROPPED and isinstance(shed.error, errors.NotAdmitted)
        assert shed.error.code == "not_admitted"
        assert isinstance(await sp.lookup([*toks, 7]), Miss)  # a miss, and an ask
        assert (await sp.spill(toks, caches(40))).stored
        assert (await sp.spill(list(range(500, 540)), caches(40, seed=4), droppable=False)).stored
        store = sp.stats()["store"]
        assert store["admit_after"] == 1 and store["dropped_admit"] == 1 and sp.store.count == 2


@pytest.mark.asyncio
async def test_a_write_behind_the_gate_sheds_while_written_has_its_evictions_spill_written(tmp_path: Path) -> None:
    """Found in review of the gate above: a Spiller's store judges the gate once a spill's bytes are taken (under
    the engine's lease), after its writer took it. An eviction's spill (not droppable) made then is held on the
    write-behind being written (``behind=``); when the gate shed that one, the held spill was let go with it, and
    the evicted entry, its last copy, was lost. It is written in its place now."""
    lock = threading.Lock()
    lease = spilld.ThreadLockLease(lock)
    async with spilld.Spiller(tmp_path, identity=IDENT, lease=lease, block_tokens=16, admit_after=1) as sp:
        toks = list(range(40))
        with lock:  # the engine steps: the writer waits for the lease to take the write-behind's bytes
            behind = sp.spill(toks, caches(40))
            end = time.monotonic() + 10
            while sp.queue._in_flight is None and time.monotonic() < end:
                await asyncio.sleep(0.01)
            assert sp.queue._in_flight is not None  # taken by the writer, not judged yet
            evicted = sp.spill(toks, caches(40), droppable=False, behind=behind)
        settled = await evicted
        assert settled.stored, settled
        assert sp.store.count == 1 and sp.stats()["store"]["dropped_admit"] == 1


def test_wear_counts_the_last_day_and_week_by_the_hour() -> None:
    now = [1_000_000.9 * WEAR_BUCKET_S]  # late in an hour
    w = Wear(clock=lambda: now[0])
    w.add(100)
    now[0] += 23 * WEAR_BUCKET_S
    w.add(10)
    assert (w.last_day(), w.last_week()) == (110, 110)
    now[0] += 0.2 * WEAR_BUCKET_S  # the first write is 23.2 h old: still in (found in review: it had left the count)
    assert (w.last_day(), w.last_week()) == (110, 110)
    now[0] += 1.0 * WEAR_BUCKET_S  # now more than a day old
    assert (w.last_day(), w.last_week()) == (10, 110)
    now[0] += 7 * 24 * WEAR_BUCKET_S
    w.add(1)
    assert (w.last_day(), w.last_week()) == (1, 1)


@pytest.mark.asyncio
async def test_a_namespace_quota_evicts_only_that_namespace(tmp_path: Path) -> None:
    s = Store(tmp_path, disk_cap=2**40, block_tokens=16)
    other = spilld.Identity("wear", namespace="other")
    await s.put(list(range(1000, 1040)), caches(40), other)  # another tenant's entry: never touched below
    one = s.namespace_bytes("tenant")
    assert one == 0 and s.namespace_bytes("other") > 0
    tenant = spilld.Identity("wear", namespace="tenant")
    await s.put(list(range(40)), caches(40, seed=1), tenant)
    per_entry = s.namespace_bytes("tenant")
    s.namespace_quota = per_entry * 2 + per_entry // 2  # room for two entries of this size, not three
    for i in range(1, 4):
        await s.put([i * 100, *range(39)], caches(40, seed=i + 1), tenant)
        assert s.namespace_bytes("tenant") <= s.namespace_quota
    assert s.counters.quota_evicted == 2
    assert [e.namespace for e in s.entries].count("other") == 1  # the other tenant kept its entry
    assert s.namespace_bytes("tenant") + s.namespace_bytes("other") == s.total_bytes


@pytest.mark.asyncio
async def test_past_the_disk_cap_a_tenant_within_its_quota_evicts_its_own_entries_first(tmp_path: Path) -> None:
    """Found in review: with quotas that sum past the disk cap, a tenant within its quota evicted another tenant's
    entries at the cap. Its own unpinned entries go first; another's only when it has none left."""
    s = Store(tmp_path, disk_cap=2**40, block_tokens=16)
    other = spilld.Identity("wear", namespace="other")
    kept = await s.put(list(range(1000, 1040)), caches(40), other)
    tenant = spilld.Identity("wear", namespace="tenant")
    first = await s.put(list(range(40)), caches(40, seed=1), tenant)
    per_entry = s.namespace_bytes("tenant")
    s.disk_cap = s.total_bytes + per_entry // 2  # room for one more tenant entry's half: the cap binds
    s.namespace_quota = 3 * per_entry  # both tenants well within their quotas
    second = await s.put([100, *range(39)], caches(40, seed=2), tenant)
    assert s.total_bytes <= s.disk_cap and s.counters.quota_evicted == 0
    assert kept.path in s.index.by_path and second.path in s.index.by_path  # the other tenant's entry stays
    assert first.path not in s.index.by_path  # the writer's own older entry went instead
    s.disk_cap = per_entry // 2  # now it has nothing of its own left but the new entry: the other's goes
    third = await s.put([200, *range(39)], caches(40, seed=3), tenant)
    assert third.path in s.index.by_path and kept.path not in s.index.by_path


@pytest.mark.asyncio
async def test_past_the_disk_cap_a_tenant_evicts_its_own_pins_beyond_the_pin_cap_before_another_tenants(
    tmp_path: Path,
) -> None:
    """Found in review: past the disk cap a tenant's put passed over every pin of its own, those beyond --pin-cap
    too (which are evicted like the rest), and evicted another tenant's entry instead."""
    s = Store(tmp_path, disk_cap=2**40, block_tokens=16, pin_cap=0)  # no pin is kept apart
    other = spilld.Identity("wear", namespace="other")
    kept = await s.put(list(range(1000, 1040)), caches(40), other)
    tenant = spilld.Identity("wear", namespace="tenant")
    pinned = await s.put(list(range(40)), caches(40, seed=1), tenant, pin=True)
    per_entry = s.namespace_bytes("tenant")
    s.disk_cap = s.total_bytes + per_entry // 2
    s.namespace_quota = 3 * per_entry
    await s.put([100, *range(39)], caches(40, seed=2), tenant)
    assert kept.path in s.index.by_path and pinned.path not in s.index.by_path


@pytest.mark.asyncio
async def test_a_quota_judges_a_tenants_pins_against_the_pin_cap_of_the_whole_store(tmp_path: Path) -> None:
    """The pin cap is the store's: another tenant's newer pin fills it, so this tenant's older pin is beyond it and
    goes first (least recently used) when its quota binds, as it does past the disk cap. Found in review: the quota
    judged the tenant's pins against the cap alone, kept that pin, and evicted a newer entry instead."""
    tenant, other = spilld.Identity("wear", namespace="tenant"), spilld.Identity("wear", namespace="other")
    s = Store(tmp_path, disk_cap=2**40, block_tokens=0)
    pin = await s.put(list(range(8)), caches(8), tenant, pin=True)
    one = s.total_bytes  # every entry below is as big
    s.pin_cap, s.namespace_quota = one, 3 * one
    newer = await s.put([100, *range(7)], caches(8, seed=1), tenant)
    await s.put([200, *range(7)], caches(8, seed=2), tenant)
    theirs = await s.put([300, *range(7)], caches(8, seed=3), other, pin=True)  # the newest pin: it fills the cap
    await s.put([400, *range(7)], caches(8, seed=4), tenant)  # past the quota: one of the tenant's goes
    paths = {e.path for e in s.entries}
    assert s.counters.quota_evicted == 1 and s.count == 4 and s.total_bytes == 4 * one
    assert pin.path not in paths and newer.path in paths and theirs.path in paths


def entry_bytes(s: Store) -> int:
    return s.total_bytes // max(1, s.count)


@pytest.mark.asyncio
async def test_a_pinned_entry_is_evicted_last_and_kept_across_a_restart(tmp_path: Path) -> None:
    s = Store(tmp_path, disk_cap=2**40, block_tokens=0)
    first = await s.put(list(range(8)), caches(8), IDENT)
    assert s.pin(first.path) and not s.pin(str(tmp_path / "nothing.spilld"))
    for i in range(1, 3):
        await s.put([i * 100, *range(7)], caches(8, seed=i), IDENT)
    s.disk_cap = entry_bytes(s) * 2  # room for two of three: the oldest unpinned entry goes, not the pinned one
    s.evict_to_cap()
    assert first.path in [e.path for e in s.entries] and s.count == 2
    assert s.stats()["pinned"] == 1

    again = Store(tmp_path, disk_cap=2**40, block_tokens=0)  # a restart: the pin is in the root's pins file
    again.scan()
    e = again.entry_at(first.path)
    assert e is not None and again.is_pinned(e)
    # `spilld ls` shows it (found in a walk-through of the README: a pin showed nowhere but status's count)
    from spilld.store import list_entries

    rows = list_entries(str(tmp_path))
    assert len(rows) >= 2 and {r["path"] for r in rows if r["pinned"]} == {first.path}
    listed = subprocess.run(
        [sys.executable, "-m", "spilld", "ls", "--dir", str(tmp_path)], capture_output=True, text=True, timeout=60
    ).stdout.splitlines()
    assert [line.endswith("pinned") for line in listed[:-1]] == [r["pinned"] for r in rows]
    assert again.pin(first.path, on=False)
    third = Store(tmp_path, disk_cap=2**40, block_tokens=0)
    third.scan()
    e = third.entry_at(first.path)
    assert e is not None and not third.is_pinned(e)


@pytest.mark.asyncio
async def test_pins_beyond_the_pin_cap_are_evicted_like_the_rest(tmp_path: Path) -> None:
    s = Store(tmp_path, disk_cap=2**40, block_tokens=0, pin_cap=0)  # no pinned byte protected
    first = await s.put(list(range(8)), caches(8), IDENT, pin=True)
    await s.put([100, *range(7)], caches(8, seed=1), IDENT)
    s.disk_cap = entry_bytes(s)
    s.evict_to_cap()
    assert [e.path for e in s.entries] != [first.path]  # the older entry went, pinned or not


@pytest.mark.asyncio
async def test_a_pinned_prefix_is_never_superseded(tmp_path: Path) -> None:
    s = Store(tmp_path, disk_cap=2**40, block_tokens=16)
    system = list(range(40))
    pinned = await s.put(system, caches(40), IDENT, pin=True)
    plain = await s.put([1000, *range(39)], caches(40, seed=2), IDENT)
    await s.put([*system, 7, 8], caches(42), IDENT)  # extends both kinds of prefix
    await s.put([1000, *range(39), 7, 8], caches(42, seed=2), IDENT)
    paths = [e.path for e in s.entries]
    assert pinned.path in paths and plain.path not in paths and s.counters.superseded == 1


def test_spilld_pin_and_unpin_through_the_daemon(tmp_path: Path) -> None:
    from tests.daemons import Daemon, cleanup, new_root

    d = Daemon(new_root(), ["--cap", "64MiB", "--durability", "none"]).start()
    try:
        with spilld.Client(d.socket, identity=IDENT, name="pins") as client:
            assert client.spill(list(range(8)), caches(8), droppable=False).result(60).stored
            path = client.lookup([*range(8), 1]).path  # type: ignore[union-attr]
        out = d.cli("pin", path, "--socket", d.socket)
        assert out.returncode == 0 and "pinned" in out.stdout, out.stderr
        pins = Path(d.dir, ".spilld-pins")
        assert pins.read_text().strip() == os.path.relpath(path, d.dir)
        missing = d.cli("pin", str(tmp_path / "x.spilld"), "--socket", d.socket)
        assert missing.returncode == 1 and "not an entry" in missing.stderr
        out = d.cli("unpin", path, "--socket", d.socket)
        assert out.returncode == 0 and pins.read_text() == ""
    finally:
        d.stop()
        cleanup(d.root)


@pytest.mark.asyncio
async def test_the_gate_writes_a_droppable_prefix_once_it_was_asked_for_n_times(tmp_path: Path) -> None:
    s = Store(tmp_path, disk_cap=2**40, block_tokens=16, admit_after=2)
    toks = list(range(40))
    with pytest.raises(errors.NotAdmitted) as got:
        await s.put(toks, caches(40), IDENT, droppable=True)  # never asked for: not written
    assert got.value.code == "not_admitted" and isinstance(got.value, errors.Shed)
    assert s.count == 0 and not s.blocks and s.counters.bytes_written == 0 and s.counters.dropped_admit == 1
    await s.lookup_async(IDENT, "", [*toks, 7])  # an empty store: the asks are still hashed (off the loop)
    with pytest.raises(errors.NotAdmitted):
        await s.put(toks, caches(40), IDENT, droppable=True)  # asked once: not yet
    s.lookup(IDENT, "other", [*toks, 7])  # another namespace's asks do not count for this one
    with pytest.raises(errors.NotAdmitted):
        await s.put(toks, caches(40), IDENT, droppable=True)
    s.lookup(IDENT, "", toks[:20])  # a shorter prompt: its first block (the first one the spill adds) asked twice
    await s.put(toks, caches(40), IDENT, droppable=True)
    assert s.count == 1 and len(s.blocks) == 2 and s.stats()["dropped_admit"] == 3
    # past stored blocks, the first new one counts: [40, 80) was asked for once
    longer = list(range(80))
    s.lookup(IDENT, "", [*longer, 1])
    with pytest.raises(errors.NotAdmitted):
        await s.put(longer, caches(80), IDENT, droppable=True)
    s.lookup(IDENT, "", [*longer, 2])
    await s.put(longer, caches(80), IDENT, droppable=True)
    assert len(s.blocks) == 5
    # the next turn adds less than one block past what is stored: cheap, always written
    await s.put([*longer, 80, 81, 82], caches(83), IDENT, droppable=True)
    assert s.counters.stored == 3
    # a spill its engine needs kept is never gated
    await s.put(list(range(500, 540)), caches(40, seed=4), IDENT, droppable=False)
    assert s.counters.stored == 4


@pytest.mark.asyncio
async def test_the_gate_never_sheds_a_generation_checkpoint(tmp_path: Path) -> None:
    """Found in review: a checkpoint is never asked for by a lookup (``resume`` finds it), so with ``--admit-after``
    every checkpoint of a block or more was shed and ``resume`` never worked."""
    s = Store(tmp_path, disk_cap=2**40, block_tokens=16, admit_after=1)
    ck = spilld.GenerationCheckpoint("gen", "", 298, 2, 5, 0, False)
    await s.put(list(range(300)), caches(300), IDENT, droppable=True, checkpoint=ck)
    assert s.counters.dropped_admit == 0 and s.count == 1


@pytest.mark.asyncio
async def test_without_a_gate_no_asks_are_counted(tmp_path: Path) -> None:
    s = Store(tmp_path, disk_cap=2**40, block_tokens=16)
    assert s.admission is None
    await s.put(list(range(40)), caches(40), IDENT, droppable=True)
    assert s.count == 1 and s.stats()["admit_after"] == 0


def test_the_gate_forgets_the_least_recently_asked_prefix_first() -> None:
    from spilld.admission import Admission

    gate = Admission(1, 4, tracked=3)
    gate.asked("m", [1, 2, 3, 4, 5, 6, 7, 8])  # two prefixes
    gate.asked("m", [9, 9, 9, 9])  # a third
    assert gate.asks("m", [1, 2, 3, 4]) == 1
    gate.asked("m", [1, 2, 3, 4])  # the oldest asked again: now the newest
    gate.asked("m", [5, 5, 5, 5])  # a fourth: the least recently asked ([1..8]) goes
    assert gate.asks("m", [1, 2, 3, 4, 5, 6, 7, 8]) == 0
    assert gate.asks("m", [1, 2, 3, 4]) == 2 and gate.asks("m", [9, 9, 9, 9]) == 1
    assert gate.asks("n", [1, 2, 3, 4]) == 0  # another scope


@pytest.mark.asyncio
async def test_unique_bytes_count_the_tokens_the_store_did_not_hold(tmp_path: Path) -> None:
    s = Store(tmp_path, disk_cap=2**40, block_tokens=16)
    first = await s.put(list(range(64)), caches(64), IDENT)
    per_token = first.header.data_bytes // 64 if first.header.blocks is None else None
    assert s.counters.unique_added > 0
    one = s.counters.unique_added
    assert per_token is None or one == per_token * 64
    await s.put(list(range(64)), caches(64), IDENT)  # the same again: nothing new
    assert s.counters.unique_added == one
    await s.put(list(range(96)), caches(96), IDENT)  # 32 new tokens past 4 stored blocks
    assert s.counters.unique_added == one + one // 2
    st = s.stats()
    assert st["bytes_written"] > st["unique_added"]  # headers and block files cost a little more


@pytest.mark.asyncio
async def test_unique_bytes_count_a_superseded_prefix_as_held(tmp_path: Path) -> None:
    s = Store(tmp_path, disk_cap=2**40, block_tokens=0)  # whole files: what is held comes from supersede
    await s.put(list(range(10)), caches(10), IDENT)
    one = s.counters.unique_added
    await s.put(list(range(20)), caches(20), IDENT)
    assert s.counters.superseded == 1 and s.counters.unique_added == 2 * one


def test_the_gate_through_the_daemon_and_its_status(tmp_path: Path) -> None:
    from tests.daemons import Daemon, cleanup, new_root

    d = Daemon(new_root(), ["--cap", "64MiB", "--durability", "none", "--admit-after", "1"]).start()
    try:
        toks = list(range(200))
        with spilld.Client(d.socket, identity=IDENT, name="gate") as client:
            shed = client.spill(toks, caches(200)).result(60)
            assert shed.outcome is Outcome.DROPPED and isinstance(shed.error, errors.NotAdmitted)
            assert client.lookup([*toks, 1]) is not None  # a miss, and an ask
            assert client.spill(toks, caches(200)).result(60).stored
        out = d.cli("status", "--socket", d.socket)
        assert out.returncode == 0, out.stderr
        assert "shed by the gate (--admit-after 1) 1" in out.stdout and "write amplification " in out.stdout
    finally:
        d.stop()
        cleanup(d.root)


def _slowed(fn: Any) -> Any:
    """``fn`` that waits after it reads: a second writer that does not wait its turn reads the same old file."""

    def slow(*args: Any) -> Any:
        got = fn(*args)
        time.sleep(0.3)
        return got

    return slow


def _at_once(*calls: Any) -> None:
    threads = [threading.Thread(target=c) for c in calls]
    for t in threads:
        t.start()
        time.sleep(0.05)  # each starts inside the previous one's read-to-replace window
    for t in threads:
        t.join(10)


def test_two_stores_rewriting_the_pins_or_the_wear_file_at_once_lose_neither_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Found in review: the pins and the wear file are read, merged and replaced by each store of a folder; two at
    once (two Spillers of one folder) both read the old file, and the second's rename dropped the first's pin or
    count. Each rewrite now holds the root's update lock (its own open of it, as another process has)."""
    from spilld.fileio import DEFAULT_OPS, Durability
    from spilld.store import pins, wearfile

    root = str(tmp_path)
    a, b = (os.path.join(root, n) for n in ("a.spilld", "b.spilld"))
    for p in (a, b):
        Path(p).write_bytes(b"")
    monkeypatch.setattr(pins, "_read_names", _slowed(pins._read_names))
    _at_once(*(lambda p=p: pins.update_pins(root, {p: True}, [], DEFAULT_OPS, Durability.NONE) for p in (a, b)))
    assert pins.read_pins(root) == [a, b]
    now = Wear().hour()
    monkeypatch.setattr(wearfile, "read_wear", _slowed(wearfile.read_wear))
    _at_once(*(lambda n=n: wearfile.add_wear(root, {now: n}, now, DEFAULT_OPS, Durability.NONE) for n in (10, 20)))
    assert wearfile.read_wear(root, now) == {now: 30}


def test_the_update_lock_waits_a_bounded_time_and_takes_no_file_it_did_not_make(tmp_path: Path) -> None:
    """The update lock is an empty regular file of spilld's: a held one is waited for ``wait_s`` at most
    (``StorageTimeout``); anything else at its name (a link, a FIFO, a file with bytes) is refused and left alone."""
    import fcntl

    from spilld.lockfile import UPDATE_LOCK_NAME, updating

    root = str(tmp_path)
    with updating(root):
        pass
    path = tmp_path / UPDATE_LOCK_NAME
    assert path.stat().st_size == 0
    with open(path, "rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        t0 = time.monotonic()
        with pytest.raises(errors.StorageTimeout), updating(root, wait_s=0.2):
            pass
        assert 0.2 <= time.monotonic() - t0 < 5
    path.unlink()
    (tmp_path / "theirs").write_bytes(b"keep")
    for make in (
        lambda: path.symlink_to(tmp_path / "theirs"),
        lambda: os.mkfifo(path),
        lambda: path.write_bytes(b"someone's notes"),
    ):
        make()
        with pytest.raises(errors.StorageError, match=r"not a spilld lock file|Too many levels"), updating(root):
            pass
        assert (tmp_path / "theirs").read_bytes() == b"keep"
        assert path.is_symlink() or path.is_fifo() or path.read_bytes() == b"someone's notes"
        path.unlink()


def test_a_child_forked_during_a_rewrite_keeps_no_update_lock(tmp_path: Path) -> None:
    """Found in review: the update lock is a flock, which goes with the open file a fork shares; a worker process
    forked while a pins or wear rewrite held it kept it for its life, and every later rewrite of the folder's stores
    waited ``UPDATE_WAIT_S`` and failed with ``io_timeout``. A child closes its copy at once, as it does the
    folder's lock."""
    from spilld.lockfile import updating
    from tests.forks import child_alive

    root = str(tmp_path)
    with contextlib.ExitStack() as alive:
        with updating(root):
            alive.enter_context(child_alive())  # forked while the lock is held; lives on after
        with updating(root, wait_s=0.5):
            pass


def test_a_wear_file_that_cannot_be_read_is_left_as_it_is(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found in review: a store's stop read the wear file to add its run's bytes, and a read that failed (EIO, EMFILE)
    was taken for no file: the week's earlier counts were replaced by the run's alone. Now such a file is left as it
    is (``StorageError``: the store says the run's bytes were not recorded), as the pins file is never rebuilt from
    less than it holds."""
    import errno

    from spilld import fileio
    from spilld.fileio import DEFAULT_OPS, Durability
    from spilld.store import wearfile

    root, now = str(tmp_path), Wear().hour()
    wearfile.add_wear(root, {now - 5: 1000, now - 1: 2000}, now, DEFAULT_OPS, Durability.NONE)
    real = fileio.open_regular

    def eio(path: str, flags: int = 0) -> int:
        if path.endswith(wearfile.WEAR_FILE):
            raise OSError(errno.EIO, "Input/output error")
        return real(path, flags)

    monkeypatch.setattr(fileio, "open_regular", eio)
    with pytest.raises(errors.StorageError):
        wearfile.add_wear(root, {now: 10}, now, DEFAULT_OPS, Durability.NONE)
    monkeypatch.undo()
    assert wearfile.read_wear(root, now) == {now - 5: 1000, now - 1: 2000}
    wearfile.add_wear(root, {now: 10}, now, DEFAULT_OPS, Durability.NONE)  # readable again: added as before
    assert wearfile.read_wear(root, now) == {now - 5: 1000, now - 1: 2000, now: 10}


@pytest.mark.asyncio
async def test_the_wear_file_is_synced_before_it_replaces_the_old_one(tmp_path: Path) -> None:
    """Found in review: the wear file was renamed over the old one unsynced, so a power loss could leave an empty
    file under the name and lose every earlier count, not only this run's. At durability fsync it is synced first."""
    from spilld.fileio import FileOps
    from spilld.store.wearfile import WEAR_FILE

    class Synced(FileOps):
        def __init__(self) -> None:
            self.paths: list[str] = []

        def fsync(self, fd: int, durability: Any) -> None:
            self.paths.append(os.readlink(f"/proc/self/fd/{fd}"))
            super().fsync(fd, durability)

        def rename(self, src: str, dst: str) -> None:
            self.paths.append(f"rename -> {dst}")
            super().rename(src, dst)

    ops = Synced()
    s = Store(tmp_path, disk_cap=2**40, ops=ops)
    s.scan()
    await s.put(list(range(8)), caches(8), IDENT)
    ops.paths.clear()
    await s.record_wear()
    s.close()
    wear = str(tmp_path / WEAR_FILE)
    assert ops.paths[-1] == f"rename -> {wear}" and os.path.dirname(ops.paths[-2]) == str(tmp_path), ops.paths
