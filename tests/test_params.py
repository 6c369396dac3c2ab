"""The one check of a request's params (``spilld/daemon/params.py``), without a socket: each method's table, the
types and bounds it enforces, and what a handler gets (its known params only)."""

from __future__ import annotations

from typing import Any

import pytest

from spilld import protocol as P
from spilld.daemon.params import MAX_SECONDS, METHODS, check


def test_a_handler_gets_its_known_params_only() -> None:
    padding = [{} for _ in range(1000)]  # what a client may send beside a long wait's params
    assert check("drain", {"timeout": 5, "padding": padding}) == {"timeout": 5}
    got = check("lookup", {"identity": {"model_id": "m", "junk": padding}, "tokens": b"", "x": padding})
    assert got == {"identity": {"model_id": "m"}, "tokens": b""}
    assert check("status", {"anything": padding}) == {}
    assert check("no_such_method", {"anything": padding}) == {}


def test_seconds_are_bounded_at_max_seconds() -> None:
    assert check("drain", {"timeout": MAX_SECONDS}) == {"timeout": MAX_SECONDS}
    assert check("evict", {"older_than_s": 0}) == {"older_than_s": 0}
    for bad in (MAX_SECONDS * 1.0001, -0.001, float("nan"), float("inf"), True, "1"):
        with pytest.raises(P.BadParams, match="seconds"):
            check("drain", {"timeout": bad})


@pytest.mark.parametrize("bad", [True, -1, 1.0, "1", None])
def test_a_required_int_is_an_int_at_least_zero(bad: Any) -> None:
    assert check("commit", {"spill": 0}) == {"spill": 0}
    with pytest.raises(P.BadParams, match="commit: bad params: "):
        check("commit", {"spill": bad})


def test_every_method_of_the_daemon_has_a_table() -> None:
    from spilld.daemon.server import SERVED_METHODS

    ingest = {"hello", "spill", "commit", "abort", "put", "put_shm"}
    assert set(SERVED_METHODS) | ingest == set(METHODS)
