"""An example router for a fleet of hosts sharing a remote tier: it reads the hosts' "stored", "evicted" and
"reset" events and sends each prompt to the host that holds the longest run of its blocks (docs/design.md shows it)."""

from __future__ import annotations

from typing import Any

import redis

from .. import blocks
from .keys import events_key


class PrefixRouter:
    """Send each prompt to the host that holds the longest run of its blocks."""

    def __init__(self, r: redis.Redis, namespace: str, root: bytes, size: int = 64, key_tag: str | None = None) -> None:
        """``key_tag``: the hosts' key file's tag (``Sealer.tag``) when they encrypt: their events are in its space."""
        self.r, self.ns, self.root, self.size = r, namespace, root, size
        self.stream, self.last = events_key(namespace, key_tag), "0-0"
        self.holders: dict[str, set[str]] = {}  # block key (hex) -> hosts holding it

    def poll(self) -> None:
        got: Any = self.r.xread({self.stream: self.last}, count=1000, block=1)  # (bytes replies)
        for _, entries in got or []:
            for eid, f in entries:
                self.last = eid  # first: an entry it cannot read is passed, never read again
                try:
                    host, ks = f[b"host"].decode(), f[b"keys"].decode().split(",")
                except (KeyError, AttributeError, UnicodeDecodeError):
                    continue  # anyone who can write the stream can write anything to it
                if f.get(b"kind") == b"reset":  # the host holds only what its later events say (a start)
                    for held in self.holders.values():
                        held.discard(host)
                    continue
                for k in ks:
                    held = self.holders.setdefault(k, set())
                    (held.add if f.get(b"kind") == b"stored" else held.discard)(host)

    def route(self, tokens: list[int], hosts: list[str]) -> str:
        self.poll()
        best, best_n = hosts[hash(tuple(tokens[:16])) % len(hosts)], 0
        keys = blocks.chain(self.root, tokens, self.size, (len(tokens) - 1) // self.size)
        for h in hosts:
            n = next((i for i, k in enumerate(keys) if h not in self.holders.get(k.hex(), ())), len(keys))
            if n > best_n:
                best, best_n = h, n
        return best
