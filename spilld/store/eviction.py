"""The order in which a store evicts its entries (pure: no index, no I/O)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable

from ..entries import Entry


def evict_order(
    entries: Iterable[Entry], pinned: Collection[str], size: Callable[[Entry], int], pin_cap: int
) -> list[Entry]:
    """Least recently used first, pinned entries last: the newest pins, as long as their ``size`` (an entry's
    bytes on disk with its blocks) fits ``pin_cap`` together; older pins beyond it take their place among the
    others."""
    order = sorted(entries, key=lambda x: x.last_used)
    kept: set[str] = set()
    used = 0
    for e in reversed(order):
        if e.path in pinned and used + (n := size(e)) <= pin_cap:
            kept.add(e.path)
            used += n
    return [e for e in order if e.path not in kept] + [e for e in order if e.path in kept]
