"""Redis clients from one URL: a single server, a Redis Cluster, or a Sentinel-run primary.

The router keeps three kinds of shared state in Redis (``load_store``, ``index_sync``,
``model_snapshots``) and builds its clients here, so all three work against the same three
deployments:

- ``redis://[[user]:password@]host[:port][/db]``, ``rediss://...``, ``unix:///path``: one
  server (redis-py's ``Redis.from_url``).
- ``redis+cluster://[[user]:password@]host[:port][,host[:port]...]`` (and
  ``rediss+cluster://``): a Redis Cluster, reached through any of the startup nodes listed
  (redis-py's ``RedisCluster``; it finds the others and follows slot moves). Cluster mode has
  database 0 only.
- ``redis+sentinel://[[user]:password@]host[:port][,host[:port]...]/service[/db]`` (and
  ``rediss+sentinel://``): the primary that the listed Sentinels name for ``service``
  (redis-py's ``Sentinel(...).master_for(service)``), asked again on every new connection,
  so a failover is followed. The user and password are the data nodes'; the Sentinels' own
  come as ``?sentinel_username=...&sentinel_password=...``, as redis-py keeps them apart
  (``sentinel_kwargs``). Port defaults: 6379 for data nodes, 26379 for Sentinels.

Every key the router writes starts with ``key_prefix(cluster)``, ``kvroute:{cluster}:``: the
braces are a Redis Cluster hash tag, so all of one namespace's keys live in one slot and the
multi-key load scripts run on one node (Redis Cluster refuses a script whose keys span
slots).

>>> parse_redis_url("redis+sentinel://:pw@s1,s2:26380/kv/2").nodes
(('s1', 26379), ('s2', 26380))
>>> key_prefix("prod")
'kvroute:{prod}:'
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal, TypeAlias
from urllib.parse import parse_qs, unquote, urlsplit

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.sentinel import Sentinel
from redis.exceptions import ClusterError, RedisClusterException
from redis.typing import EncodableT

__all__ = [
    "ClusterClient",
    "RedisClient",
    "RedisTarget",
    "connect",
    "drop_connections",
    "key_prefix",
    "parse_redis_url",
    "redact_redis_url",
]

RedisClient: TypeAlias = aioredis.Redis | RedisCluster

_SCHEMES = {
    "redis": ("standalone", False),
    "rediss": ("standalone", True),
    "unix": ("standalone", False),
    "redis+cluster": ("cluster", False),
    "rediss+cluster": ("cluster", True),
    "redis+sentinel": ("sentinel", False),
    "rediss+sentinel": ("sentinel", True),
}
_SENTINEL_PARAMS = {"sentinel_username", "sentinel_password"}


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """What a Redis URL names: how to reach it and as whom."""

    kind: Literal["standalone", "cluster", "sentinel"]
    url: str  # as given (standalone: handed to redis-py as is)
    nodes: tuple[tuple[str, int], ...]  # cluster startup nodes, or Sentinels; () standalone
    service: str | None = None  # sentinel: the primary's name
    db: int = 0
    username: str | None = None
    password: str | None = None
    ssl: bool = False
    sentinel_username: str | None = None
    sentinel_password: str | None = None

    @property
    def ports(self) -> set[int]:
        """The TCP ports this target's servers listen on (never a worker's)."""
        if self.kind != "standalone":
            return {port for _, port in self.nodes}
        parts = urlsplit(self.url)
        if parts.scheme == "unix":
            return set()
        return {parts.port or 6379}


def _nodes(netloc_hosts: str, default_port: int, url: str) -> tuple[tuple[str, int], ...]:
    nodes = []
    for item in netloc_hosts.split(","):
        item = item.strip()
        if not item:
            raise ValueError(f"empty host in the Redis URL {redact_redis_url(url)!r}")
        parts = urlsplit(f"//{item}")
        try:
            port = parts.port or default_port
        except ValueError:
            raise ValueError(f"bad port in {item!r} (Redis URL)") from None
        if not parts.hostname:
            raise ValueError(f"no host in {item!r} (Redis URL)")
        nodes.append((parts.hostname, port))
    return tuple(nodes)


def parse_redis_url(url: str) -> RedisTarget:
    """The target ``url`` names; ValueError naming the accepted forms if it is none."""
    scheme = url.partition("://")[0].lower() if "://" in url else ""
    if scheme not in _SCHEMES:
        raise ValueError(
            "redis_url must start with redis://, rediss:// or unix:// (one server), "
            "redis+cluster:// (Redis Cluster) or redis+sentinel:// (Sentinel; rediss+... for "
            "TLS), e.g. redis+sentinel://sentinel-0:26379,sentinel-1:26379/mymaster"
        )
    kind, ssl = _SCHEMES[scheme]
    if kind == "standalone":
        return RedisTarget("standalone", url, (), ssl=ssl)
    rest = url.split("://", 1)[1]
    netloc, _, tail = rest.partition("/")
    path, _, query = tail.partition("?")
    userinfo, at, hosts = netloc.rpartition("@")
    username = password = None
    if at:
        user, colon, secret = userinfo.partition(":")
        username = unquote(user) or None
        password = unquote(secret) if colon else None
    params = {k: v[-1] for k, v in parse_qs(query, keep_blank_values=True).items()}
    if kind == "cluster":
        if path.strip("/") not in ("", "0"):
            raise ValueError("Redis Cluster has database 0 only: drop the /db from redis_url")
        if params:
            raise ValueError(f"redis+cluster:// takes no query parameters, got {sorted(params)}")
        return RedisTarget(
            "cluster", url, _nodes(hosts, 6379, url), username=username, password=password, ssl=ssl
        )
    unknown = set(params) - _SENTINEL_PARAMS
    if unknown:
        raise ValueError(
            f"redis+sentinel:// takes {sorted(_SENTINEL_PARAMS)} as query parameters, got "
            f"{sorted(unknown)}"
        )
    segments = [s for s in path.split("/") if s]
    if not segments or len(segments) > 2:
        raise ValueError(
            "redis+sentinel:// needs the primary's service name as its path: "
            "redis+sentinel://host:26379[,host:26379]/mymaster[/db]"
        )
    try:
        db = int(segments[1]) if len(segments) == 2 else 0
    except ValueError:
        raise ValueError(f"the database in redis_url must be a number: {segments[1]!r}") from None
    return RedisTarget(
        "sentinel",
        url,
        _nodes(hosts, 26379, url),
        service=unquote(segments[0]),
        db=db,
        username=username,
        password=password,
        ssl=ssl,
        sentinel_username=params.get("sentinel_username") or None,
        sentinel_password=params.get("sentinel_password") or None,
    )


def redact_redis_url(url: str) -> str:
    """``url`` with its passwords (the data nodes' and the Sentinels') replaced by ``***``."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    netloc, slash, tail = rest.partition("/")
    userinfo, at, hosts = netloc.rpartition("@")
    if at and ":" in userinfo:
        userinfo = userinfo.partition(":")[0] + ":***"
    path, question, query = tail.partition("?")
    if query:
        pairs = [p.partition("=") for p in query.split("&")]
        hidden = [(k, e, "***" if k.endswith("password") and v else v) for k, e, v in pairs]
        query = "&".join(k + e + v for k, e, v in hidden)
    return f"{scheme}{sep}{userinfo}{at}{hosts}{slash}{path}{question}{query}"


