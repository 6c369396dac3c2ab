"""The order in which a store evicts its entries (pure: no index, no I/O)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping

from ..entries import Entry

Parts = Callable[[Entry], tuple[int, Mapping[bytes, int]]]  # an entry's own bytes on disk, and its blocks' by key


def evict_order(
    entries: Iterable[Entry],
    pinned: Collection[str],
    parts: Parts,
    pin_cap: int,
    among: Iterable[Entry] | None = None,
) -> list[Entry]:
    """Least recently used first, pinned entries last: the newest pins, as long as what they hold on disk fits
    ``pin_cap`` together (``parts``: an entry's own bytes, and its blocks' by key: a block two pins share counts
    once, found in review); older pins beyond it take their place among the others. ``among``: every entry whose
    pins share the cap, when ``entries`` are some of them (one namespace's: found in review, its pins were judged
    against the cap alone, and a pin beyond it outlived newer entries of its own tenant)."""
    order = sorted(entries, key=lambda x: x.last_used)
    kept = protected(order if among is None else among, pinned, parts, pin_cap)
    return [e for e in order if e.path not in kept] + [e for e in order if e.path in kept]


def protected(entries: Iterable[Entry], pinned: Collection[str], parts: Parts, pin_cap: int) -> set[str]:
    """The pins evicted last (their paths): the newest, as long as what they hold fits ``pin_cap`` together."""
    kept: set[str] = set()
    counted: set[bytes] = set()
    used = 0
    for e in sorted((e for e in entries if e.path in pinned), key=lambda x: x.last_used, reverse=True):
        own, named = parts(e)
        n = own + sum(b for k, b in named.items() if k not in counted)
        if used + n <= pin_cap:
            kept.add(e.path)
            counted.update(named)
            used += n
    return kept
