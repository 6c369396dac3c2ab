"""Shared fixtures: async tests run under both the asyncio and the uvloop loop (``one_loop``: asyncio only)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import Any

import pytest
import uvloop


def pytest_asyncio_loop_factories(config: Any, item: Any) -> dict[str, Callable[[], asyncio.AbstractEventLoop]]:
    if item.get_closest_marker("one_loop"):
        return {"asyncio": asyncio.new_event_loop}
    return {"asyncio": asyncio.new_event_loop, "uvloop": uvloop.new_event_loop}


def pytest_configure(config: Any) -> None:
    config.addinivalue_line(
        "markers",
        "one_loop: asyncio only, for slow tests whose loop is not what they test (it only drives clients of daemon "
        "processes, which run uvloop; or the same code runs on both loops in other tests)",
    )


LONG = os.environ.get("SPILLD_LONG") == "1"
LONG_TIMEOUT_S = 4 * 3600  # per test, in the opt-in run


def pytest_collection_modifyitems(config: Any, items: list[Any]) -> None:
    """The opt-in run (SPILLD_LONG=1, tens of minutes) lifts the per-test timeout.

    No test is skipped by default: the long suites scale their sizes with ``LONG`` instead, so CI runs each of
    them at a bounded size.
    """
    if LONG:
        for item in items:
            item.add_marker(pytest.mark.timeout(LONG_TIMEOUT_S))


def leftover_files(folder: str) -> list[str]:
    return sorted(os.listdir(folder))


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else len(os.listdir("/dev/fd"))


@pytest.fixture
def refuse_listing(monkeypatch: pytest.MonkeyPatch) -> Callable[[Any, OSError], None]:
    """``refuse_listing(folder, error)``: ``os.listdir(folder)`` raises ``error`` from then on; other folders list as
    they are (root reads any folder, and a sweep's removal cannot be timed: the refusal is made here)."""
    real = os.listdir

    def refuse(folder: Any, error: OSError) -> None:
        def listdir(path: Any = ".") -> list[str]:
            if os.fspath(path) == os.fspath(folder):
                raise error
            return real(path)

        monkeypatch.setattr(os, "listdir", listdir)

    return refuse
