"""A writer without the folder's lock (a Spiller in a daemon's folder: a guest) keeps what it reports stored through
the owner's restart: a scan that reaps waits for no guest, it leaves their files alone (the guests' lock)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import spilld
from spilld import errors, fileio
from spilld.entries import Hit
from spilld.lockfile import GUESTS_LOCK_NAME, FileLock
from spilld.store import EXT, Store
from spilld.store import store as store_module
from tests.blocks_corpus import B, conversation, toks

IDENT = spilld.Identity("guests", "cfg", "tok", "")


class RestartBeforeManifest(fileio.FileOps):
    """Runs ``restart`` once, when a put has published its blocks and is about to write its manifest."""

    def __init__(self, restart: Any) -> None:
        self.restart = restart
        self.fired = False

    def open_new(self, path: str, flags: int = 0) -> int:
        if f"{EXT}." in os.path.basename(path) and not self.fired:  # the manifest's temp file, not a block's
            self.fired = True
            self.restart()
        return super().open_new(path, flags)


def chat(start: int) -> tuple[list[int], list[Any]]:
    """Three blocks and a tail, none shared with another start's."""
    t = toks(3 * B + 4, start=start)
    return t, conversation(t)


def owner_of(root: Path) -> Store:
    """A daemon's store: the folder's lock held alone for its life, then its start's scan."""
    s = Store(root, disk_cap=2**40, block_tokens=B)
    s.acquire()
    s.scan()
    return s


def block_files(root: Path) -> set[str]:
    return {n for _, _, names in os.walk(root) for n in names if n.endswith(".spilld-block")}


@pytest.mark.asyncio
async def test_a_guests_put_under_way_keeps_its_blocks_through_the_owners_restart(tmp_path: Path) -> None:
    """Found in review: a daemon restarted while a guest's put had published its blocks but not yet its manifest;
    the start's scan found blocks no manifest named and unlinked them, then the guest published its manifest and
    reported the entry stored. The next start quarantined it (``BlockMissing``): a spill reported stored, lost."""
    owners = [owner_of(tmp_path)]
    await owners[0].put(*chat(5000), IDENT)

    def restart() -> None:  # on the put's worker thread, between its blocks and its manifest
        owners[0].close()
        owners.append(owner_of(tmp_path))

    guest = Store(tmp_path, disk_cap=2**40, block_tokens=B, ops=RestartBeforeManifest(restart))
    assert guest.scan() == 1 and not guest.lock.held  # the owner's folder: a guest
    mine = await guest.put(*chat(6000), IDENT)
    assert guest.ops.fired and owners[1].stats()["blocks_reclaimed"] == 0
    assert (entry := guest.entry_at(mine.path)) is not None
    assert all(os.path.exists(rec.path) for rec in guest.named_blocks(entry))
    owners[1].close()
    guest.close()
    after = Store(tmp_path, disk_cap=2**40, block_tokens=B)  # the next start: both entries, nothing quarantined
    assert after.scan() == 2 and after.stats()["quarantined"] == 0
    hit = after.lookup(IDENT, "", [*chat(6000)[0], 7])
    assert isinstance(hit, Hit) and hit.entry.path == mine.path
    assert isinstance(after.restore(hit, IDENT), spilld.Loaded)


