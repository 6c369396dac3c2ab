"""What the store indexes and answers: entries (manifests and v1 files), prefix blocks, hits and misses, the
counters and the wear count, the listener protocol, and the names of the folders they live in. No I/O."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Protocol

import msgpack
import numpy as np
import xxhash

from . import errors
from . import format as fmt

CHECKPOINT_NS_PREFIX = "\0checkpoint:"


def identity_fingerprint(ident: fmt.Identity) -> str:
    """The folder of one model: its config fingerprint, tokenizer and model id, hashed."""
    blob = msgpack.packb([ident.model_id, ident.config_fingerprint, ident.tokenizer_hash])
    return xxhash.xxh3_64_hexdigest(blob)


def namespace_hash(namespace: str) -> str:
    return xxhash.xxh3_64_hexdigest(namespace.encode()) if namespace else "base"


def checkpoint_namespace(key: str) -> str:
    return CHECKPOINT_NS_PREFIX + key


def token_array(raw: bytes) -> np.ndarray:
    """``format.decode_tokens`` as a read-only uint32 array over ``raw``: 4 bytes a token, where a list holds a
    Python int of 28 bytes and a pointer of 8 (a lookup of a 4 MiB message held 39 MiB while it waited)."""
    if len(raw) % 4:
        raise errors.HeaderMalformed("token bytes are not a multiple of 4")
    return np.frombuffer(raw, dtype="<u4")


def check_namespace(namespace: str) -> str:
    """Caller namespaces may not pose as checkpoint namespaces."""
    if namespace.startswith(CHECKPOINT_NS_PREFIX):
        raise errors.BadParams("namespaces starting with the checkpoint prefix are reserved")
    return namespace


WEAR_BUCKET_S = 3600  # bytes written are counted per hour, for the last day and week


class Wear:
    """Bytes the store wrote, per hour, for the last 7 days: what earlier runs recorded (``recorded``: the wear
    file, read at the scan) and what this one wrote (``written``, added to that file at the close)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._hours: dict[int, int] = {}
        self.written: dict[int, int] = {}  # this run's alone

    def hour(self) -> int:
        return int(self._clock() // WEAR_BUCKET_S)

    def add(self, nbytes: int) -> None:
        hour = self.hour()
        for hours in (self._hours, self.written):
            hours[hour] = hours.get(hour, 0) + nbytes
            for h in [h for h in hours if h < hour - 7 * 24]:
                del hours[h]

    def recorded(self, hours: Mapping[int, int]) -> None:
        """Count what earlier runs wrote (the wear file's hours, checked by its reader) with this run's."""
        for h, n in hours.items():
            self._hours[h] = self._hours.get(h, 0) + n

    def _since(self, hours: int) -> int:
        """Bytes written in the last ``hours`` hours, counted in whole hours: the oldest bucket is in, so a budget
        errs long (up to an hour more), never short (found in review: a write 23 h old had left the day's count)."""
        now = int(self._clock() // WEAR_BUCKET_S)
        return sum(n for h, n in self._hours.items() if h >= now - hours)

    def last_day(self) -> int:
        return self._since(24)

    def last_week(self) -> int:
        return self._since(7 * 24)


class MissReason(StrEnum):
    NO_ENTRY = "no_entry"
    IDENTITY_MISMATCH = "identity_mismatch"
    CODEC_MISMATCH = "codec_mismatch"  # the model's entries were written by another codec provider
    UNTRIMMABLE = "untrimmable"
    EVICTED = "evicted"
    CORRUPT = "corrupt"
    IO_TIMEOUT = "io_timeout"  # the read did not return within the store's I/O deadline (a hung disk)


@dataclass(eq=False)
class Entry:
    path: str
    fingerprint: str
    namespace: str
    tokens: np.ndarray
    nbytes: int
    trimmable: bool
    min_reusable: int
    last_used: float
    checkpoint: fmt.GenerationCheckpoint | None = None
    codec_provider: str = ""
    blocks: list[bytes] = field(default_factory=list)  # v2: the prefix blocks it names, in order
    block_size: int = 0
    whole: bool = False  # every cache positional: its blocks alone restore a prefix (attachments aside)
    attachments: bool = False  # it carries attachments (a draft model's KV, ...): an entry without them serves less
    restorable: int | None = None  # tokens its caches hold (``Header.restorable_tokens``), when fewer than its tokens
    # Ours to unlink: written by this store, or found by a scan made alone. Another writer's (found by a Spiller
    # that shares the folder's lock) leaves this index when evicted or superseded, and its file stays: it is not ours.
    owned: bool = True

    @property
    def ntokens(self) -> int:
        return len(self.tokens)

    @property
    def held(self) -> int:
        """The most tokens a restore of it can serve: the rows its caches hold, or all it records."""
        return self.ntokens if self.restorable is None else self.restorable


@dataclass(eq=False)
class Block:
    """A prefix block on disk, and the manifests that name it (it goes when none does)."""

    key: bytes
    path: str
    nbytes: int
    refs: set[str] = field(default_factory=set)  # paths of the manifests that name it
    pins: int = 0  # puts that will name it once their manifest is published
    namespace: str = ""  # of the manifests that name it (keys include the namespace: one per block)
    # a manifest has named it (only then was it announced as stored: StoreListener.stored, or .adopted)
    named: bool = False
    # Ours to reuse and unlink: written by this store, or found by a scan made alone. A block file another writer
    # of the folder put there may be named by entries this store never saw: it is never unlinked here, and a put
    # writes a copy of its own rather than name it.
    owned: bool = True
    # Its name is durable in its folder: False from its publish until the folder's sync that follows. A put that
    # names it syncs the folder itself first, whatever put wrote it (the manifest must never outlive its blocks).
    synced: bool = True


@dataclass
class Hit:
    entry: Entry
    matched: int  # tokens usable from this entry (the entry is cut back to this on load)
    blocks_only: bool = False  # restore ``matched`` tokens from the entry's blocks alone (another conversation's)

    @property
    def trimmed(self) -> bool:
        return self.matched < self.entry.ntokens


@dataclass
class Miss:
    reason: MissReason


class StoreListener(Protocol):
    def stored(self, entry: Entry, written: list[Block], root: bytes) -> None:
        """``entry`` (a manifest) was stored and indexed; ``written``: the blocks its put wrote; ``root``: the
        root key of its chain. Called on the store's loop; must not block."""

    def adopted(self, entry: Entry, fetched: list[Block]) -> None:
        """``entry`` (a manifest) was kept from another tier (``Store.adopt``: a fill) and indexed; ``fetched``: the
        blocks it wrote. Called on the store's loop; must not block."""

    def reclaimed(self, block: Block) -> None:
        """``block`` left the store (no manifest names it any more). Called on the store's loop; must not block."""

    def evicted(self, entry: Entry, named: list[Block]) -> None:
        """``entry`` was evicted (the disk cap or a namespace quota): out of the index, its file (and those of its
        blocks no other entry names) about to be unlinked; ``named``: the blocks it names. A listener that wants
        their bytes calls ``Store.keep_file`` now and ``release_file`` once it has read them. Called on the
        store's loop; must not block."""


@dataclass
class StoreCounters:
    hits: int = 0
    misses: dict[str, int] = field(default_factory=lambda: {r.value: 0 for r in MissReason})
    stored: int = 0
    superseded: int = 0
    evicted: int = 0
    quarantined: int = 0
    quarantine_removed: int = 0  # quarantined files removed to keep the quarantine within its caps
    reaped_temp: int = 0
    bytes_written: int = 0  # file bytes published: manifests, blocks and v1 files
    blocks_written: int = 0
    blocks_reused: int = 0  # blocks a spill named without writing them (already on disk)
    blocks_fetched: int = 0  # blocks kept from another tier (the remote one)
    adopted: int = 0  # manifests kept from another tier
    blocks_reclaimed: int = 0  # blocks removed because no manifest named them any more
    dropped_budget: int = 0  # droppable spills shed because the write budget was spent
    dropped_admit: int = 0  # droppable spills shed by the write gate (their prefix not asked for often enough)
    unique_added: int = 0  # cache bytes of tokens the store did not hold before (what written bytes are against)
    quota_evicted: int = 0  # entries evicted to keep their namespace within its quota
    store_errors: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # failed puts by error code (disk_full, io_error, ...)
