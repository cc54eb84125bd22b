"""SGLang plugin entry point: registers the ``rlt`` radix-cache backend.

Declared in ``pyproject.toml`` under the entry-point group ``sglang.srt.plugins``, so
SGLang's ``load_plugins()`` calls ``register()`` in every server process at start-up, and
``python -m sglang.launch_server ... --radix-cache-backend rlt`` then selects
``engine_ext.sglang_rlt.RLTRadixCache``. SGLang is imported only when ``register()`` runs
and the cache module only when SGLang builds the cache, so importing this module is free.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BACKEND_NAME", "build_cache", "register"]

BACKEND_NAME = "rlt"


def build_cache(ctx: Any) -> Any:
    """The registered factory: SGLang's ``TreeCacheBuildContext`` -> ``RLTRadixCache``."""
    from engine_ext.sglang_rlt import build_rlt_radix_cache

    return build_rlt_radix_cache(ctx)


def register() -> None:
    """Register ``rlt`` with SGLang's radix-cache registry; a second call does nothing.

    SGLang's registry refuses duplicate names, and ``load_plugins()`` may run more than once
    per process (it guards itself, but tests and embedders call ``register()`` directly).
    A *different* factory already registered as ``rlt`` is refused loudly.
    """
    from sglang.srt.mem_cache.registry import (
        get_radix_cache_factory,
        register_radix_cache_backend,
    )

    existing = get_radix_cache_factory(BACKEND_NAME)
    if existing is build_cache:
        return
    if existing is not None:
        raise ValueError(
            f"another radix cache backend is already registered as {BACKEND_NAME!r} "
            f"({existing!r}); kvroute's RLT backend cannot take its name"
        )
    register_radix_cache_backend(BACKEND_NAME, build_cache)
