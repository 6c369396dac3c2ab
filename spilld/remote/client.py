"""The redis-py client of the remote tier: no retries of its own (the breaker decides), short timeouts."""

from __future__ import annotations

import contextlib
import contextvars
import ssl
from collections.abc import Iterator
from typing import Any, TypeAlias

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.connection import DefaultParser, SSLConnection
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


class BoundedParser(DefaultParser):  # type: ignore[misc,valid-type]
    """redis-py's parser, refusing a reply whose declared length passes the bound before it buffers it."""

    async def _readline(self) -> bytes:
        line: bytes = await super()._readline()
        if (why := _refused_length(line)) is not None:
            raise InvalidResponse(why)
        return line


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
    """Every connection of ``client`` parses with ``BoundedParser`` (the pure-Python parser only: hiredis's reads
    whole replies in C, and is left as it is; a server without RESP3 (before Redis 6), to which redis-py falls back
    with a parser of its own, is not bounded either)."""
    if not hasattr(DefaultParser, "_readline"):
        return
    for maker in _makers(client):
        maker.connection_kwargs["parser_class"] = BoundedParser
    if isinstance(client, RedisCluster):
        client.connection_kwargs["parser_class"] = BoundedParser  # the nodes the cluster's slot map names later


def _share_context(client: Client, context: ssl.SSLContext) -> None:
    cls = type("TierTLS", (SharedContextTLS,), {"context": context})
    for maker in _makers(client):
        maker.connection_class = cls
    if isinstance(client, RedisCluster):
        client.connection_kwargs["connection_class"] = cls  # the nodes the cluster's slot map names later
