#!/usr/bin/env bash
# Regenerate tests/data/goldens/ with a CURRENT transformers in a throwaway virtual environment.
# The project's own .venv pins transformers 4.34.1 and is neither used nor touched.
#
# Usage: bash scripts/goldens/make_family_goldens.sh [extra args for make_family_goldens.py]
# Env:   GOLDENS_VENV    venv dir (default /tmp/chainswarm-goldens-venv; reused if it already works)
#        TORCH_VERSION   torch to install (default: what .venv reports, else 2.13.0; on the dev machines
#                        pip's find-links supply the +cpu wheel of that version)
#        TRANSFORMERS_SPEC  pip requirement for transformers (default 'transformers>=4.50': newest that installs)
#        PYTHON          interpreter for the venv (default python3)
set -euo pipefail
cd "$(dirname "$0")/../.."
VENV=${GOLDENS_VENV:-/tmp/chainswarm-goldens-venv}
PY=${PYTHON:-python3}
if [ -z "${TORCH_VERSION:-}" ] && [ -x .venv/bin/pip ]; then
  TORCH_VERSION=$(.venv/bin/pip show torch 2>/dev/null | sed -n 's/^Version: //p' | sed 's/+.*//')
fi
TORCH_VERSION=${TORCH_VERSION:-2.13.0}
TRANSFORMERS_SPEC=${TRANSFORMERS_SPEC:-transformers>=4.50}

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
echo "[goldens] venv $VENV: installing torch==$TORCH_VERSION, $TRANSFORMERS_SPEC, safetensors, tokenizers"
"$VENV/bin/python" -m pip install --disable-pip-version-check -q \
  "torch==$TORCH_VERSION" "$TRANSFORMERS_SPEC" safetensors tokenizers 2>&1 \
  | grep -v "^WARNING: Location .* is ignored" || true
"$VENV/bin/python" - <<'PY'
import sys, torch, transformers, tokenizers, safetensors
assert tuple(int(x) for x in transformers.__version__.split(".")[:2]) >= (4, 50), transformers.__version__
print(f"[goldens] python {sys.version.split()[0]}  torch {torch.__version__}  transformers {transformers.__version__}  "
      f"tokenizers {tokenizers.__version__}  safetensors {safetensors.__version__}")
PY
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false HF_HUB_DISABLE_PROGRESS_BARS=1 \
  TRANSFORMERS_VERBOSITY=error \
  "$VENV/bin/python" scripts/goldens/make_family_goldens.py "$@"
echo "[goldens] total size: $(du -sh tests/data/goldens | cut -f1)"
