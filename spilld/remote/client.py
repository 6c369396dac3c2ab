"""The redis-py client of the remote tier: no retries of its own (the breaker decides), short timeouts."""

from __future__ import annotations

import ssl
from typing import Any, TypeAlias

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.connection import SSLConnection
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from .config import RemoteConfig

Client: TypeAlias = "Redis | RedisCluster"


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


def _share_context(client: Client, context: ssl.SSLContext) -> None:
    cls = type("TierTLS", (SharedContextTLS,), {"context": context})
    for maker in _makers(client):
        maker.connection_class = cls
    if isinstance(client, RedisCluster):
        client.connection_kwargs["connection_class"] = cls  # the nodes the cluster's slot map names later