@pytest.mark.asyncio
async def test_a_scan_reaps_what_nothing_names_once_no_guest_writes(tmp_path: Path) -> None:
    """While a guest holds the guests' lock, an owner's scan leaves temp files and unnamed blocks where they are
    (and out of its index); once the guest is closed, the next owner's scan reaps them."""
    owner = owner_of(tmp_path)
    guest = Store(tmp_path, disk_cap=2**40, block_tokens=B)
    assert guest.scan() == 0 and not guest.lock.held
    mine = await guest.put(*chat(6000), IDENT)
    ours = block_files(tmp_path)
    gone = await owner.put(*chat(5000), IDENT)
    orphans = block_files(tmp_path) - ours
    owner.close()
    os.unlink(gone.path)  # a crash between an eviction's two unlinks: its blocks are named by nothing now
    temp = Path(gone.path).with_name(f".x{fileio.TEMP_SUFFIX}")
    temp.write_bytes(b"t")
    owner = owner_of(tmp_path)  # restarted while the guest lives: nothing of anyone's is reaped
    assert owner.stats()["blocks_reclaimed"] == 0 and owner.stats()["reaped_temp"] == 0
    assert block_files(tmp_path) == ours | orphans and temp.exists()
    assert len(owner.blocks) == len(ours) and all(b.refs for b in owner.blocks)  # the unnamed: left out
    owner.close()
    guest.close()
    owner = owner_of(tmp_path)  # no guest: what nothing names goes
    try:
        assert owner.stats()["blocks_reclaimed"] == len(orphans) == 3 and owner.stats()["reaped_temp"] == 1
        assert not temp.exists() and block_files(tmp_path) == ours and owner.entry_at(mine.path) is not None
    finally:
        owner.close()


@pytest.mark.asyncio
async def test_a_guests_put_waits_for_a_reaping_scan_then_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A guest's put waits while a scan holds the guests' lock alone; past ``GUEST_WAIT_S`` it is refused
    (``Busy``), with nothing written; once the scan is done it writes."""
    monkeypatch.setattr(store_module, "GUEST_WAIT_S", 0.3)
    guest = Store(tmp_path, disk_cap=2**40, block_tokens=B)
    scanning = FileLock(str(tmp_path / GUESTS_LOCK_NAME), "a scan")
    assert scanning.try_acquire()
    try:
        t0 = asyncio.get_running_loop().time()
        with pytest.raises(errors.Busy):
            await guest.put(*chat(5000), IDENT)
        assert asyncio.get_running_loop().time() - t0 >= 0.3 and block_files(tmp_path) == set()
        late = asyncio.create_task(guest.put(*chat(5000), IDENT))
        await asyncio.sleep(0.1)
        assert not late.done()
    finally:
        scanning.release()
    await late
    assert guest.count == 1 and guest.guests.fd is not None and guest.guests.shared
    guest.close()


def test_an_evict_without_a_daemon_leaves_the_blocks_a_guest_may_name(tmp_path: Path) -> None:
    """``spilld evict --dir`` with no daemon removes entries, and the blocks nothing names only once no guest
    writes in the folder (it says so)."""
    root = tmp_path / "store"
    guest = Store(root, disk_cap=2**40, block_tokens=B)
    asyncio.run(guest.put(*chat(5000), IDENT))
    blocks = block_files(root)

    def evict() -> subprocess.CompletedProcess[str]:
        cmd = [sys.executable, "-m", "spilld", "evict", "--all", "--dir", str(root), "--socket", str(tmp_path / "n")]
        return subprocess.run(cmd, capture_output=True, text=True, timeout=120)

    r = evict()
    assert r.returncode == 0 and "evicted 1 entr" in r.stdout and "left for a later evict" in r.stderr, r
    assert block_files(root) == blocks
    guest.close()
    r = evict()
    assert r.returncode == 0 and block_files(root) == set(), r


def test_a_file_at_the_guests_lock_name_that_is_not_ours_is_refused_and_no_lock_kept(tmp_path: Path) -> None:
    """A file no spilld wrote at ``.spilld.guests.lock`` is left as it is and the scan refuses the folder
    (``UnusableFolder``), letting go of the folder's lock it took for the scan."""
    (tmp_path / GUESTS_LOCK_NAME).write_text("a user's notes\n")
    s = Store(tmp_path, disk_cap=2**40, block_tokens=B)
    with pytest.raises(errors.UnusableFolder):
        s.scan()
    assert not s.lock.held and s.lock.fd is None and (tmp_path / GUESTS_LOCK_NAME).read_text() == "a user's notes\n"
