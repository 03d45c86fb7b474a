#!/usr/bin/env bash
# GPU check (run on a device machine: Python with torch + CUDA, no package registry needed).
# 1. the family goldens through Chainswarm's block code on CUDA in float32/float16/bfloat16 (scripts/device_check.py),
#    then the block's step times with both attention strategies (swarm/model/attention.py; SKIP_GOLDENS=1: only these);
# 2. the honest spreads of real-model spans on CUDA against CPU float32, behind the spot checks' tolerance
#    (scripts/spread_check.py; needs the bundle made here by `spread_check.py --make-bundle .spread`, carried);
# 3. two swarms (vanilla petals 2.2 servers and Chainswarm nodes, on CUDA) and the orchestrator's HTTP API, by
#    bench_batching, on a random-weight model of SmolLM2-135M's shape (the real checkpoint's 98 MB GGUF does not fit
#    the tool's 64 MiB beside the wheelhouse): needs the pinned stack for that machine's Python carried in .whl/
#    (scripts/device_wheelhouse.sh makes it; docs/models.md, "GPU check"). SKIP_GOLDENS=1 runs only this part (SKIP_BATCHING=1 skips it).
# 4. with the real SmolLM2 GGUF in three carried parts (.m1/part .m2/part .m3/part, left by three calls:
#    device_wheelhouse.sh --model-parts), bench_speculative on the real model (sha256 checked by the model store).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
rc=0
if [ "${SKIP_GOLDENS:-0}" != 1 ]; then
  python3 scripts/device_check.py || rc=1
else  # the block's step times alone (both attention strategies, decode and verification steps): seconds
  python3 scripts/device_check.py --verification-steps || rc=1
fi
if [ -d .spread ]; then
  python3 scripts/spread_check.py --bundle .spread || rc=1
else
  echo "no .spread bundle: the spread part of the check is skipped"
fi
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PWD HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HIVEMIND_LOGLEVEL=WARNING || exit 1
  if [ "${SKIP_BATCHING:-0}" != 1 ]; then
    python3 -m swarm.cli make-model --out /tmp/smollm2-shape --layers 30 --hidden 576 --heads 9 --kv-heads 3 \
      --vocab 49152 --max-length 2048 || exit 1
    timeout -k 10 "${SWARM_TIMEOUT_S:-420}" python3 -m experiments.bench.batching --model /tmp/smollm2-shape \
      --sessions 1,8,16 --tokens 32 --repeats 1 --http-layouts user --out "${OUT:-/tmp}/bench_batching_gpu.json" || rc=1
    # the same HTTP rows with the chain's sessions in two lanes (--batch-lanes 2), stored beside them
    timeout -k 10 180 python3 -m experiments.bench.batching --model /tmp/smollm2-shape --only-http user --http-lanes 2 \
      --sessions 1,8,16 --tokens 32 --repeats 1 --out "${OUT:-/tmp}/bench_batching_gpu.json" || rc=1
  fi
  if [ -f .m1/part ] && [ -f .m2/part ] && [ -f .m3/part ]; then
    export CHAINSWARM_CACHE=/tmp/chainswarm-cache
    src="$CHAINSWARM_CACHE/sources/smollm2-135m-instruct"
    mkdir -p "$src" && cat .m1/part .m2/part .m3/part > "$src/SmolLM2-135M-Instruct.Q4_1.gguf"
    timeout -k 10 "${SPEC_TIMEOUT_S:-300}" python3 -m experiments.bench.speculative --sessions 1,16 \
      --out "${OUT:-/tmp}/bench_speculative_gpu.json" || rc=1
    # SPEC_K16=1: one session again with up to 16 drafts a step (the drafting replay, experiments/bench/drafting.py,
    # puts summaries at 0.50x there when verification is free, against 0.56x with the default 8)
    # SPEC_MAX_BATCH=N: 16 sessions again with servers at --max-batch N (a GPU server's batch bound, which lets
    # a chain step carry drafts at 16 sessions: docs/speculative.md, "how many")
    if [ -n "${SPEC_MAX_BATCH:-}" ]; then
      timeout -k 10 "${SPEC_TIMEOUT_S:-300}" python3 -m experiments.bench.speculative --sessions 16 --repeats 1 \
        --max-batch "$SPEC_MAX_BATCH" --out "${OUT:-/tmp}/bench_speculative_gpu_mb${SPEC_MAX_BATCH}.json" || rc=1
    fi
    if [ "${SPEC_K16:-0}" = 1 ]; then
      timeout -k 10 "${SPEC_TIMEOUT_S:-300}" python3 -m experiments.bench.speculative --sessions 1 --speculative-k 16 \
        --out "${OUT:-/tmp}/bench_speculative_gpu_k16.json" || rc=1
    fi
  fi
else
  echo "no wheelhouse in .whl/: the swarm part of the check is skipped"
fi
exit $rc
