"""The one place a Redis client is built: one server (`redis://`, `rediss://`, `unix://`) or a
Redis Cluster (`redis+cluster://host:port[,host:port...]`, `rediss+cluster://` for TLS).

Every client is built with redis-py's maintenance notifications off (they serve Redis
Enterprise's live migrations, which kvledger does not follow). While they are on, and redis-py 8
turns them on by default ("auto"), its pools skip the check that finds a pooled connection dead
before a command is sent on it: after a Redis restart every connection that died with the old
server was handed out once more and failed its command ("Connection closed by server") although
the new server answered. With the check, a dead connection is replaced, and no command is sent
twice (no retry of a command that may have run).

On a cluster every command that names several keys must name keys of one hash slot. kvledger's
keys carry their replica's name as a hash tag (`kvl:{r0}:...`, services.transport.keys.StreamNames), and
no command mixes two replicas' keys: one XREADGROUP over a ledger's or worker's streams, one
pipeline per replica. A pattern SCAN visits every master (RedisCluster.scan_iter does).
"""

from __future__ import annotations

from typing import Any, cast
from urllib.parse import urlsplit, urlunsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.cluster import ClusterNode as SyncClusterNode
from redis.cluster import RedisCluster as SyncRedisCluster

try:  # redis-py 7 and later; older ones have no maintenance notifications to turn off
    from redis.maint_notifications import MaintNotificationsConfig
except ImportError:  # pragma: no cover
    MaintNotificationsConfig = None  # type: ignore[assignment,misc]

try:  # redis-py 7.1 and later
    from redis.driver_info import DriverInfo
except ImportError:  # pragma: no cover
    DriverInfo = None  # type: ignore[assignment,misc]

# The name and version a connection announces (CLIENT SETINFO), built once: redis-py builds
# it per connection from the installed package's metadata (files read from disk, ~0.3 ms idle
# and far more on a loaded machine), which a pool growing by hundreds of connections under a
# burst paid on the event loop.
_DRIVER_INFO = DriverInfo() if DriverInfo is not None else None

CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}


def is_cluster_url(url: str) -> bool:
    return urlsplit(url).scheme in CLUSTER_SCHEMES


def _cluster_seeds(url: str) -> tuple[str, list[tuple[str, int]]]:
    """`redis+cluster://u:p@h1:7000,h2:7001/` -> (`redis://u:p@h1:7000/`, [(h1, 7000), (h2,
    7001)]): the first node as a plain URL (credentials, TLS) and every seed node."""
    parts = urlsplit(url)
    auth, _, hosts = parts.netloc.rpartition("@")
    seeds = []
    for item in hosts.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"redis_url: cluster node {item!r} is not host:port")
        seeds.append((host.strip("[]"), int(port)))
    first = f"{auth}@{hosts.split(',')[0]}" if auth else hosts.split(",")[0]
    plain = urlunsplit((CLUSTER_SCHEMES[parts.scheme], first, "", parts.query, ""))
    return plain, seeds


def client_options(kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs` with what every kvledger client sets: maintenance notifications off, so a
    pooled connection that died is found dead before use (see the module's docstring), and
    the driver's name and version computed once, not per connection."""
    if MaintNotificationsConfig is not None:
        kwargs.setdefault("maint_notifications_config", MaintNotificationsConfig(enabled=False))
    if _DRIVER_INFO is not None:
        kwargs.setdefault("driver_info", _DRIVER_INFO)
    return kwargs


def connect(url: str, **kwargs: Any) -> aioredis.Redis:
    """An asyncio client for `url`; replies stay bytes."""
    client_options(kwargs)
    # redis-py 8 defaults socket_timeout to 5 s, which would cut every XREAD BLOCK longer than
    # that; blocking reads carry their own timeout, so the socket gets none.
    kwargs.setdefault("socket_timeout", None)
    kwargs.setdefault("socket_connect_timeout", 5)
    if not is_cluster_url(url):
        kwargs.setdefault("health_check_interval", 30)
        return aioredis.from_url(url, decode_responses=False, **kwargs)
    plain, seeds = _cluster_seeds(url)
    kwargs.pop("health_check_interval", None)
    client = RedisCluster.from_url(
        plain,
        startup_nodes=[ClusterNode(host, port) for host, port in seeds],
        decode_responses=False,
        **kwargs,
    )
    # The services are written to the commands both clients serve (streams, strings, SCAN,
    # non-transactional pipelines), so they take either under the single-server type.
    return cast(aioredis.Redis, client)


def connect_sync(url: str, **kwargs: Any) -> redis.Redis:
    """A blocking client, for the launcher's start-up checks and the worker's heartbeat thread."""
    client_options(kwargs)
    if not is_cluster_url(url):
        return redis.Redis.from_url(url, **kwargs)
    plain, seeds = _cluster_seeds(url)
    client = SyncRedisCluster.from_url(
        plain, startup_nodes=[SyncClusterNode(host, port) for host, port in seeds], **kwargs
    )
    return cast(redis.Redis, client)
