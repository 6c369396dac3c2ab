"""Test helpers about a client's or a tier's own loop thread."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from typing import Any


def on_loop(owner: Any, fut: Future[Any], callback: Callable[[Any], None]) -> None:
    """Attach ``callback`` to ``fut`` from ``owner``'s loop thread, so it runs there even if ``fut`` has settled
    already (attached from this thread, a settled future would run it here: CI saw that, and the test proved
    nothing)."""
    owner._lt.loop.call_soon_threadsafe(fut.add_done_callback, callback)
