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
echo "[bootstrap] building $VENV (torch + petals recipe; about a minute on first use)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
LOG="$VENV/bootstrap.log"
: > "$LOG"
pip_install() {  # quiet unless it fails; the full output stays in $LOG
  if ! "$VENV/bin/python" -m pip --disable-pip-version-check install "$@" >>"$LOG" 2>&1; then
    tail -n 40 "$LOG" >&2; echo "[bootstrap] pip install failed; see $LOG" >&2; exit 1
  fi
}
# The installer: uv, which installs the same versions as pip here (`pip freeze` compared) in about a third of the
# time (the whole bootstrap: about 80 s with pip, 30 s with uv); pip where uv cannot be installed. uv reads no pip
# configuration, so a local wheel directory (PIP_FIND_LINKS: this machine's torch file) is passed on. No bytecode
# is compiled here: of the ~15,000 modules installed, a run imports ~3,000, which Python compiles and caches as
# they are first imported (the Makefile lets it, where PYTHONDONTWRITEBYTECODE is set); compiling them all took
# 30 CPU-s of every fresh clone's `make test`.
UV_VERSION=0.13.9
if "$VENV/bin/python" -m pip --disable-pip-version-check install "uv==$UV_VERSION" >>"$LOG" 2>&1; then
  install() {
    if ! "$VENV/bin/uv" pip install --python "$VENV/bin/python" \
        ${PIP_FIND_LINKS:+--find-links "$PIP_FIND_LINKS"} "$@" >>"$LOG" 2>&1; then
      tail -n 40 "$LOG" >&2; echo "[bootstrap] uv pip install failed; see $LOG" >&2; exit 1
    fi
  }
else
  echo "[bootstrap] uv could not be installed: installing with pip (slower)"
  install() { pip_install "$@"; }
fi
# torch first: 2.13.0 is the CPU wheel on the development machines, a CUDA build on GPU hosts.
echo "[bootstrap] 1/3 torch"
install "torch==${TORCH_VERSION:-2.13.0}"
# petals' own pins cannot be satisfied (hivemind 1.1.10.post2 does not build): install it without deps.
echo "[bootstrap] 2/3 petals (without its unbuildable pins)"
install --no-deps petals==2.2.0.post1 tensor_parallel==1.0.23 bitsandbytes==0.41.1
echo "[bootstrap] 3/3 hivemind 1.1.12, transformers 4.34.1, the experiments extra and the rest"
install -r requirements.txt -r requirements-dev.txt -r requirements-experiments.txt
install --no-deps -e .  # the project itself, editable (uv: ~1.7 s against pip's ~4.5 s)
echo "$want" > "$STAMP"
echo "[bootstrap] ready: $VENV"
