#!/usr/bin/env bash
# Create (or reuse) the project's virtual environment with the verified petals recipe.
# Usage: scripts/bootstrap.sh [VENV_DIR]   (default .venv). Idempotent: a stamp file records the inputs.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${1:-.venv}
PY=${PYTHON:-python3}
STAMP="$VENV/.chainswarm-stamp"
want=$(cat requirements.txt requirements-dev.txt requirements-experiments.txt scripts/bootstrap.sh pyproject.toml | sha256sum | cut -d' ' -f1)
if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ]; then
  exit 0
fi
echo "[bootstrap] building $VENV (torch + petals recipe; about 2 minutes on first use)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
LOG="$VENV/bootstrap.log"
: > "$LOG"
pip_install() {  # quiet unless it fails; the full output stays in $LOG
  if ! "$VENV/bin/python" -m pip --disable-pip-version-check install "$@" >>"$LOG" 2>&1; then
    tail -n 40 "$LOG" >&2; echo "[bootstrap] pip install failed; see $LOG" >&2; exit 1
  fi
}
# torch first: 2.13.0 is the CPU wheel on the development machines, a CUDA build on GPU hosts.
echo "[bootstrap] 1/3 torch"
pip_install "torch==${TORCH_VERSION:-2.13.0}"
# petals' own pins cannot be satisfied (hivemind 1.1.10.post2 does not build): install it without deps.
echo "[bootstrap] 2/3 petals (without its unbuildable pins)"
pip_install --no-deps petals==2.2.0.post1 tensor_parallel==1.0.23 bitsandbytes==0.41.1
echo "[bootstrap] 3/3 hivemind 1.1.12, transformers 4.34.1, the experiments extra and the rest"
pip_install -r requirements.txt -r requirements-dev.txt -r requirements-experiments.txt
pip_install --no-deps -e .
echo "$want" > "$STAMP"
echo "[bootstrap] ready: $VENV"
