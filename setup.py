"""The one build step pyproject.toml cannot say in stable terms: RLT's per-eviction loops in
C (``engine_ext/cache/kernels.py``). The extension is optional: an install without a C
compiler still works, with the same loops in numpy (``kernels.COMPILED`` says which)."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "engine_ext.cache._kernels",
            sources=["engine_ext/cache/_kernels.c"],
            # first_round decides as leaf_sampling does in Python: no fused multiply-adds
            extra_compile_args=["-ffp-contract=off"],
            optional=True,
        )
    ]
)
