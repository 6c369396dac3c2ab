"""docs/format.md §10, rule by rule, against a real daemon subprocess on a real socket, with a client that speaks
the wire protocol frame by frame (``tests/wire.py``): what an independent implementation relies on."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from spilld import format as fmt
from spilld import protocol as P
from spilld.daemon import MAX_OPEN_SPILLS
from spilld.daemon.ingest import MAX_OPEN_TENSORS, MAX_OPEN_TOKENS
from tests.daemons import Daemon, serving
from tests.hostile_memory import kv_header
from tests.wire import Wire

ROWS = 8  # a KV entry of [1, 8, 8, 128] float16: two 16 KiB tensors


@pytest.fixture(scope="module")
def daemon() -> Iterator[Daemon]:
    with serving("--cap", "64MiB") as d:
        yield d


@pytest.fixture
def w(daemon: Daemon) -> Iterator[Wire]:
    wire = Wire(daemon.socket)
    wire.hello()
    yield wire
    wire.close()


def store(w: Wire, header: dict[str, Any]) -> dict[str, Any]:
    sid = w.call("spill", {"header": header}).result["spill"]
    for i in range(2):
        w.send(P.notification("put", {"spill": sid, "index": i, "offset": 0}, os.urandom(8 * ROWS * 128 * 2)))
    r = w.call("commit", {"spill": sid})
    assert r.error is None and r.result["outcome"] == "stored", r
    return dict(r.result)


def lookup(w: Wire, tokens: list[int], **over: Any) -> dict[str, Any]:
    params = {
        "identity": {"model_id": "hostile", "config_fingerprint": "", "tokenizer_hash": ""},
        "namespace": "",
        "tokens": fmt.encode_tokens(tokens),
        "codec_provider": "spilld/mlx-lm/1",
    } | over
    r = w.call("lookup", params)
    assert r.error is None, r.error
    return dict(r.result)


def still_serves(w: Wire) -> bool:
    return w.call("status", {}).error is None


# --- hello -------------------------------------------------------------------------------------------------


def test_hello_answers_every_documented_field(daemon: Daemon) -> None:
    w = Wire(daemon.socket)
    h = w.hello()
    assert h["version"] == P.PROTOCOL_VERSION and h["server"].startswith("spilld ") and h["pid"] == daemon.proc.pid  # type: ignore[union-attr]
    assert h["shm"] is True and h["dir"] == daemon.dir
    assert h["limits"] == {
        "max_msg": P.MAX_MSG_BYTES,
        "max_payload": P.MAX_PAYLOAD_BYTES,
        "max_inflight_requests": P.MAX_INFLIGHT_REQUESTS,
        "max_open_spills": MAX_OPEN_SPILLS,
        "max_open_tokens": MAX_OPEN_TOKENS,
        "max_open_tensors": MAX_OPEN_TENSORS,
        "max_spill_bytes": 2 * 64 * 1024 * 1024,  # MAX_SPILL_CAPS x --cap
    }


@pytest.mark.parametrize("version", [99, "1", None])
def test_a_refused_hello_is_its_response_then_the_connection_closes(daemon: Daemon, version: Any) -> None:
    w = Wire(daemon.socket)
    w.send(P.request(1, "hello", {"version": version}))
    r = w.response(1)
    assert r.error is not None and r.error["code"] == "unsupported_protocol"
    assert "Error(" not in r.error["message"]
    assert w.until_closed() == [] and not w.notes


def test_a_request_before_hello_is_refused_as_its_response_then_closed(daemon: Daemon) -> None:
    w = Wire(daemon.socket)
    w.send(P.request(4, "status", {}))
    r = w.response(4)
    assert r.error is not None and r.error["code"] == "protocol_error"
    assert w.until_closed() == []


def test_a_notification_before_hello_is_an_error_notification_then_closed(daemon: Daemon) -> None:
    w = Wire(daemon.socket)
    w.send(P.notification("put", {"spill": 1, "index": 0, "offset": 0}, b"x"))
    msgs = w.until_closed()
    assert [(m.kind, m.method, m.params["code"]) for m in msgs] == [(P.NOTIFICATION, "error", "protocol_error")]


def test_a_second_hello_is_refused_and_the_connection_goes_on(w: Wire) -> None:
    r = w.call("hello", {"version": P.PROTOCOL_VERSION})
    assert r.error is not None and r.error["code"] == "duplicate_hello"
    assert still_serves(w)


# --- unknown methods -----------------------------------------------------------------------------------------


def test_unknown_request_and_unknown_notification_keep_the_connection(w: Wire) -> None:
    r = w.call("no_such_method", {})
    assert r.error is not None and r.error["code"] == "unknown_method"
    w.send(P.notification("no_such_notification", {"x": 1}))  # ignored, no answer
    assert still_serves(w) and not w.notes


# --- spill, put, commit, abort --------------------------------------------------------------------------------


def test_a_spill_header_may_leave_out_what_the_daemon_computes(w: Wire) -> None:
    header = kv_header(ROWS, seed=1)
    del header["created_at_ms"]
    for t in header["caches"][0]["tensors"]:
        del t["off"], t["hash"]
    r = w.call("spill", {"header": header, "key": "k1", "droppable": False})
    assert r.error is None and r.result["tensors"] == 2 and r.result["bytes"] == 2 * 8 * ROWS * 128 * 2
    assert w.call("abort", {"spill": r.result["spill"]}).result == {"aborted": True}


def test_a_spill_posing_as_a_checkpoint_namespace_is_refused(w: Wire) -> None:
    header = kv_header(ROWS, seed=6)
    header["identity"]["namespace"] = "\0checkpoint:someone"
    r = w.call("spill", {"header": header})
    assert r.error is not None and r.error["code"] == "bad_params" and "reserved" in r.error["message"]


def test_a_put_for_no_open_spill_is_a_spill_error_notification(w: Wire) -> None:
    w.send(P.notification("put", {"spill": 4242, "index": 0, "offset": 0}, b"abc"))
    n = w.note("spill_error")
    assert n.params["spill"] == 4242 and n.params["code"] == "bad_params" and "4242" in n.params["message"]
    assert still_serves(w)


def test_a_put_naming_true_names_no_spill(w: Wire) -> None:
    """msgpack's true is not the integer 1: the open spill 1 is left alone."""
    sid = w.call("spill", {"header": kv_header(ROWS, seed=7)}).result["spill"]
    w.send(P.notification("put", {"spill": True, "index": 0, "offset": 0}, b"abc"))
    n = w.note("spill_error")
    assert n.params["spill"] == -1 and "no open spill" in n.params["message"]
    assert w.call("abort", {"spill": sid}).result == {"aborted": True}
    assert [m for m in w.notes if m.method == "spill_error"] == []  # spill 1 never failed


