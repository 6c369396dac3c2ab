"""Running a save's steps: all at once on one thread (``save``, ``drive``), or one step per event-loop turn inside
the caller's execution lease (``save_async``), engine-free steps batched off the loop; ``take_all`` takes an
engine's arrays up front, one lease call each, so that a whole save's writes can be batched."""

from __future__ import annotations

import asyncio
import functools
import inspect
import logging
import os
import time
from collections.abc import Callable, Generator, Sequence
from typing import Any, cast

from .. import errors, mlxthreads
from .. import format as fmt
from ..lease import Begun, NoLease, RunStep, off_loop, outlast, within
from .steps import PublishStep, SaveResult, SaveStep, TensorStep, save_steps
from .tensorbytes import LIVE_CHUNK_BYTES, AnySource, BytesSource, byte_runs

log = logging.getLogger("spilld.saver")


def waits_for_grant(lease: RunStep) -> bool:
    """Whether ``lease`` may wait for an engine's grant before it runs a step (a lease that keeps no engine out,
    such as the daemon's own, says False)."""
    return bool(getattr(lease, "waits_for_grant", True))


def _marking(begun: Begun, fn: Callable[[], None]) -> Callable[[], None]:
    """``fn``, which marks ``begun`` as it starts: a write's deadline counts from there."""

    @functools.wraps(fn)
    def run() -> None:
        begun.mark()
        fn()

    return run


# Steps that need nothing of an engine's (received bytes, the publish) run on one thread in batches of about this
# many bytes when the caller allows it (``save_async(batch_bytes=...)``): a loop turn and a thread hop per
# 100 KiB tensor cost more than its write.
WRITE_BATCH_BYTES = 8 * 1024 * 1024


def _engine_free(step: SaveStep) -> bool:
    return isinstance(step, PublishStep) or step.bytes.engine_free


class _Batch:
    """Run ``first`` (None: the generator's next step, its plan made on this thread) and the engine-free steps
    after it on the calling thread, up to ``limit`` bytes; then ``next`` is the step to run next (None when the
    save ended: ``result``). ``begun`` is marked at each step's start, so a deadline bounds each step, not the
    batch."""

    def __init__(
        self,
        gen: Generator[SaveStep, None, SaveResult],
        first: SaveStep | None,
        limit: int,
        begun: Begun,
        deadline: float | None = None,
    ) -> None:
        self._gen, self._limit, self._begun, self._deadline = gen, limit, begun, deadline
        self.next: SaveStep | None = first
        self.result: SaveResult | None = None
        self.stopped = False  # set by the driver past a deadline: no step begins after the late one returns

    def _late(self) -> bool:
        """The step just run returned past its deadline: the driver has given up on the save, or is about to (the
        thread decides it itself: the loop may not have woken yet to set ``stopped``)."""
        start = self._begun.at
        late = self._deadline is not None and start is not None and time.monotonic() - start > self._deadline
        return self.stopped or late

    def _advance(self) -> bool:
        try:
            self.next = next(self._gen)
            return True
        except StopIteration as stop:  # caught here: a StopIteration cannot cross a future
            self.next, self.result = None, cast(SaveResult, stop.value)
            return False

    def run(self) -> None:
        done = 0
        if self.next is None:
            self._begun.mark()
            if not self._advance():
                return
        while (step := self.next) is not None and not self.stopped:
            self._begun.mark()
            step.materialize()
            step.write()
            done += step.nbytes
            if self._late():  # the save fails: its generator closed unfinished takes back what it wrote
                self._gen.close()
                raise errors.StorageTimeout(f"a write step returned past its deadline ({self._deadline} s)")
            if not self._advance() or (nxt := self.next) is None or not _engine_free(nxt):
                return
            if done >= self._limit and not isinstance(nxt, PublishStep):  # a file's publish goes with its last bytes
                return


async def take_all(sources: Sequence[AnySource], lease: RunStep) -> list[AnySource]:
    """Each array source's bytes taken as zero-copy runs (a ``BytesSource`` of them), one lease call per array: the
    engine-touching part of a save done up front, so that its writes can run in batches off the lease. A block put
    at B = 64 otherwise makes a step, a lease call and a thread hop of each block's every tensor (1,024 for 128 MiB,
    against 32 here). Live sources (rows the engine keeps extending) and plain bytes are left as they are."""
    from ..codecs.base import Source

    out: list[AnySource] = []
    for s in sources:
        if isinstance(s, Source):
            runs, _ = await lease(functools.partial(byte_runs, s))  # the views keep the array alive
            out.append(BytesSource(list(runs), tuple(s.shape)))
        else:
            out.append(s)
    return out


def _all_bytes(planned: tuple[fmt.Header, list[AnySource]] | None) -> bool:
    """A plan whose sources are all plain bytes: every step of its save is engine-free."""
    return planned is not None and all(isinstance(s, BytesSource) for s in planned[1])


def _close_later(loop: asyncio.AbstractEventLoop, gen: Generator[Any, None, Any]) -> None:
    """Close a save's generator (its file closed, its temp removed) on a worker thread: its late step returned."""
    loop.run_in_executor(None, mlxthreads.releasing(gen.close))