class ClusterClient(RedisCluster):
    r"""redis-py's cluster client, whose failures are all ``RedisError``\s.

    redis-py raises ``RedisClusterException`` (not a ``RedisError``) when no node of the
    cluster answers, or when a slot is not covered; here it is a ``ClusterError``, so the
    router's stores treat it as what it is, Redis being unavailable, as they treat a lost
    single server (fall back, count, reconnect).
    """

    async def initialize(self, *args: Any, **kwargs: Any) -> ClusterClient:
        try:
            await super().initialize(*args, **kwargs)
        except RedisClusterException as exc:
            raise ClusterError(str(exc)) from exc
        return self

    async def execute_command(self, *args: EncodableT, **kwargs: Any) -> Any:
        try:
            return await super().execute_command(*args, **kwargs)
        except RedisClusterException as exc:
            raise ClusterError(str(exc)) from exc


def connect(url: str, **options: Any) -> RedisClient:
    """An asyncio client for ``url`` (not connected yet: the first command connects).

    ``options`` are redis-py's connection keywords (``socket_timeout``,
    ``socket_connect_timeout``, ``health_check_interval``, ...); they apply to every server
    of the target, the Sentinels' sockets included.
    """
    target = parse_redis_url(url)
    if target.kind == "standalone":
        return aioredis.Redis.from_url(url, **options)
    auth: dict[str, Any] = {"username": target.username, "password": target.password}
    if target.kind == "cluster":
        return ClusterClient(
            startup_nodes=[ClusterNode(host, port) for host, port in target.nodes],
            ssl=target.ssl,
            **auth,
            **options,
        )
    sentinel_kwargs = {k: v for k, v in options.items() if k.startswith("socket_")}
    if target.sentinel_password is not None:
        sentinel_kwargs["password"] = target.sentinel_password
    if target.sentinel_username is not None:
        sentinel_kwargs["username"] = target.sentinel_username
    if target.ssl:
        sentinel_kwargs["ssl"] = True
    # Older redis-py leaves it untyped; newer releases type it (the ignore then goes unused).
    sentinel = Sentinel(  # type: ignore[no-untyped-call,unused-ignore]
        list(target.nodes), sentinel_kwargs=sentinel_kwargs, **options
    )
    if target.service is None:  # parse_redis_url gives every Sentinel target one
        raise ValueError("redis+sentinel:// needs the primary's service name")
    client: aioredis.Redis = sentinel.master_for(
        target.service, db=target.db, ssl=target.ssl, **auth
    )
    return client


async def drop_connections(client: RedisClient) -> None:
    """Close every pooled connection, so that the next command connects afresh: to the
    server's new address after a failover (Sentinel asks again on connect), or to the
    cluster's current nodes (a cluster client reloads its slot map)."""
    if isinstance(client, RedisCluster):
        await client.aclose()  # the next command initializes it again
    else:
        await client.connection_pool.disconnect()


def key_prefix(cluster: str) -> str:
    """Every shared key of namespace ``cluster`` starts with this: ``kvroute:{cluster}:``.

    The braces are a Redis Cluster hash tag (one slot for the whole namespace), so
    ``cluster`` must be non-empty and hold no brace (``Settings`` checks it).
    """
    return "kvroute:{" + cluster + "}:"
