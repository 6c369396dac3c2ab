"""The saver's steps: a plan of the file (no bytes materialized; hashes placeholders of fixed width), then one
``TensorStep`` per tensor and a last ``PublishStep``, yielded by ``save_steps`` so that a driver decides when each
write happens."""

from __future__ import annotations

import os
import time
from collections.abc import Generator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .. import directio, errors
from .. import format as fmt
from ..codecs import CodecProvider, default_provider
from ..fileio import DEFAULT_OPS, Durability, FileOps
from ..lease import RunStep
from ..validate import validate_header
from .capture import Attachment, token_list
from .partfile import PartFile
from .tensorbytes import LIVE_CHUNK_BYTES, AnySource, BytesSource, Staging, TensorBytes, array_sources

if TYPE_CHECKING:
    from ..codecs.live import LiveCapture


@dataclass
class SaveResult:
    path: str
    header: fmt.Header
    file_bytes: int


class TensorStep:
    """Write one tensor. ``materialize`` inside the lease, then ``write`` anywhere."""

    def __init__(
        self, index: int, slot: fmt.Slot, source: AnySource, file: PartFile, data_start: int, staging: Staging | None
    ) -> None:
        self.index = index
        self.slot = slot
        self.nbytes = slot.nbytes
        self.bytes = TensorBytes(index, slot, source, staging)
        self._file = file
        self._data_start = data_start
        self.done = False

    @property
    def materialized(self) -> bool:
        return self.bytes.ready

    def materialize(self) -> None:
        """Take the source's bytes (the only part that touches the engine's arrays)."""
        while not self.materialize_part(None):
            pass

    def materialize_part(self, limit: int | None) -> bool:
        """At most ``limit`` bytes of engine-touching work; True once the tensor can be written."""
        return self.bytes.take(limit)

    async def take_in_lease(self, lease: RunStep, chunk: int = LIVE_CHUNK_BYTES) -> None:
        """``materialize`` through ``lease``, ``chunk`` bytes per hold, letting the engine run between holds."""
        await self.bytes.take_in_lease(lease, chunk, self.materialize_part)

    def write(self) -> None:
        """Hash and write the bytes at their planned offset; touches no mlx state."""
        if not self.bytes.ready or self.bytes.released:
            raise errors.SaveAborted(f"tensor {self.index} written before it was materialized")
        try:
            self.slot.hash = self.bytes.digest()
            self._file.write(self.bytes.runs, self._data_start + self.slot.off)
        finally:
            self.bytes.release()
        self.done = True

    def release(self) -> None:
        self.bytes.release()


class PublishStep:
    """Write the header with the real hashes, fsync, rename, fsync the folder."""

    nbytes = 0

    def __init__(self, header: fmt.Header, planned_len: int, file: PartFile) -> None:
        self.index = -1
        self._header = header
        self._planned_len = planned_len
        self._file = file
        self.done = False

    def materialize(self) -> None:
        """Nothing of the engine's is touched here."""

    def write(self) -> None:
        hb = fmt.pack_header(self._header)
        if len(hb) != self._planned_len:
            raise errors.PlanDrift(f"header length drift: planned {self._planned_len}, got {len(hb)}")
        head, _ = fmt.encode_prefix(hb, self._header.version, self._header.align)
        self._file.publish(head)
        self.done = True


SaveStep = TensorStep | PublishStep


_RELEASED = BytesSource([], (0,))  # what a step's slot holds once the step owns its source


@dataclass
class Encoded:
    """What ``encode_now`` read at the snapshot point: the caches' entries and the sources to write.

    A live snapshot's entries are planned later, by whoever calls ``resolved`` (the writer): at the call the
    engine's thread only records each cache's offset and evaluates its buffers (``LiveCapture``).
    """

    provider: CodecProvider
    entries: list[fmt.CacheEntry]
    attachments: list[fmt.AttachmentEntry]
    sources: list[AnySource]
    capture: LiveCapture | None = None

    def resolved(self) -> Encoded:
        """This, with a live capture's entries planned (cache sources first, then the attachments')."""
        if self.capture is None:
            return self
        parts = self.capture.encode()
        srcs: list[AnySource] = [a for p in parts for a in p.sources]
        return Encoded(self.provider, [p.entry for p in parts], self.attachments, srcs + self.sources)


def encode_now(
    caches: Sequence[Any],
    *,
    attachments: Sequence[Attachment] = (),
    provider: CodecProvider | None = None,
    live: bool = False,
) -> Encoded:
    """The part of a plan that reads the caches: run it on the engine's thread at the snapshot point.

    With ``live`` the caches are ones the engine keeps extending; append-only buffers are then read inside the
    lease at write time (see ``LiveSource``). The rest of the plan (``finish_plan``) touches only what this
    returns, so it may run later, on another thread.
    """
    import mlx.core as mx

    from ..codecs.base import rows, slot_for

    p = provider or default_provider()
    capture = None
    sources: list[AnySource] = []
    entries = []
    if live:
        from ..codecs.live import LiveCapture

        capture = LiveCapture(p, caches)
    else:
        encoded = [p.encode(c) for c in caches]
        entries = [e.entry for e in encoded]
        sources = [a for e in encoded for a in e.sources]
    att_entries = []
    for a in attachments:
        srcs = [rows(t) for t in a.tensors]
        att_entries.append(fmt.AttachmentEntry(a.schema, dict(a.metadata), [slot_for(s) for s in srcs]))
        sources.extend(srcs)
    # The engine's pending work, if any, runs here on the caller's thread (a no-op for
    # evaluated caches and clones): no other thread can evaluate it, and the steps then
    # only read finished buffers. One call for all of them.
    mx.eval(array_sources(sources), capture.arrays if capture else [])
    return Encoded(p, entries, att_entries, sources, capture)


