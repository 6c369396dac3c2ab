"""The write gate (``--admit-after N``): a droppable spill's new blocks are written only once their prefix was
asked for N times.

Asks are lookups, counted per block-aligned prefix of the prompt (a lookup of a 300-token prompt with blocks of
64 asks for its first 64, 128, 192 and 256 tokens). A spill is admitted when the prefix that ends with the first
block it would add was asked at least N times: one-off prompts are never written, a prompt seen again is.
In memory only (a restart forgets the counts), bounded by ``ADMIT_TRACKED_MAX`` prefixes, the least recently
asked forgotten first. A digest collision can only admit a write, never serve a cache: these keys name nothing.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

MAX_ADMIT_AFTER = 1_000  # the most asks the gate can be set to wait for
ADMIT_TRACKED_MAX = 65_536  # prefixes whose asks are remembered (about 10 MiB at most)
_DIGEST_BYTES = 16


def prefix_digests(scope: str, tokens: Sequence[int] | np.ndarray, size: int, count: int) -> list[bytes]:
    """A digest per block-aligned prefix of ``tokens`` (the first ``count``), chained like block keys."""
    ids = np.asarray(tokens, dtype=np.uint32)
    key = hashlib.blake2b(scope.encode(), digest_size=_DIGEST_BYTES).digest()
    out = []
    for i in range(count):
        key = hashlib.blake2b(key + ids[i * size : (i + 1) * size].tobytes(), digest_size=_DIGEST_BYTES).digest()
        out.append(key)
    return out


class Admission:
    """Counts of asks per prefix; ``admits`` says whether a spill's first new block may be written."""

    def __init__(self, after: int, size: int, tracked: int = ADMIT_TRACKED_MAX) -> None:
        if after < 1 or size < 1 or tracked < 1:
            raise ValueError("admit-after, the block size and the tracked count must be positive")
        self.after = after
        self.size = size
        self.tracked = tracked
        self._asks: OrderedDict[bytes, int] = OrderedDict()

    def asked(self, scope: str, tokens: Sequence[int] | np.ndarray) -> None:
        """A lookup of ``tokens`` in ``scope`` (model and namespace): each of its full-block prefixes asked once."""
        self.count(prefix_digests(scope, tokens, self.size, len(tokens) // self.size))

    def count(self, digests: Sequence[bytes]) -> None:
        """``asked`` with the digests computed already (``prefix_digests``, on any thread)."""
        for d in digests:
            self._asks[d] = self._asks.get(d, 0) + 1
            self._asks.move_to_end(d)
        while len(self._asks) > self.tracked:
            self._asks.popitem(last=False)

    def asks(self, scope: str, tokens: Sequence[int] | np.ndarray) -> int:
        """How often the prefix made of the full blocks of ``tokens`` was asked for (0 if under one block)."""
        n = len(tokens) // self.size
        if n == 0:
            return 0
        return self._asks.get(prefix_digests(scope, tokens, self.size, n)[-1], 0)

    def admits(self, scope: str, tokens: Sequence[int] | np.ndarray, first_new: int) -> bool:
        """Whether a spill of ``tokens`` whose first block not stored yet is block ``first_new`` may be written.

        A spill shorter than one block past what is stored is cheap and always admitted.
        """
        end = (first_new + 1) * self.size
        if end > len(tokens):
            return True
        return self.asks(scope, tokens[:end]) >= self.after
