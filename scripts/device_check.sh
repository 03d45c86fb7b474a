#!/usr/bin/env bash
# GPU check (run on a device machine: Python with torch + CUDA, no package registry needed).
# 1. the family goldens through Chainswarm's block code on CUDA in float32/float16/bfloat16 (scripts/device_check.py);
# 2. the honest spreads of real-model spans on CUDA against CPU float32, behind the spot checks' tolerance
#    (scripts/spread_check.py; needs the bundle made here by `spread_check.py --make-bundle .spread`, carried);
# 3. a 3-server swarm and bench_batching need the pinned stack (petals 2.2, hivemind 1.1.12, transformers 4.34)
#    for that machine's Python: run only when a wheelhouse is carried in .whl/ (docs/models.md, "GPU check").
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
python3 scripts/device_check.py
rc=$?
if [ -d .spread ]; then
  python3 scripts/spread_check.py --bundle .spread || rc=1
else
  echo "no .spread bundle: the spread part of the check is skipped"
fi
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
  python3 -m experiments.bench.batching --sessions 1,8,16 --tokens 32 || rc=1
else
  echo "no wheelhouse in .whl/: the swarm part of the check is skipped"
fi
exit $rc
