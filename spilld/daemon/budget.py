"""Bytes that requests being served hold in memory, against a limit (``Budget``): what a client's messages make
the daemon keep while they wait for a thread is counted from their dispatch, and refused (``busy``) past it."""

from __future__ import annotations

from .. import protocol as P
from ..config import format_size

# Lookups being served hold at most --cap / LOOKUP_SHARE together (one alone always goes in): found in review, 400
# clients pipelining lookups of 15,000 tokens each made a daemon at --cap 64MiB peak at 250 MB while they waited
# for the compute threads.
LOOKUP_SHARE = 4
# What one lookup holds: its message (the token array is a view of its bytes) and the objects of its task, params
# and answer (a few KiB each).
LOOKUP_BYTES_PER_MSG_BYTE = 1
LOOKUP_BASE_BYTES = 16 * 1024


def lookup_bytes(msg_size: int) -> int:
    """What a lookup of a ``msg_size``-byte message is counted as while it is served."""
    return LOOKUP_BASE_BYTES + LOOKUP_BYTES_PER_MSG_BYTE * msg_size


class Budget:
    """``take`` counts bytes against ``limit`` or refuses them (``busy``), ``give`` returns them. Nothing held,
    anything goes in: one request larger than the limit is never refused for ever."""

    def __init__(self, limit: int, what: str) -> None:
        self.limit, self.what = limit, what
        self.held = 0

    def take(self, nbytes: int) -> int:
        if self.held and self.held + nbytes > self.limit:
            raise P.Busy(
                f"the daemon holds {format_size(self.held)} of {format_size(self.limit)} for {self.what} being "
                "served; retry later"
            )
        self.held += nbytes
        return nbytes

    def give(self, nbytes: int) -> None:
        self.held -= nbytes
