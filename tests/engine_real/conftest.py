"""The real-engine tier: SGLang (and vLLM) serving a tiny model on a CPU behind kvroute.

Runs only through ``scripts/test_real_engine.sh``, which builds the engines' virtualenvs and
the tiny model first (``scripts/real_engine_setup.sh --vllm``); the main test run never
collects this directory (``--ignore`` in ``pyproject.toml``). The tests themselves run in the
main virtualenv, as a user's router and clients would: the router is ``kvroute serve``, the
clients are ``openai`` and aiohttp, and the engines run as separate processes from their own
virtualenvs (``kvroute.engine_launch``). Only loopback addresses are used, and nothing is
downloaded.

Two CPU-bound servers share two cores: each module starts its workers and stops them before
the next module's start (module-scoped fixtures), with one OpenMP thread each.
"""