def test_an_empty_put_fails_its_spill_and_the_connection_goes_on(w: Wire) -> None:
    sid = w.call("spill", {"header": kv_header(ROWS, seed=2)}).result["spill"]
    w.send(P.notification("put", {"spill": sid, "index": 0, "offset": 0}, b""))
    n = w.note("spill_error")
    assert (n.params["spill"], n.params["code"], n.params["message"]) == (sid, "bad_params", "empty put")
    r = w.call("commit", {"spill": sid})
    assert r.error is not None and r.error["code"] == "bad_params" and r.error["message"] == "empty put"
    assert still_serves(w)


def test_a_put_out_of_order_fails_its_spill_once(w: Wire) -> None:
    sid = w.call("spill", {"header": kv_header(ROWS, seed=3)}).result["spill"]
    for _ in range(3):
        w.send(P.notification("put", {"spill": sid, "index": 0, "offset": 64}, b"x" * 64))
    assert w.note("spill_error").params["code"] == "bad_params"
    r = w.call("commit", {"spill": sid})
    assert r.error is not None and "out of order" in r.error["message"]
    assert [n for n in w.notes if n.method == "spill_error"] == []  # said once, not per put


def test_commit_errors(w: Wire) -> None:
    sid = w.call("spill", {"header": kv_header(ROWS, seed=4)}).result["spill"]
    r = w.call("commit", {"spill": sid})
    assert r.error is not None and r.error["code"] == "bad_params" and "every tensor byte" in r.error["message"]
    r = w.call("commit", {"spill": sid})  # gone after its commit, whatever the answer
    assert r.error is not None and r.error["code"] == "bad_params" and "no open spill" in r.error["message"]


def test_abort_says_whether_there_was_a_spill(w: Wire) -> None:
    sid = w.call("spill", {"header": kv_header(ROWS, seed=5)}).result["spill"]
    assert w.call("abort", {"spill": sid}).result == {"aborted": True}
    assert w.call("abort", {"spill": sid}).result == {"aborted": False}


def test_bad_params_are_said_in_words_not_reprs(w: Wire) -> None:
    r = w.call("lookup", {"tokens": b""})
    assert r.error is not None and r.error["code"] == "bad_params"
    assert r.error["message"] == "lookup: bad params: missing 'identity'"
    r = w.call("spill", {"header": "nope"})
    assert r.error is not None and "Error(" not in r.error["message"]


