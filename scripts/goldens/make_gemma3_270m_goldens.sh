#!/usr/bin/env bash
# Goldens for the real Gemma 3 270M (tests/data/goldens/gemma3-270m/golden.json) with a CURRENT transformers.
# 1. fetch + convert the model with the project's .venv (cached; float32), 2. run the golden script in the
# throwaway venv that make_family_goldens.sh builds (GOLDENS_VENV, default /tmp/chainswarm-goldens-venv).
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${GOLDENS_VENV:-/tmp/chainswarm-goldens-venv}
if ! "$VENV/bin/python" -c "import transformers, torch" 2>/dev/null; then
  echo "[goldens] no working $VENV: run scripts/goldens/make_family_goldens.sh once first (it builds the venv)" >&2
  exit 2
fi
.venv/bin/python -m swarm.cli fetch-model gemma-3-270m --dtype float32
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false TRANSFORMERS_VERBOSITY=error \
  "$VENV/bin/python" scripts/goldens/make_gemma3_270m_goldens.py "$@"
