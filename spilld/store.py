"""The cold tier on disk. Files are the database.

Layout: ``<root>/<identity fingerprint>/<namespace hash>/<id>.spilld``, temp
files beside them. Folder names are hex digests we compute, never caller
strings, so no namespace or key can name a path outside the root. A scan at
start-up rebuilds the index from the headers of every fingerprint under the
root and reaps temp orphans. Lookups match the caller's fingerprint.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import shutil
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

import msgpack
import numpy as np
import xxhash

from . import errors, fileio
from . import format as fmt
from .codecs import CodecProvider, default_provider
from .lease import RunStep
from .loader import Loaded, load, read_header
from .queue import unpin
from .saver import AnySource, Attachment, SaveResult, Staging, save_async

log = logging.getLogger("spilld.store")

EXT = ".spilld"
QUARANTINE = ".quarantine"
QUARANTINE_KEEP = 32  # newest quarantined files kept for inspection
EVICTED_MEMORY = 256  # evicted entries remembered per namespace, to explain misses
DEFAULT_DISK_CAP = 64 * 1024**3
CHECKPOINT_NS_PREFIX = "\0checkpoint:"


def identity_fingerprint(ident: fmt.Identity) -> str:
    """The folder of one model: its config fingerprint, tokenizer and model id, hashed."""
    blob = msgpack.packb([ident.model_id, ident.config_fingerprint, ident.tokenizer_hash])
    return xxhash.xxh3_64_hexdigest(blob)


def namespace_hash(namespace: str) -> str:
    return xxhash.xxh3_64_hexdigest(namespace.encode()) if namespace else "base"


def checkpoint_namespace(key: str) -> str:
    return CHECKPOINT_NS_PREFIX + key


def check_namespace(namespace: str) -> str:
    """Caller namespaces may not pose as checkpoint namespaces."""
    if namespace.startswith(CHECKPOINT_NS_PREFIX):
        raise ValueError("namespaces starting with the checkpoint prefix are reserved")
    return namespace


def default_disk_cap(root: str) -> int:
    """The smaller of 64 GiB and a quarter of the free space at start."""
    os.makedirs(root, exist_ok=True)
    return min(DEFAULT_DISK_CAP, shutil.disk_usage(root).free // 4)


class MissReason(StrEnum):
    NO_ENTRY = "no_entry"
    IDENTITY_MISMATCH = "identity_mismatch"
    UNTRIMMABLE = "untrimmable"
    EVICTED = "evicted"
    CORRUPT = "corrupt"


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

    @property
    def ntokens(self) -> int:
        return len(self.tokens)


@dataclass
class Hit:
    entry: Entry
    matched: int  # tokens usable from this entry (the entry is cut back to this on load)

    @property
    def trimmed(self) -> bool:
        return self.matched < self.entry.ntokens


@dataclass
class Miss:
    reason: MissReason


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if len(diff) else n


@dataclass
class StoreCounters:
    hits: int = 0
    misses: dict[str, int] = field(default_factory=lambda: {r.value: 0 for r in MissReason})
    stored: int = 0
    superseded: int = 0
    evicted: int = 0
    quarantined: int = 0
    reaped_temp: int = 0
    store_errors: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # failed puts by error code (disk_full, io_error, ...)


class Store:
    """Index, lookup, supersede, LRU eviction and quarantine over one root folder."""

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        disk_cap: int | None = None,
        durability: fileio.Durability | str = fileio.Durability.FSYNC,
        provider: CodecProvider | None = None,
        verify: bool = True,
        ops: fileio.FileOps = fileio.DEFAULT_OPS,
    ) -> None:
        self.root = os.path.abspath(os.fspath(root))
        os.makedirs(self.root, exist_ok=True)
        self.disk_cap = default_disk_cap(self.root) if disk_cap is None else disk_cap
        self.durability = fileio.Durability(durability)
        self.provider = provider or default_provider()
        self.verify = verify
        self.ops = ops  # the file layer of every save and removal (tests swap in one that injects faults)
        self.entries: list[Entry] = []
        self.counters = StoreCounters()
        self._evicted: dict[tuple[str, str], deque[np.ndarray]] = {}

    # --- paths ---------------------------------------------------------------------

    def folder(self, ident: fmt.Identity, namespace: str) -> str:
        return os.path.join(self.root, identity_fingerprint(ident), namespace_hash(namespace))

    def new_path(self, ident: fmt.Identity, namespace: str) -> str:
        folder = self.folder(ident, namespace)
        os.makedirs(folder, exist_ok=True)
        return os.path.join(folder, secrets.token_hex(12) + EXT)

    @property
    def total_bytes(self) -> int:
        return sum(e.nbytes for e in self.entries)

    # --- scan ----------------------------------------------------------------------

    def scan(self) -> int:
        """Rebuild the index from the files under the root; reap temp orphans; quarantine bad files."""
        self.entries = []
        for fp in sorted(os.listdir(self.root)):
            fp_dir = os.path.join(self.root, fp)
            if fp.startswith(".") or not os.path.isdir(fp_dir):
                continue
            for ns in sorted(os.listdir(fp_dir)):
                ns_dir = os.path.join(fp_dir, ns)
                if not os.path.isdir(ns_dir):
                    continue
                for name in os.listdir(ns_dir):
                    self._scan_file(os.path.join(ns_dir, name), fp, ns)
        log.info(
            "%s: %d entries, %d bytes, cap %d bytes", self.root, len(self.entries), self.total_bytes, self.disk_cap
        )
        self.evict_to_cap()
        return len(self.entries)

    def _scan_file(self, path: str, fp: str, ns_dir: str) -> None:
        name = os.path.basename(path)
        if fileio.is_temp_name(name):
            fileio.remove_quietly(self.ops, path)
            self.counters.reaped_temp += 1
            return
        if not name.endswith(EXT):
            return
        try:
            header = read_header(path)
            if identity_fingerprint(header.identity) != fp or namespace_hash(header.identity.namespace) != ns_dir:
                raise errors.HeaderMalformed("file sits in the folder of another identity or namespace", path=path)
        except errors.FileFormatError as exc:
            self.quarantine(path, exc)
            return
        except errors.SpillError as exc:  # unreadable now (EMFILE, EACCES, EIO...): left alone, not indexed
            log.warning("skipped %s: %s", path, exc)
            return
        self._index(path, header, os.stat(path).st_mtime)

    def _index(self, path: str, header: fmt.Header, last_used: float) -> Entry:
        e = Entry(
            path=path,
            fingerprint=identity_fingerprint(header.identity),
            namespace=header.identity.namespace,
            tokens=np.asarray(header.tokens, dtype=np.uint32),
            nbytes=header.file_size,
            trimmable=header.trimmable,
            min_reusable=header.min_reusable_offset,
            last_used=last_used,
            checkpoint=header.checkpoint,
            codec_provider=header.codec_provider,
        )
        self.entries.append(e)
        return e

    # --- lookup ------------------------------------------------------------------------

    def lookup(
        self, ident: fmt.Identity, namespace: str, tokens: Sequence[int], *, codec_provider: str | None = None
    ) -> Hit | Miss:
        """The longest usable prefix of ``tokens`` (at most len - 1: one token must be computed).

        Only entries written by ``codec_provider`` (default: this store's) can be used.
        """
        provider_id = codec_provider or self.provider.id
        want = np.asarray(tokens, dtype=np.uint32)
        limit = len(want) - 1
        fp = identity_fingerprint(ident)
        best: Hit | None = None
        saw_untrimmable = saw_foreign = False
        for e in self.entries:
            if e.namespace != namespace:
                continue
            usable = min(_common_prefix(e.tokens, want), limit)
            if usable <= 0:
                continue
            if e.fingerprint != fp or e.codec_provider != provider_id:
                saw_foreign = True
                continue
            if usable < e.ntokens and (not e.trimmable or usable < e.min_reusable):
                saw_untrimmable = True
                continue
            if best is None or usable > best.matched or (usable == best.matched and e.last_used > best.entry.last_used):
                best = Hit(e, usable)
        if best is not None:
            return best
        if saw_untrimmable:
            return self._miss(MissReason.UNTRIMMABLE)
        if saw_foreign:
            return self._miss(MissReason.IDENTITY_MISMATCH)
        if self._was_evicted(fp, namespace, want):
            return self._miss(MissReason.EVICTED)
        return self._miss(MissReason.NO_ENTRY)

    def _miss(self, reason: MissReason) -> Miss:
        self.counters.misses[reason.value] += 1
        return Miss(reason)

    def _was_evicted(self, fp: str, namespace: str, want: np.ndarray) -> bool:
        """Would an entry we evicted have served this prompt? (explains the miss)"""
        return any(_common_prefix(t, want) > 0 for t in self._evicted.get((fp, namespace), ()))

    def restore(self, hit: Hit, ident: fmt.Identity) -> Loaded | Miss:
        """Load a hit, cut back to its matched length; a file that fails is quarantined (a miss)."""
        try:
            loaded = self.read_hit(hit, ident)
        except errors.SpillError as exc:
            return self.restore_done(hit, exc)
        return self.restore_done(hit, loaded)

    def read_hit(self, hit: Hit, ident: fmt.Identity) -> Loaded:
        """The file read alone: touches no index state, so it may run on a worker thread."""
        e = hit.entry
        return load(e.path, expect=ident, verify=self.verify, upto=hit.matched, provider=self.provider)

    def restore_done(self, hit: Hit, outcome: Loaded | errors.SpillError) -> Loaded | Miss:
        """Account for a read (on the index's own thread): a hit, or a miss with its reason."""
        e = hit.entry
        if isinstance(outcome, Loaded):
            self.touch(e)
            self.counters.hits += 1
            return outcome
        if isinstance(outcome, errors.FileFormatError):
            self.quarantine(e.path, outcome)
            return self._miss(MissReason.CORRUPT)
        if isinstance(outcome, errors.StorageError):
            if not os.path.exists(e.path):
                self._remember_evicted(e)  # evicted between lookup and open
                self._forget(e)
                return self._miss(MissReason.EVICTED)
            log.warning("could not read %s: %s", e.path, outcome)  # EMFILE, EIO...: a miss; the file stays
            return self._miss(MissReason.CORRUPT)
        # A valid file this reader must not use (codecs, identity): a miss, never quarantined.
        return self._miss(MissReason.IDENTITY_MISMATCH)

    def entry_at(self, path: str) -> Entry | None:
        return next((e for e in self.entries if e.path == path), None)

    def touch(self, e: Entry) -> None:
        """A restore counts as use (kept across restarts through the file's mtime)."""
        e.last_used = time.time()
        try:
            os.utime(e.path, (e.last_used, e.last_used))
        except OSError:
            pass

    # --- store --------------------------------------------------------------------------

    async def put(
        self,
        tokens: Sequence[int],
        caches: Sequence[Any],
        ident: fmt.Identity,
        *,
        meta: dict[str, str] | None = None,
        attachments: Sequence[Attachment] = (),
        checkpoint: fmt.GenerationCheckpoint | None = None,
        run_step: RunStep | None = None,
        write_in_lease: bool = False,
        planned: tuple[fmt.Header, list[AnySource]] | None = None,
        staging: Staging | None = None,
    ) -> SaveResult:
        """Write an entry durably, then index it, supersede what it replaces and evict to the cap.

        ``planned`` is a snapshot planned earlier with ``saver.plan(..., live=True)``. Files are written
        through the store's file layer (``self.ops``).
        """
        if planned is not None:
            ident = planned[0].identity
        path = self.new_path(ident, ident.namespace)
        for attempt in (1, 2):
            try:
                result = await save_async(
                    path,
                    tokens,
                    caches,
                    meta,
                    identity=ident,
                    attachments=attachments,
                    checkpoint=checkpoint,
                    durability=self.durability,
                    provider=self.provider,
                    run_step=run_step,
                    write_in_lease=write_in_lease,
                    ops=self.ops,
                    planned=planned,
                    staging=staging,
                )
                break
            except errors.DiskFull as exc:
                needed = planned[0].data_bytes if planned is not None else 0
                if attempt == 2 or not self.make_room(needed):
                    self._count_error(exc)
                    raise
                unpin(exc)  # dropped here: its frames must not keep this attempt's bytes (or a cycle) alive
                log.warning("disk full: evicted old entries, retrying the write")
            except Exception as exc:
                self._count_error(exc)
                raise
        entry = self._index(path, result.header, time.time())
        self.counters.stored += 1
        self._supersede(entry, has_attachments=bool(result.header.attachments))
        self.evict_to_cap(keep=entry)
        return result

    def _count_error(self, exc: Exception) -> None:
        self.counters.store_errors += 1
        code = exc.code if isinstance(exc, errors.SpillError) else "error"
        self.counters.errors[code] = self.counters.errors.get(code, 0) + 1

    def _supersede(self, new: Entry, *, has_attachments: bool) -> None:
        for e in list(self.entries):
            if e is new or e.fingerprint != new.fingerprint or e.namespace != new.namespace:
                continue
            if e.codec_provider != new.codec_provider:
                continue  # another engine's codecs: its readers cannot use ours
            exact = e.ntokens == new.ntokens and _common_prefix(e.tokens, new.tokens) == new.ntokens
            ancestor = (
                e.ntokens < new.ntokens
                and new.trimmable
                and not has_attachments
                and e.checkpoint is None
                and new.min_reusable <= e.ntokens
                and _common_prefix(e.tokens, new.tokens) == e.ntokens
            )
            if exact or ancestor:
                self.counters.superseded += 1
                self._remove(e)

    def evict_to_cap(self, keep: Entry | None = None) -> int:
        """Remove least recently used entries until the whole root fits the disk cap."""
        n = 0
        for e in sorted(self.entries, key=lambda x: x.last_used):
            if self.total_bytes <= self.disk_cap:
                break
            if e is keep:
                continue
            self._remember_evicted(e)
            self._remove(e)
            self.counters.evicted += 1
            n += 1
        return n

    def make_room(self, nbytes: int) -> bool:
        """After ENOSPC: evict least recently used entries worth ``nbytes`` (at least one); False if none."""
        freed = 0
        gone = 0
        for e in sorted(self.entries, key=lambda x: x.last_used):
            if gone and freed >= nbytes:
                break
            self._remember_evicted(e)
            self._remove(e)
            self.counters.evicted += 1
            freed += e.nbytes
            gone += 1
        return gone > 0

    def _remember_evicted(self, e: Entry) -> None:
        self._evicted.setdefault((e.fingerprint, e.namespace), deque(maxlen=EVICTED_MEMORY)).append(e.tokens)

    def _forget(self, e: Entry) -> None:
        if e in self.entries:
            self.entries.remove(e)

    def _remove(self, e: Entry) -> None:
        self._forget(e)
        fileio.remove_quietly(self.ops, e.path)

    def remove_where(self, pred: Callable[[Entry], bool]) -> int:
        gone = [e for e in self.entries if pred(e)]
        for e in gone:
            self._remove(e)
        return len(gone)

    def evict_matching(self, fingerprint: str | None = None, older_than_s: float | None = None) -> tuple[int, int]:
        """Remove entries of one identity folder and/or unused for a while; clear emptied folders."""
        cutoff = time.time() - older_than_s if older_than_s is not None else None
        gone = [
            e for e in self.entries
            if (fingerprint is None or e.fingerprint == fingerprint) and (cutoff is None or e.last_used < cutoff)
        ]  # fmt: skip
        for e in gone:
            self._remember_evicted(e)
            self._remove(e)
        self.counters.evicted += len(gone)
        self.remove_empty_folders()
        return len(gone), sum(e.nbytes for e in gone)

    def remove_empty_folders(self) -> None:
        """Folders of models no longer in use go when their last entry does."""
        for fp in os.listdir(self.root):
            fp_dir = os.path.join(self.root, fp)
            if fp.startswith(".") or not os.path.isdir(fp_dir):
                continue
            for ns in os.listdir(fp_dir):
                with contextlib.suppress(OSError):
                    os.rmdir(os.path.join(fp_dir, ns))  # only succeeds when empty
            with contextlib.suppress(OSError):
                os.rmdir(fp_dir)

    # --- generation checkpoints -------------------------------------------------------

    def find_checkpoint(self, ident: fmt.Identity, key: str) -> Entry | None:
        ns = checkpoint_namespace(key)
        fp = identity_fingerprint(ident)
        found = [e for e in self.entries if e.namespace == ns and e.fingerprint == fp and e.checkpoint]
        return max(found, key=lambda e: (e.ntokens, e.last_used), default=None)

    def remove_checkpoints(self, key: str) -> int:
        ns = checkpoint_namespace(key)
        return self.remove_where(lambda e: e.namespace == ns)

    # --- quarantine ---------------------------------------------------------------------

    def quarantine(self, path: str, why: BaseException) -> None:
        """Move a bad file aside (never served again) and count it."""
        qdir = os.path.join(self.root, QUARANTINE)
        os.makedirs(qdir, exist_ok=True)
        dest = os.path.join(qdir, f"{int(time.time() * 1000)}-{os.path.basename(path)}")
        try:
            os.rename(path, dest)
        except OSError:
            fileio.remove_quietly(self.ops, path)
        for e in [e for e in self.entries if e.path == path]:
            self._forget(e)
        self.counters.quarantined += 1
        log.warning("quarantined %s: %s", path, why)
        kept = sorted(os.listdir(qdir))
        for old in kept[:-QUARANTINE_KEEP]:
            fileio.remove_quietly(self.ops, os.path.join(qdir, old))

    def stats(self) -> dict[str, Any]:
        c = self.counters
        return {
            "entries": len(self.entries),
            "bytes": self.total_bytes,
            "disk_cap": self.disk_cap,
            "hits": c.hits,
            "misses": dict(c.misses),
            "stored": c.stored,
            "superseded": c.superseded,
            "evicted": c.evicted,
            "quarantined": c.quarantined,
            "reaped_temp": c.reaped_temp,
            "store_errors": c.store_errors,
            "errors": dict(c.errors),
        }


def list_entries(root: str) -> list[dict[str, Any]]:
    """Every readable entry under ``root``, read-only (safe beside a running daemon)."""
    rows: list[dict[str, Any]] = []
    if not os.path.isdir(root):
        return rows
    for fp in sorted(os.listdir(root)):
        fp_dir = os.path.join(root, fp)
        if fp.startswith(".") or not os.path.isdir(fp_dir):
            continue
        for dirpath, _, names in os.walk(fp_dir):
            for name in names:
                if not name.endswith(EXT) or fileio.is_temp_name(name):
                    continue
                path = os.path.join(dirpath, name)
                try:
                    h = read_header(path)
                    st = os.stat(path)
                except (errors.SpillError, OSError):
                    continue
                rows.append({
                    "path": path, "fingerprint": fp, "model_id": h.identity.model_id, "namespace": h.identity.namespace,
                    "tokens": len(h.tokens), "bytes": st.st_size, "last_used": st.st_mtime, "trimmable": h.trimmable,
                    "checkpoint": h.checkpoint.key if h.checkpoint else None,
                })  # fmt: skip
    return sorted(rows, key=lambda r: r["last_used"], reverse=True)