# Each request whose params break the methods table (§10): a wrong type, a number that is not one, a bound passed.
WRONG_PARAMS = [
    ("drain", {"timeout": "5"}, "timeout must be a number of seconds"),
    ("drain", {"timeout": float("nan")}, "timeout must be a number of seconds"),
    ("drain", {"timeout": -1.0}, "timeout must be a number of seconds"),
    ("drain", {"timeout": True}, "timeout must be a number of seconds"),
    ("evict", {"older_than_s": float("inf")}, "older_than_s must be a number of seconds"),
    ("evict", {"fingerprint": 7}, "fingerprint must be a str"),
    ("barrier", {"key": ["k"]}, "key must be a str"),
    ("barrier", {"delete_checkpoints": 1}, "delete_checkpoints must be a bool"),
    ("cancel", {"namespace": b"ns"}, "namespace must be a str"),
    ("touch", {"path": 7}, "path must be a str"),
    ("touch", {"path": "/x", "restore_s": "fast"}, "restore_s must be a number of seconds"),
    ("delete", {"path": None, "key": 3}, "key must be a str"),
    ("delete", {}, "a path or a key is needed"),
    ("pin", {"path": "/x", "on": "no"}, "on must be a bool"),
    ("report_bad", {"path": "/x", "code": 1}, "code must be a str"),
    ("commit", {"spill": "1"}, "spill must be an int >= 0"),
    ("abort", {"spill": -1}, "spill must be an int >= 0"),
    ("lookup", {"identity": {"model_id": 1}, "tokens": b""}, "identity.model_id must be a str"),
    ("lookup", {"identity": {}, "tokens": [1, 2]}, "tokens must be bin"),
    ("lookup", {"identity": {}, "tokens": b"abc"}, "tokens must be u32 token ids, a multiple of 4 bytes"),
    ("resume", {"identity": {}}, "missing 'key'"),
    ("resume", {"identity": {"tokenizer_hash": 9}, "key": "k"}, "identity.tokenizer_hash must be a str"),
    ("spill", {"header": {}, "droppable": "yes"}, "droppable must be a bool"),
    ("spill", {"header": {}, "key": 5}, "key must be a str"),
]


@pytest.mark.parametrize(("method", "params", "said"), WRONG_PARAMS)
def test_a_param_of_the_wrong_type_or_out_of_bounds_is_bad_params(
    w: Wire, method: str, params: dict[str, Any], said: str
) -> None:
    r = w.call(method, params)
    assert r.error is not None and r.error["code"] == "bad_params", r
    assert r.error["message"].startswith(f"{method}: bad params: ") and said in r.error["message"], r.error
    assert still_serves(w)


def test_a_put_shm_whose_length_is_not_an_int_fails_its_spill(w: Wire) -> None:
    sid = w.call("spill", {"header": kv_header(ROWS, seed=8)}).result["spill"]
    params = {"spill": sid, "index": 0, "offset": 0, "shm": "spilld-0000abcd-1", "length": 1.5}
    w.send(P.notification("put_shm", params))
    n = w.note("spill_error")
    assert (n.params["spill"], n.params["code"]) == (sid, "bad_params") and "length must be an int" in n.params[
        "message"
    ]
    assert w.note("shm_free").params["names"] == ["spilld-0000abcd-1"]  # the segment goes back, unread
    assert still_serves(w)


def test_optional_params_may_be_nil_and_unknown_ones_are_ignored(w: Wire) -> None:
    r = w.call("barrier", {"key": None, "delete_checkpoints": None, "from_a_newer_client": [1, 2]})
    assert r.error is None and r.result == {"outcome": "stored", "deleted": 0}
    r = w.call("touch", {"path": "/no/such/entry", "restore_s": None})
    assert r.error is None and r.result == {"found": False}


# --- lookup and touch ----------------------------------------------------------------------------------------


def test_lookup_matched_tokens_and_the_len_minus_one_cap(w: Wire) -> None:
    header = kv_header(ROWS, seed=1000)
    stored = store(w, header)
    tokens = fmt.decode_tokens(header["tokens"])
    hit = lookup(w, tokens)  # the whole prompt: one token must still be computed
    assert hit == {
        "hit": True, "path": stored["path"], "matched": ROWS - 1, "tokens": ROWS, "trimmable": True, "blocks_only": False,
        "blocks": [],
    }  # fmt: skip
    assert lookup(w, [*tokens, 1, 2])["matched"] == ROWS  # a longer prompt uses all of it
    assert lookup(w, tokens[:5])["matched"] == 4
    assert w.call("touch", {"path": stored["path"]}).result == {"found": True}
    assert w.call("touch", {"path": "/no/such/entry"}).result == {"found": False}


def test_lookup_miss_reasons_and_identity_rules(w: Wire) -> None:
    header = kv_header(ROWS, seed=2000)
    store(w, header)
    tokens = [*fmt.decode_tokens(header["tokens"]), 9]
    assert lookup(w, [7_777_777, 1, 2]) == {"hit": False, "reason": "no_entry"}
    other = {"model_id": "someone-else", "config_fingerprint": "", "tokenizer_hash": ""}
    assert lookup(w, tokens, identity=other)["reason"] == "identity_mismatch"
    unset = {"model_id": "", "config_fingerprint": "", "tokenizer_hash": ""}  # "" is a value: no wildcard
    assert lookup(w, tokens, identity=unset)["reason"] == "identity_mismatch"
    assert lookup(w, tokens, codec_provider="engine-x/1")["reason"] == "codec_mismatch"
    assert lookup(w, tokens, namespace="tenant-a")["reason"] == "no_entry"  # the namespace param is the one
    ident = {"model_id": "hostile", "config_fingerprint": "", "tokenizer_hash": "", "namespace": "tenant-a"}
    assert lookup(w, tokens, identity=ident)["hit"] is True  # the identity's namespace is not used
