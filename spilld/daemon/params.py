"""The one check of a message's params before its handler runs: each method's table of params (``docs/format.md``
§10, "Methods"), their types, and the bounds of the numbers a handler uses. A handler reads only params checked
here. A param of the wrong type is ``bad_params``; an optional one may be left out or nil; params a method does not
know are left out of what the handler gets (a newer client's; and a request that waits long, a drain, keeps
nothing a client padded it with)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .. import protocol as P
from ..config import MAX_DURATION_S, check_duration

# The largest number of seconds a client may ask a wait to last (a drain's timeout, an eviction's age): the bound
# of every duration spilld takes (a century; the CLI's too), which keeps the deadline arithmetic finite.
MAX_SECONDS = float(MAX_DURATION_S)
# The longest str param (a namespace, a key, an identity field, a path): a name, never a payload. What a client
# names is kept beyond its request (the shared tier keeps a tag per namespace); found in review: 4 MiB namespaces.
MAX_TEXT_CHARS = 4096


@dataclass(frozen=True)
class Param:
    """One param: its wire type (``int``, ``str``, ``bool``, ``bytes``, ``dict``, or ``float`` for seconds) and
    whether it must be given."""

    kind: type
    required: bool = False

    def check(self, method: str, name: str, value: Any) -> None:
        if value is None:
            if self.required:
                raise P.BadParams(f"{method}: bad params: missing {name!r}")
            return
        if self.kind is float:
            try:  # the one duration rule spilld has (the CLI's and Config's too)
                if type(value) not in (int, float):
                    raise ValueError(name)
                check_duration(value)
            except ValueError:
                raise P.BadParams(
                    f"{method}: bad params: {name} must be a number of seconds from 0 to {MAX_SECONDS:g}"
                ) from None
        elif self.kind is int:
            if type(value) is not int or value < 0:  # bool is an int subclass: not taken for one
                raise P.BadParams(f"{method}: bad params: {name} must be an int >= 0")
        elif type(value) is not self.kind:
            raise P.BadParams(f"{method}: bad params: {name} must be {_WIRE_NAMES[self.kind]}")
        elif isinstance(value, str):
            check_text(method, name, value)


def check_text(method: str, name: str, value: str) -> None:
    """``bad_params`` for a name longer than ``MAX_TEXT_CHARS``."""
    if len(value) > MAX_TEXT_CHARS:
        raise P.BadParams(f"{method}: bad params: {name} is longer than {MAX_TEXT_CHARS} characters")


_WIRE_NAMES = {str: "a str", bool: "a bool", bytes: "bin", dict: "a map"}

_SPILL_ID = Param(int, required=True)
_CHUNK = {"spill": _SPILL_ID, "index": Param(int, required=True), "offset": Param(int, required=True)}

# Every method's params. ``hello``'s ``version`` is checked by the handshake itself (a wrong one is
# ``unsupported_protocol``, whatever its type).
METHODS: dict[str, dict[str, Param]] = {
    "hello": {"client": Param(str), "pid": Param(int), "lease_grantor": Param(bool), "session": Param(str)},
    "spill": {
        "header": Param(dict, required=True),
        "droppable": Param(bool),
        "key": Param(str),
        "pin": Param(bool),
        "held": Param(bool),
    },
    "put": _CHUNK,
    "put_shm": _CHUNK | {"shm": Param(str, required=True), "length": Param(int, required=True)},
    "commit": {"spill": _SPILL_ID},
    "abort": {"spill": _SPILL_ID},
    "barrier": {"key": Param(str), "delete_checkpoints": Param(bool)},
    "cancel": {"namespace": Param(str), "key": Param(str)},
    "lookup": {
        "identity": Param(dict, required=True),
        "namespace": Param(str),
        "tokens": Param(bytes, required=True),
        "codec_provider": Param(str),
        "longer_than": Param(int),
    },
    "resume": {"identity": Param(dict, required=True), "key": Param(str, required=True), "codec_provider": Param(str)},
    "touch": {"path": Param(str, required=True), "restore_s": Param(float)},
    "read_failed": {"path": Param(str, required=True), "file": Param(str)},
    "delete": {"path": Param(str), "key": Param(str)},
    "pin": {"path": Param(str, required=True), "on": Param(bool)},
    "report_bad": {"path": Param(str, required=True), "code": Param(str), "file": Param(str)},
    "drain": {"timeout": Param(float)},
    "status": {},
    "shutdown": {},
    "evict": {"fingerprint": Param(str), "older_than_s": Param(float)},
}

# The identity map of a lookup or a resume: each field a str when given.
IDENTITY_FIELDS = ("model_id", "config_fingerprint", "tokenizer_hash")
TOKEN_BYTES = 4  # a token id in a lookup's ``tokens``: u32, little-endian


def check(method: str, params: dict[str, Any]) -> dict[str, Any]:
    """The params of ``method``'s table found in ``params``, each checked, nil ones left out: a handler reads each
    with ``params.get(name, default)``. A method without a table gets none (``unknown_method`` is the router's)."""
    table = METHODS.get(method, {})
    for name, param in table.items():
        param.check(method, name, params.get(name))
    if method in ("lookup", "resume"):
        ident = params["identity"]
        for name in IDENTITY_FIELDS:
            Param(str).check(method, f"identity.{name}", ident.get(name))
        params = params | {"identity": {k: ident[k] for k in IDENTITY_FIELDS if ident.get(k) is not None}}
    if method == "lookup" and len(params["tokens"]) % TOKEN_BYTES:  # (found in review: answered header_malformed)
        raise P.BadParams(f"{method}: bad params: tokens must be u32 token ids, a multiple of {TOKEN_BYTES} bytes")
    return {k: v for k in table if (v := params.get(k)) is not None}
