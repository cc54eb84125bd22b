"""Registration through SGLang's plugin loader, the factory, and the refusals."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from importlib.metadata import entry_points
from types import SimpleNamespace
from typing import Any

import pytest
import sglang
from sglang.srt.mem_cache import registry
from sglang.srt.mem_cache.registry import (
    TreeCacheBuildContext,
    create_tree_cache,
    get_radix_cache_factory,
    registered_radix_cache_backends,
)
from sglang.srt.plugins import load_plugins
from sglang.srt.runtime_context import publish, reset_context
from sglang.srt.server_args import ServerArgs, prepare_server_args
from sglang_harness import TrackingAllocator, cache_params

from engine_ext import sglang_plugin
from engine_ext.cache import kernels
from engine_ext.sglang_rlt import (
    SEED_ENV_VAR,
    RLTRadixCache,
    build_rlt_radix_cache,
    check_sglang_version,
)


@pytest.fixture(scope="module")
def server_args() -> ServerArgs:
    args = prepare_server_args(
        [
            "--model-path",
            "dummy",  # parsed, never loaded
            "--radix-cache-backend",
            "rlt",
            "--radix-eviction-policy-config",
            '{"seed": 5, "log_every": 3}',
        ]
    )
    assert isinstance(args, ServerArgs)
    return args


def build_context(server_args: Any, capacity: int = 64, **flags: Any) -> TreeCacheBuildContext:
    """What SGLang's scheduler hands a registered factory, with a mock KV allocator."""
    params = cache_params(
        TrackingAllocator(capacity),
        eviction_policy_config=getattr(server_args, "radix_eviction_policy_config", None),
    )
    fields: dict[str, Any] = {
        "is_hybrid_swa": False,
        "is_hybrid_ssm": False,
        "enable_hierarchical_cache": False,
        "disable_radix_cache": False,
    }
    fields.update(flags)
    return TreeCacheBuildContext(
        server_args=server_args,
        params=params,
        tp_worker=None,
        model_config=None,
        tp_size=1,
        tp_rank=0,
        tp_group=None,
        **fields,
    )


def plain_args(**overrides: Any) -> SimpleNamespace:
    fields: dict[str, Any] = {"random_seed": None, "radix_eviction_policy_config": None}
    fields.update(overrides)
    return SimpleNamespace(**fields)


# -- discovery and registration -----------------------------------------------------------------
def test_the_entry_point_is_declared() -> None:
    found = {ep.name: ep.value for ep in entry_points(group="sglang.srt.plugins")}
    assert found.get("kvroute-rlt") == "engine_ext.sglang_plugin:register"


def test_load_plugins_registers_rlt() -> None:
    load_plugins()
    assert "rlt" in registered_radix_cache_backends()
    assert get_radix_cache_factory("rlt") is sglang_plugin.build_cache


def test_register_is_idempotent() -> None:
    sglang_plugin.register()
    sglang_plugin.register()
    assert registered_radix_cache_backends().count("rlt") == 1


def test_register_refuses_a_foreign_backend_named_rlt(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry._RADIX_CACHE_REGISTRY, "rlt", lambda ctx: None)
    with pytest.raises(ValueError, match="already registered as 'rlt'"):
        sglang_plugin.register()


def test_server_args_parse(server_args: ServerArgs) -> None:
    assert server_args.radix_cache_backend == "rlt"
    assert server_args.radix_eviction_policy_config == {"seed": 5, "log_every": 3}


@pytest.fixture
def published(server_args: ServerArgs) -> Iterator[ServerArgs]:
    publish(server_args, role="scheduler")
    try:
        yield server_args
    finally:
        reset_context()


def test_sglang_create_tree_cache_builds_ours(published: ServerArgs) -> None:
    """SGLang's own dispatcher, with its post-factory checks, picks the registered backend."""
    sglang_plugin.register()
    cache = create_tree_cache(build_context(published, capacity=96))
    assert isinstance(cache, RLTRadixCache)
    assert (cache.capacity_tokens, cache.seed, cache.log_every) == (96, 5, 3)


