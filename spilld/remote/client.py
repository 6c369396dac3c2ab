"""The redis-py client of the remote tier: no retries of its own (the breaker decides), short timeouts."""

from __future__ import annotations

import contextlib
import contextvars
import ssl
from collections.abc import Callable, Iterator
from typing import Any, TypeAlias

from redis._parsers import _AsyncRESP2Parser, _AsyncRESP3Parser
from redis.asyncio import Redis, RedisCluster
from redis.asyncio.connection import SSLConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import InvalidResponse

from .config import RemoteConfig

Client: TypeAlias = "Redis | RedisCluster"

# What a reply may declare before a byte of it is buffered: a hostile server answered a 64-byte read with a bulk
# string of 1.5 GiB, all of it read into memory before our own length check (found in review: 612 MiB peak RSS)
SMALL_REPLY_BYTES = 1024**2  # any command but a fetch (probes, writes, pings, events) is answered with less
MAX_VALUE_BYTES = 512 * 1024**2  # an unbounded read: Redis's own largest value
MAX_REPLY_ITEMS = 65_536  # elements of one array or map a reply declares (our pipelines send far fewer)
_REPLY_BYTES: contextvars.ContextVar[int] = contextvars.ContextVar("spilld_reply_bytes", default=SMALL_REPLY_BYTES)
_SIZED = frozenset(b"$!=")  # RESP bulk string, bulk error, verbatim string: a length of bytes
_COUNTED = frozenset(b"*%~>|")  # array, map, set, push, attribute: a count of elements


@contextlib.contextmanager
def replies_up_to(nbytes: int) -> Iterator[None]:
    """The calls made within (the tasks they start too) may be answered with strings of at most ``nbytes``."""
    token = _REPLY_BYTES.set(nbytes)
    try:
        yield
    finally:
        _REPLY_BYTES.reset(token)


def _refused_length(line: bytes) -> str | None:
    """Why a reply's first line declares more than it may: None if it does not (or is not a length at all)."""
    if not line or (line[0] not in _SIZED and line[0] not in _COUNTED):
        return None
    try:
        n = int(line[1:])
    except ValueError:
        return None  # the parser's own error
    limit = _REPLY_BYTES.get() if line[0] in _SIZED else MAX_REPLY_ITEMS
    return f"a reply declares {n} (at most {limit} here)" if n > limit else None


class _BoundedReads:
    """Mixed into redis-py's pure-Python parsers: a reply whose declared length passes the bound is refused before
    it is buffered."""

    async def _readline(self) -> bytes:
        line: bytes = await super()._readline()  # type: ignore[misc]
        if (why := _refused_length(line)) is not None:
            raise InvalidResponse(why)
        return line


# Each pure-Python parser and its bounded kind. redis-py picks the parser by protocol, and swaps RESP3's for RESP2's
# when a server refuses HELLO: a hostile server could do that to be read unbounded (found in review).
_BOUNDED: dict[type, type] = {
    base: type(f"Bounded{base.__name__}", (_BoundedReads, base), {"__module__": __name__})
    for base in (_AsyncRESP2Parser, _AsyncRESP3Parser)
}


class _BoundedParsers:
    """Mixed into a connection class: whichever parser redis-py sets, a bounded pure-Python one is used (hiredis's,
    the default where it is installed, reads whole replies in C: it is replaced by the one of the same protocol)."""

    protocol: int

    def set_parser(self, parser_class: type) -> None:
        if parser_class not in _BOUNDED:
            parser_class = _AsyncRESP2Parser if getattr(self, "protocol", 3) == 2 else _AsyncRESP3Parser
        super().set_parser(_BOUNDED[parser_class])  # type: ignore[misc]


def make_client(config: RemoteConfig, password: str | None, tls: ssl.SSLContext | None = None) -> Client:
    """A client for ``config.url`` (not yet connected: redis-py connects on the first command). Over TLS, pass
    ``tls_context(config, password)``: every connection then shares that one context."""
    common: dict[str, Any] = {
        "password": password,
        "socket_timeout": config.read_bound_s,
        "socket_connect_timeout": config.connect_bound_s,
        "retry": Retry(NoBackoff(), 0),  # a failure is a miss at once; a retry would hold the caller
        "max_connections": config.max_connections,
        "socket_read_size": config.socket_read_bytes,
        "decode_responses": False,
        "health_check_interval": 0,
    }
    client: Client
    if config.cluster:
        # A node that is gone costs the misses of its slots, not the whole cluster.
        client = RedisCluster.from_url(config.url, require_full_coverage=False, **common)
    else:
        client = Redis.from_url(config.url, **common)
    if tls is not None:
        _share_context(client, tls)
    _bound_replies(client)
    return client


async def close_client(client: Client) -> None:
    await client.aclose()


class SharedContextTLS(SSLConnection):
    """A TLS connection on a context built once per tier. redis-py builds one per connection, and each load of
    the system's CA store held the event loop's thread for 55-75 ms (a 2-core VM), past a 100 ms connect bound
    on a loaded machine. Subclassed per tier with ``context`` set."""

    context: ssl.SSLContext

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.ssl_context.context = self.context  # what its get() returns once built


def _makers(client: Client) -> list[Any]:
    """What makes the client's connections: each has ``connection_class`` and ``connection_kwargs``."""
    if isinstance(client, RedisCluster):
        return list(client.startup_nodes)
    return [client.connection_pool]


def tls_context(config: RemoteConfig, password: str | None) -> ssl.SSLContext | None:
    """The SSL context redis-py would build for a connection of a ``rediss://`` tier (None for other URLs),
    from the URL's own ``ssl_*`` settings; slow (it loads the CA store): call it off the event loop."""
    if not config.tls:
        return None
    maker = _makers(make_client(config, password))[0]  # nothing connects: only its settings are read
    conn = maker.connection_class(**maker.connection_kwargs)
    if not isinstance(conn, SSLConnection):
        raise TypeError(f"a rediss:// client makes {type(conn).__name__} connections")
    return conn.ssl_context.get()


def _bound_replies(client: Client) -> None:
    """Every connection of ``client`` parses with a bounded parser."""
    _wrap_connections(client, _bounded)


def _bounded(cls: type) -> type:
    return (
        cls
        if issubclass(cls, _BoundedParsers)
        else type(f"Bounded{cls.__name__}", (_BoundedParsers, cls), {"__module__": __name__})
    )


def _share_context(client: Client, context: ssl.SSLContext) -> None:
    cls = type("TierTLS", (SharedContextTLS,), {"context": context})
    _wrap_connections(client, lambda _: cls)


def _wrap_connections(client: Client, wrap: Callable[[type], type]) -> None:
    """Each class ``client`` makes its connections of becomes ``wrap`` of it (a cluster's too: for the nodes its
    slot map names later)."""
    for maker in _makers(client):
        maker.connection_class = wrap(maker.connection_class)
    if isinstance(client, RedisCluster):
        client.connection_kwargs["connection_class"] = wrap(client.connection_kwargs["connection_class"])
