"""Counters of the remote tier, as ``spilld status`` shows them."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class Reason(StrEnum):
    """Why the remote tier gave nothing: each one a counter of misses (or of failed pushes)."""

    DOWN = "down"  # disabled, breaker open, connection refused or lost
    TIMEOUT = "timeout"  # no answer within the bound
    ABSENT = "absent"  # no such key
    BAD_BYTES = "bad_bytes"  # fetched bytes the store's validator refused (reported by the store)
    DECRYPT = "decrypt"  # fetched bytes that do not decrypt under this host's key
    OOM = "oom"  # the server is at maxmemory and refuses writes (noeviction)
    REFUSED = "refused"  # the server refused the command (an ACL, a wrong type)


@dataclass
class Stats:
    """``hits``/``misses``: one per value asked of ``fetch`` (and a miss per failed or empty probe); ``refused``: hits
    the caller then refused (each also a ``bad_bytes`` miss). Every count only grows (Prometheus counters)."""

    hits: int = 0
    refused: int = 0
    misses: Counter[Reason] = field(default_factory=Counter)
    probes: int = 0
    probe_blocks_found: int = 0
    bytes_fetched: int = 0
    pushed: int = 0  # values written
    push_present: int = 0  # values already there: uploads the fleet saved
    push_failed: Counter[Reason] = field(default_factory=Counter)
    bytes_pushed: int = 0
    offers_refused: int = 0  # offers turned away at once (disabled, breaker open, larger than the queue)
    events_published: int = 0
    events_failed: int = 0
    bad_removed: int = 0  # values refused (bad bytes, or tampered with) and removed from the server

    def as_dict(self) -> dict[str, Any]:
        return {
            "hits": self.hits,
            "refused": self.refused,
            # (a read is never refused for memory: OOM is a push's failure only)
            "misses": {r.value: self.misses[r] for r in Reason if r is not Reason.OOM},
            "probes": self.probes,
            "probe_blocks_found": self.probe_blocks_found,
            "bytes_fetched": self.bytes_fetched,
            "pushed": self.pushed,
            "push_present": self.push_present,
            "push_failed": {r.value: n for r, n in sorted(self.push_failed.items())},
            "bytes_pushed": self.bytes_pushed,
            "offers_refused": self.offers_refused,
            "events_published": self.events_published,
            "events_failed": self.events_failed,
            "bad_removed": self.bad_removed,
        }
