"""A circuit breaker: after a run of failures every call is a fast miss until a trial call succeeds."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

DEFAULT_FAILURE_THRESHOLD = 3  # consecutive failures that open the breaker
DEFAULT_COOLDOWN_S = 1.0  # how long it stays open before one trial call is let through


@dataclass(eq=False)
class Work:
    """The calls made for one piece of work (``tier.one_failure``): whether one of them counted a failure yet."""

    failed: bool = False


class State(StrEnum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


class Breaker:
    """Closed: calls pass. Open: calls are refused until ``cooldown_s`` has passed. Half-open: one trial call
    passes (the others are refused); its success closes the breaker, its failure opens it again."""

    def __init__(
        self,
        threshold: int = DEFAULT_FAILURE_THRESHOLD,
        cooldown_s: float = DEFAULT_COOLDOWN_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if threshold < 1 or cooldown_s < 0:
            raise ValueError("the threshold is at least 1 and the cooldown not negative")
        self.threshold = threshold
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._state = State.CLOSED
        self._failures = 0  # consecutive, while closed
        self._opened_at = 0.0
        self._trial_out = False  # half-open: the one trial call is in flight
        self.entered: Counter[State] = Counter()  # times each state was entered (for status and tests)

    @property
    def state(self) -> State:
        """The state now (an open breaker whose cooldown has passed reads as half-open)."""
        if self._state is State.OPEN and self._clock() - self._opened_at >= self.cooldown_s:
            self._enter(State.HALF_OPEN)
        return self._state

    def allow(self) -> bool:
        """Whether a call may go to the server now; a True in half-open makes that call the trial."""
        state = self.state
        if state is State.CLOSED:
            return True
        if state is State.HALF_OPEN and not self._trial_out:
            self._trial_out = True
            return True
        return False

    @property
    def trial_free(self) -> bool:
        """Half-open, and no call has taken the trial yet."""
        return self.state is State.HALF_OPEN and not self._trial_out

    def success(self) -> None:
        self._failures = 0
        if self._state is not State.CLOSED:
            self._enter(State.CLOSED)

    def failure(self) -> None:
        self._failures += 1
        if self._state is State.HALF_OPEN or (self._state is State.CLOSED and self._failures >= self.threshold):
            self._open()

    def abandon(self) -> None:
        """A call it let through was cancelled before it ended: no verdict on the server. A half-open trial is
        given back, so the next call may try (else no call would ever be let through again)."""
        if self._state is State.HALF_OPEN:
            self._trial_out = False

    def trip(self) -> None:
        """Open now, whatever the count (the connection is known to be gone)."""
        if self._state is not State.OPEN:
            self._open()

    def _open(self) -> None:
        self._opened_at = self._clock()
        self._enter(State.OPEN)

    def _enter(self, state: State) -> None:
        self._state = state
        self._trial_out = False
        if state is State.CLOSED:
            self._failures = 0
        self.entered[state] += 1
