"""The one build step pyproject.toml cannot say in stable terms: RLT's per-eviction loops in
C (``engine_ext/cache/kernels.py``). The extension is optional: an install without a C
compiler still works, RLT then running its reference loop (``kernels.COMPILED`` says which).
``KVROUTE_PURE=1`` leaves it out on purpose: a pure wheel for any CPython (e.g. one carried
to a machine whose Python differs, ``scripts/gpu_wheels.sh``)."""

import os

from setuptools import Extension, setup

kernels = Extension(
    "engine_ext.cache._kernels",
    sources=["engine_ext/cache/_kernels.c"],
    optional=True,
)
setup(ext_modules=[] if os.environ.get("KVROUTE_PURE") == "1" else [kernels])