def run_step_sync(step: SaveStep) -> None:
    step.materialize()
    step.write()


def drive(gen: Generator[SaveStep, None, SaveResult], each: Callable[[SaveStep], None] = run_step_sync) -> SaveResult:
    """Run a step generator to the end on this thread."""
    try:
        while True:
            each(next(gen))
    except StopIteration as stop:
        return cast(SaveResult, stop.value)
    finally:
        gen.close()


def save(
    path: str | os.PathLike[str],
    tokens: Any,
    caches: Sequence[Any],
    meta: dict[str, str] | None = None,
    **kwargs: Any,
) -> SaveResult:
    """Save caches to ``path`` now, atomically and (by default) durably."""
    return drive(save_steps(path, tokens, caches, meta, **kwargs))


async def save_async(
    path: str | os.PathLike[str],
    tokens: Any,
    caches: Sequence[Any],
    meta: dict[str, str] | None = None,
    *,
    run_step: RunStep | None = None,
    write_in_lease: bool = False,
    live_chunk: int = LIVE_CHUNK_BYTES,
    step_deadline: float | None = None,
    batch_bytes: int = 0,
    **kwargs: Any,
) -> SaveResult:
    """Save one step per event-loop turn without blocking the loop.

    ``run_step(fn)`` is the caller's execution lease: it runs ``fn`` while the
    engine is between steps and returns its result. Each tensor's
    ``materialize`` runs through it; its hash and write run on a worker thread,
    inside the lease too when ``write_in_lease`` is set. A lease that raises
    aborts the save and leaves nothing behind. A write step that does not return within ``step_deadline``
    seconds fails the save (``StorageTimeout``) at once; its file is cleaned up once the step returns.
    ``batch_bytes`` > 0 runs steps that touch nothing of an engine's (bytes the daemon received, and the publish)
    in batches of about that many bytes per lease call: only for a lease that keeps no engine waiting.
    """
    lease: RunStep = run_step or NoLease()
    gen = save_steps(path, tokens, caches, meta, **kwargs)
    late = False
    loop = asyncio.get_running_loop()
    pending: SaveStep | None = None
    # all plain bytes: even the plan (packing the header) is made on the batch's thread, not on the loop
    free = batch_bytes > 0 and _all_bytes(kwargs.get("planned"))
    try:
        while True:
            begun = Begun()
            if free:
                batch: _Batch | None = _Batch(gen, pending, batch_bytes, begun, step_deadline)
            else:
                try:
                    step = pending or next(gen)
                except StopIteration as stop:
                    return cast(SaveResult, stop.value)
                batch = (
                    _Batch(gen, step, batch_bytes, begun, step_deadline)
                    if batch_bytes > 0 and _engine_free(step)
                    else None
                )
            if batch is not None:
                fn = batch.run  # advances the generator on its thread
            else:
                if isinstance(step, TensorStep) and not step.bytes.engine_free:
                    await step.take_in_lease(lease, live_chunk)  # the engine gets its turn between two copies
                else:
                    step.materialize()  # bytes already ours (the daemon's): nothing of an engine's to keep out
                fn = _marking(begun, step.write)
            work = asyncio.ensure_future(lease(fn) if write_in_lease else off_loop(fn, background=True))
            # only a grant's wait is the lease's to bound; a wait for a thread counts (found in review: hung writes
            # held every thread, and the next step, never begun, waited a whole deadline more, for ever)
            if not (write_in_lease and waits_for_grant(lease)):
                begun.mark()
            try:
                # the cleanup (closing the file, removing the temp) waits for the late step, off the loop
                await within(work, step_deadline, "a write step", lambda: _close_later(loop, gen), begun)
            except errors.StorageTimeout:
                late = True
                if batch is not None:
                    batch.stopped = True
                if work.done():  # the step failed so itself (a lease that no thread began it for): nothing runs it
                    _close_later(loop, gen)
                raise
            if batch is not None and batch.result is not None:
                return batch.result
            pending = batch.next if batch is not None else None
            await asyncio.sleep(0)  # one step (or one batch) per loop turn
    finally:
        if not late and inspect.getgeneratorstate(gen) != inspect.GEN_CLOSED:
            await _close_off_loop(loop, gen)


async def _close_off_loop(loop: asyncio.AbstractEventLoop, gen: Generator[Any, None, Any]) -> None:
    """Close a save's generator (its file closed, its temp removed) on a worker thread and wait for it: an O_DIRECT
    writer's close joins a thread that a hung disk may hold (found in review: the loop stood still). A failed
    cleanup is logged, never raised over the save's own error."""
    try:
        fut = loop.run_in_executor(None, mlxthreads.releasing(gen.close))
    except RuntimeError:  # no thread may start now (the interpreter is exiting): here, as a last resort
        gen.close()
        return
    await outlast(fut)
    if not fut.cancelled() and (exc := fut.exception()) is not None:
        log.warning("a save's cleanup failed (its temp file may be left for the next scan): %s", exc)