def finish_plan(
    enc: Encoded,
    tokens: Any,
    *,
    meta: dict[str, str] | None = None,
    identity: fmt.Identity | None = None,
    checkpoint: fmt.GenerationCheckpoint | None = None,
) -> tuple[fmt.Header, list[AnySource]]:
    """Build the header (placeholder hashes, final offsets) from what ``encode_now`` read; pure bookkeeping."""
    enc = enc.resolved()
    header = fmt.Header(
        version=fmt.FORMAT_VERSION,
        created_at_ms=time.time_ns() // 1_000_000,
        codec_provider=enc.provider.id,
        identity=identity or fmt.Identity(),
        tokens=token_list(tokens),
        caches=enc.entries,
        attachments=enc.attachments,
        checkpoint=checkpoint,
        meta={str(k): str(v) for k, v in (meta or {}).items()},
    )
    if checkpoint is not None and checkpoint.original_prompt_tokens + checkpoint.generated_tokens != len(header.tokens):
        raise errors.CheckpointInconsistent("checkpoint prompt + generated tokens must equal the saved tokens")
    # Never publish a file our own reader would refuse: the readers' own validator, before any byte.
    validate_header(header)
    fmt.plan_layout(header)
    return header, enc.sources


def plan(
    tokens: Any,
    caches: Sequence[Any],
    *,
    meta: dict[str, str] | None = None,
    identity: fmt.Identity | None = None,
    attachments: Sequence[Attachment] = (),
    checkpoint: fmt.GenerationCheckpoint | None = None,
    provider: CodecProvider | None = None,
    live: bool = False,
) -> tuple[fmt.Header, list[AnySource]]:
    """Build the header (placeholder hashes, final offsets) and the list of sources: ``encode_now`` then
    ``finish_plan``. With ``live``, call it on the engine's thread at the snapshot point."""
    enc = encode_now(caches, attachments=attachments, provider=provider, live=live)
    return finish_plan(enc, tokens, meta=meta, identity=identity, checkpoint=checkpoint)


def save_steps(
    path: str | os.PathLike[str],
    tokens: Any,
    caches: Sequence[Any],
    meta: dict[str, str] | None = None,
    *,
    identity: fmt.Identity | None = None,
    attachments: Sequence[Attachment] = (),
    checkpoint: fmt.GenerationCheckpoint | None = None,
    durability: Durability | str = Durability.FSYNC,
    provider: CodecProvider | None = None,
    ops: FileOps = DEFAULT_OPS,
    planned: tuple[fmt.Header, list[AnySource]] | None = None,
    staging: Staging | None = None,
    direct: bool | None = None,
    sync_folder: bool = True,
) -> Generator[SaveStep, None, SaveResult]:
    """Yield N tensor steps and one publish step; return the ``SaveResult``.

    The driver must run ``materialize()`` then ``write()`` on each step before
    asking for the next one. ``planned`` is a ``plan(...)`` made earlier (then
    ``tokens``, ``caches`` and the header arguments are ignored). ``direct``
    writes with O_DIRECT through aligned buffers (default: for files of 8 MiB
    or more, where the filesystem supports it). ``sync_folder=False`` leaves the
    folder's sync (what makes the new name durable) to the caller, who syncs it
    once for several files (a manifest's blocks).
    """
    dest = os.fspath(path)
    header, sources = planned or plan(
        tokens, caches, meta=meta, identity=identity, attachments=attachments, checkpoint=checkpoint, provider=provider
    )
    sources = list(sources)
    head_bytes = fmt.pack_header(header)
    header_len = len(head_bytes)
    _, data_start = fmt.encode_prefix(head_bytes, header.version, header.align)
    slots = header.slots()
    # the layout rule itself: a trailing empty tensor does not extend the file
    data_end = fmt.plan_offsets(slots, header.align)
    if direct is None:
        direct = data_end >= directio.DIRECT_MIN_BYTES
    direct = direct and header.align % directio.BLOCK == 0  # a packed file's tensors are not block-aligned
    file = PartFile(dest, data_start + data_end, Durability(durability), ops, direct, sync_folder)
    step: SaveStep | None = None
    done = False
    try:
        for i, slot in enumerate(slots):
            step = TensorStep(i, slot, sources[i], file, data_start, staging)
            sources[i] = _RELEASED  # the step owns it now
            yield step
            if not step.done:
                raise errors.SaveAborted(f"tensor step {i} was not run to completion", path=dest)
        step = PublishStep(header, header_len, file)
        yield step
        if not step.done:
            raise errors.SaveAborted("publish step was not run", path=dest)
        header.header_len, header.data_start, header.file_size = header_len, data_start, data_start + data_end
        done = True
        return SaveResult(dest, header, data_start + data_end)
    finally:
        if isinstance(step, TensorStep):
            step.release()
        sources.clear()
        # closed before its result was taken (a publish past its deadline that landed late): nothing stays
        file.abort(abandoned=not done)
