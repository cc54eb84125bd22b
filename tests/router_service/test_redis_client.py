"""Redis URLs for one server, a Redis Cluster and Sentinel (router_service.redis_client), and
the settings that use them."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis
from redis.exceptions import RedisError
from router_harness import service_settings

from router_service.redis_client import (
    ClusterClient,
    connect,
    key_prefix,
    parse_redis_url,
    redact_redis_url,
)
from router_service.settings import SettingsError, load_settings


def test_one_server_urls_pass_through_as_redis_py_reads_them() -> None:
    target = parse_redis_url("rediss://user:pw@cache:6380/2")
    assert (target.kind, target.ssl, target.nodes, target.ports) == ("standalone", True, (), {6380})
    assert parse_redis_url("redis://cache").ports == {6379}
    assert parse_redis_url("unix:///run/redis.sock").ports == set()


def test_cluster_urls_list_startup_nodes_with_default_ports() -> None:
    target = parse_redis_url("redis+cluster://:s3cret@node-0:7000,node-1,[fd00::3]:7002")
    assert target.kind == "cluster"
    assert target.nodes == (("node-0", 7000), ("node-1", 6379), ("fd00::3", 7002))
    assert (target.username, target.password) == (None, "s3cret")
    assert target.ports == {7000, 6379, 7002}
    with pytest.raises(ValueError, match="database 0 only"):
        parse_redis_url("redis+cluster://node-0:7000/3")


def test_sentinel_urls_name_the_service_the_db_and_the_sentinels_own_credentials() -> None:
    target = parse_redis_url(
        "rediss+sentinel://app:pw@s-0,s-1:26380/kv-primary/4"
        "?sentinel_username=watch&sentinel_password=spw"
    )
    assert target.kind == "sentinel"
    assert target.nodes == (("s-0", 26379), ("s-1", 26380))
    assert (target.service, target.db, target.ssl) == ("kv-primary", 4, True)
    assert (target.username, target.password) == ("app", "pw")
    assert (target.sentinel_username, target.sentinel_password) == ("watch", "spw")
    with pytest.raises(ValueError, match="service name"):
        parse_redis_url("redis+sentinel://s-0:26379")
    with pytest.raises(ValueError, match="query parameters"):
        parse_redis_url("redis+sentinel://s-0/kv?password=x")
    with pytest.raises(ValueError, match="must be a number"):
        parse_redis_url("redis+sentinel://s-0/kv/zero")
    with pytest.raises(ValueError, match="redis\\+sentinel://"):
        parse_redis_url("sentinel://s-0/kv")  # kombu's spelling: not redis-py's


def test_redaction_hides_every_password() -> None:
    url = "redis+sentinel://app:pw@s-0:26379/kv?sentinel_password=spw&sentinel_username=u"
    assert redact_redis_url(url) == (
        "redis+sentinel://app:***@s-0:26379/kv?sentinel_password=***&sentinel_username=u"
    )
    assert redact_redis_url("redis://cache:6379/0") == "redis://cache:6379/0"
    settings = service_settings(redis_url=url)
    assert "pw" not in str(settings.redacted()["redis_url"]).replace("***", "")


def test_keys_carry_the_namespace_as_a_cluster_hash_tag() -> None:
    assert key_prefix("prod") + "load:http://w:1" == "kvroute:{prod}:load:http://w:1"
    for bad in ("", "a{b", "}x"):
        with pytest.raises(SettingsError, match="without braces"):
            load_settings(cluster=bad)


def test_the_allow_list_refuses_every_redis_and_sentinel_port() -> None:
    settings = service_settings(
        redis_url="redis+sentinel://10.0.0.5:26380,10.0.0.6:26381/kv",
        allowed_worker_networks=["10.0.0.0/8"],
    )
    assert settings.accepted_worker("http://10.0.0.7:26380") is None
    assert settings.accepted_worker("http://10.0.0.7:26381") is None
    assert settings.accepted_worker("http://10.0.0.7:30000") == "http://10.0.0.7:30000"


def test_clients_match_the_url_and_a_dead_cluster_is_a_redis_error() -> None:
    async def scenario() -> None:
        one = connect("redis://127.0.0.1:1/0")
        sentinel = connect("redis+sentinel://127.0.0.1:1/kv")
        cluster = connect(
            "redis+cluster://127.0.0.1:1", socket_connect_timeout=0.2, socket_timeout=0.2
        )
        assert type(one) is aioredis.Redis
        assert type(sentinel) is aioredis.Redis
        assert "SentinelConnectionPool" in type(sentinel.connection_pool).__name__
        assert isinstance(cluster, ClusterClient)
        # No node answers: the stores' usual failure (they fall back), not redis-py's
        # RedisClusterException, which is no RedisError.
        with pytest.raises(RedisError, match="cannot be connected"):
            await cluster.ping()
        for client in (one, sentinel, cluster):
            await client.aclose()

    asyncio.run(scenario())
