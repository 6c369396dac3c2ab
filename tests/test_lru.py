"""``lru.LRU``: the bound the loader's block-header and layout caches keep."""

from __future__ import annotations

from spilld.lru import LRU


def test_past_its_limit_it_forgets_the_least_recently_used() -> None:
    c: LRU[str, int] = LRU(2)
    c.put("a", 1)
    c.put("b", 2)
    assert c.get("a") == 1  # "a" used: "b" is now the oldest
    c.put("c", 3)
    assert len(c) == 2 and c.get("b") is None and c.get("a") == 1 and c.get("c") == 3
    c.put("a", 4)  # put again: the value replaced, and used
    c.put("d", 5)
    assert c.get("c") is None and c.get("a") == 4
    c.clear()
    assert len(c) == 0 and c.get("a") is None