# -- the factory --------------------------------------------------------------------------------
def test_factory_builds_from_a_context(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="engine_ext.sglang_rlt"):
        cache = sglang_plugin.build_cache(build_context(plain_args(), capacity=80))
    assert isinstance(cache, RLTRadixCache)
    assert cache.capacity_tokens == 80
    active = [r for r in caplog.records if "RLT radix cache active" in r.getMessage()]
    assert len(active) == 1
    assert "capacity 80 tokens" in active[0].getMessage()
    loops = "compiled" if kernels.COMPILED else "in Python"
    assert f"eviction loops {loops}" in active[0].getMessage()  # operators see the fast path


@pytest.mark.parametrize(
    ("flags", "args", "reason"),
    [
        ({"is_hybrid_swa": True}, {}, "sliding-window"),
        ({"is_hybrid_ssm": True}, {}, "Mamba"),
        ({"enable_hierarchical_cache": True}, {}, "hierarchical"),
        ({"disable_radix_cache": True}, {}, "disable-radix-cache"),
        ({"is_dsa": True}, {}, "DSA"),
        ({}, {"enable_lmcache": True}, "lmcache"),
        ({}, {"enable_flexkv": True}, "flexkv"),
        ({}, {"disaggregation_decode_retraction_backup": "host_pool"}, "host-pool"),
    ],
)
def test_unsupported_configurations_are_refused(
    flags: dict[str, Any], args: dict[str, Any], reason: str
) -> None:
    with pytest.raises(ValueError, match=reason):
        build_rlt_radix_cache(build_context(plain_args(**args), **flags))


def test_unknown_config_keys_are_refused() -> None:
    ctx = build_context(plain_args(radix_eviction_policy_config={"protected_threshold": 4}))
    with pytest.raises(ValueError, match="protected_threshold"):
        build_rlt_radix_cache(ctx)


def test_another_eviction_policy_is_ignored_with_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    ctx = build_context(plain_args())
    ctx.params.eviction_policy = "lfu"
    with caplog.at_level(logging.WARNING, logger="engine_ext.sglang_rlt"):
        assert isinstance(build_rlt_radix_cache(ctx), RLTRadixCache)
    assert "lfu is ignored" in caplog.text


def test_seed_sources_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    def seed_of(config: Any, random_seed: Any) -> int:
        args = plain_args(radix_eviction_policy_config=config)
        args.random_seed = random_seed
        return build_rlt_radix_cache(build_context(args)).seed

    monkeypatch.delenv(SEED_ENV_VAR, raising=False)
    assert seed_of(None, None) == 0
    assert seed_of(None, 11) == 11  # SGLang's --random-seed
    monkeypatch.setenv(SEED_ENV_VAR, "22")
    assert seed_of(None, 11) == 22
    assert seed_of({"seed": 33}, 11) == 33
    monkeypatch.setenv(SEED_ENV_VAR, "x")
    with pytest.raises(ValueError, match="integer"):
        seed_of(None, None)


# -- versions -------------------------------------------------------------------------------------
@pytest.mark.parametrize("version", ["0.5.23", "0.5.0", "0.5.24rc1"])
def test_supported_versions(version: str) -> None:
    check_sglang_version(version)


@pytest.mark.parametrize("version", ["0.4.6", "0.6.0", "1.0.0", "0.50.1"])
def test_other_versions_are_refused(version: str) -> None:
    with pytest.raises(ValueError, match=r"supports SGLang 0\.5\.x"):
        check_sglang_version(version)


def test_a_mismatched_install_is_refused_at_build(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sglang, "__version__", "0.6.0")
    with pytest.raises(ValueError, match=r"found sglang 0\.6\.0"):
        build_rlt_radix_cache(build_context(plain_args()))
    with pytest.raises(ValueError, match=r"found sglang 0\.6\.0"):
        RLTRadixCache(cache_params(TrackingAllocator(8)))


def test_factory_reads_the_marking_and_refuses_an_unknown_one() -> None:
    split = plain_args(radix_eviction_policy_config={"marking": "split"})
    cache = sglang_plugin.build_cache(build_context(split, capacity=80))
    assert isinstance(cache, RLTRadixCache)
    assert cache.marking == "split"
    plain = sglang_plugin.build_cache(build_context(plain_args(), capacity=80))
    assert isinstance(plain, RLTRadixCache)
    assert plain.marking == "path"
    wrong = plain_args(radix_eviction_policy_config={"marking": "all"})
    with pytest.raises(ValueError, match="unknown marking 'all'; known: path, split"):
        sglang_plugin.build_cache(build_context(wrong, capacity=80))
