"""Bytes that requests being served hold in memory, against a limit (``Budget``): what a client's messages make
the daemon keep while they wait for a thread is counted from their dispatch, and refused (``busy``) past it."""

from __future__ import annotations

from .. import protocol as P
from ..config import format_size

# Lookups being served hold at most --cap / LOOKUP_SHARE together (one alone always goes in): found in review, 400
# clients pipelining lookups of 15,000 tokens each made a daemon at --cap 64MiB peak at 250 MB while they waited
# for the compute threads.
LOOKUP_SHARE = 4
# and one client (a process, whatever its connections) at most 1 / LOOKUP_CLIENT_SHARE of that, beyond its first
# lookup: found in review, one process pipelining lookups filled the whole share, and another engine's lookups,
# one at a time, were answered busy (misses) 148 times in 200.
LOOKUP_CLIENT_SHARE = 8
# What one lookup holds: its message (the token array is a view of its bytes) and the objects of its task, params
# and answer (a few KiB each).
LOOKUP_BYTES_PER_MSG_BYTE = 1
LOOKUP_BASE_BYTES = 16 * 1024


def lookup_bytes(msg_size: int) -> int:
    """What a lookup of a ``msg_size``-byte message is counted as while it is served."""
    return LOOKUP_BASE_BYTES + LOOKUP_BYTES_PER_MSG_BYTE * msg_size


class Budget:
    """``take`` counts a client's bytes against ``limit`` and, once that client holds some, against ``share`` too;
    past either it refuses them (``busy``); ``give`` returns them. Nothing held, anything goes in: one request
    larger than the limit is never refused for ever. A client's first request goes in wherever the limit allows, its
    next ones within its share, which leaves the rest of the limit to the others. A client is kept only while it
    holds bytes (at most one per connection)."""

    def __init__(self, limit: int, what: str, share: int | None = None) -> None:
        self.limit, self.what = limit, what
        self.share = limit if share is None else share
        self.held = 0
        self.clients: dict[str, int] = {}  # what each client holding bytes holds

    def take(self, nbytes: int, client: str) -> int:
        mine = self.clients.get(client, 0)
        if mine and mine + nbytes > self.share:
            raise P.Busy(
                f"this client holds {format_size(mine)} of {format_size(self.share)} for {self.what} being served, "
                "its share; retry later"
            )
        if self.held and self.held + nbytes > self.limit:
            raise P.Busy(
                f"the daemon holds {format_size(self.held)} of {format_size(self.limit)} for {self.what} being "
                "served; retry later"
            )
        self.held += nbytes
        self.clients[client] = mine + nbytes
        return nbytes

    def give(self, nbytes: int, client: str) -> None:
        self.held -= nbytes
        left = self.clients.pop(client) - nbytes
        if left:
            self.clients[client] = left
