"""The redis-py client of the remote tier: no retries of its own (the breaker decides), short timeouts."""

from __future__ import annotations

from typing import Any, TypeAlias

from redis.asyncio import Redis, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from .config import RemoteConfig

Client: TypeAlias = "Redis | RedisCluster"


def make_client(config: RemoteConfig, password: str | None) -> Client:
    """A client for ``config.url`` (not yet connected: redis-py connects on the first command)."""
    common: dict[str, Any] = {
        "password": password,
        "socket_timeout": config.socket_timeout_s,
        "socket_connect_timeout": config.connect_timeout_s,
        "retry": Retry(NoBackoff(), 0),  # a failure is a miss at once; a retry would hold the caller
        "max_connections": config.max_connections,
        "socket_read_size": config.socket_read_bytes,
        "decode_responses": False,
        "health_check_interval": 0,
    }
    if config.cluster:
        # A node that is gone costs the misses of its slots, not the whole cluster.
        return RedisCluster.from_url(config.url, require_full_coverage=False, **common)
    return Redis.from_url(config.url, **common)


async def close_client(client: Client) -> None:
    await client.aclose()
