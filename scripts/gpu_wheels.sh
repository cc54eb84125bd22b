#!/usr/bin/env bash
# Wheels for scripts/gpu_engine_check.sh on a GPU machine that cannot reach a package index.
#
# Downloads into ./.whl (git-ignored through .git/info/exclude, never committed) SGLang 0.5.23
# and the packages it imports that a stock PyTorch image lacks, at the versions of the engine
# virtualenv (scripts/test_engine.sh builds it), for the GPU machine's Python (default 3.12),
# plus a wheel of kvroute itself (the plugin's entry point). About 55 MB.
#
#   scripts/gpu_wheels.sh [python-version]
set -euo pipefail
cd "$(dirname "$0")/.."
PYVER="${1:-3.12}"
VENV="${KVROUTE_ENGINE_VENV:-$HOME/.cache/kvroute/venv-engine}"
NAMES="sglang apache-tvm-ffi compressed-tensors dill gguf loguru msgspec orjson pybase64 pydantic
pydantic-core annotated-types typing-inspection pyzmq starlette truststore ipython
ipython-pygments-lexers traitlets jedi parso matplotlib-inline pexpect ptyprocess prompt-toolkit
wcwidth stack-data asttokens executing pure-eval decorator sniffio openai jiter distro
partial-json-parser setproctitle httpx2 httpcore2"
frozen=$("$VENV/bin/python" -m pip freeze | tr '[:upper:]_' '[:lower:]-')
specs=()
for name in $NAMES; do
  spec=$(grep -E "^${name}==" <<< "$frozen" || true)
  specs+=("${spec:-$name}")
done
mkdir -p .whl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$PYVER" \
  --implementation cp -d .whl \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  "${specs[@]}"
rm -f .whl/kvroute-*.whl
# A pure wheel (no C loops: they would tie it to this machine's Python); the check builds
# them on the GPU machine if it can.
KVROUTE_PURE=1 "${PYTHON:-.venv/bin/python}" -m pip wheel -q --no-deps --no-build-isolation . -w .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
du -sh .whl
