#!/usr/bin/env bash
# The pinned stack as wheels for the GPU machines' Python (3.12, x86-64; they have torch, numpy, scipy and the
# rest of a scientific stack, and no package registry), into .whl/ (git-ignored): what scripts/device_check.sh
# installs there for its swarm part. About 33 MB, beside the 31 MB of tracked files that travel under the tool's
# 64 MiB. Left out: bitsandbytes (90 MB; the shim makes it optional for unquantized blocks) and llguidance
# (3 MB; only structured outputs import it). Wheels that exist only as source (cpufeature, varint, ...) are built
# here with a local Python 3.12 (pyenv's, or $PY312).
# With --model-parts it also splits SmolLM2-135M-Instruct's GGUF (98 MB, cached by `chainswarm fetch-model`) into
# .m1/ .m2/ .m3/ (33 MB each, git-ignored): .whl and each part travel in a call of their own (the machine keeps
# what earlier calls left while it stays warm), and device_check.sh then serves the real model (docs/models.md).
set -euo pipefail
cd "$(dirname "$0")/.."
PY312=${PY312:-$(ls /root/.pyenv/versions/3.12*/bin/python 2>/dev/null | head -1)}
rm -rf .whl && mkdir -p .whl  # from scratch: two builds of one wheel would stop the install there
grep -qx "/.whl/" .git/info/exclude 2>/dev/null || echo "/.whl/" >> .git/info/exclude
PLATFORMS=""
for p in manylinux_2_28 manylinux_2_27 manylinux_2_24 manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do PLATFORMS="$PLATFORMS --platform ${p}_x86_64"; done
BINARY="petals==2.2.0.post1 tensor_parallel==1.0.23 hivemind==1.1.12 transformers==4.34.1 tokenizers==0.14.1
  huggingface-hub==0.17.3 accelerate==0.27.2 peft==0.5.0 humanfriendly==10.0 async-timeout==5.0.1 gguf==0.19.0
  Dijkstar==2.6.0 speedtest-cli==2.1.3 fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 pydantic==2.14.4
  pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 opentelemetry-api==1.45.2 base58==2.1.1
  netaddr==1.3.0 ConfigArgParse==1.9.0 cryptography==50.0.2 cffi==2.1.1 pycparser==3.12 py-cid==0.5.0
  py-multihash==3.0.0 py-multibase==2.0.0 py-multicodec==1.0.0 blake3==1.0.11 mmh3==5.3.1 morphys==1.0"
SOURCE="cpufeature==0.2.1 varint==1.0.2 prefetch_generator==1.0.3 python-baseconv==1.2.2"
for spec in $BINARY; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLATFORMS \
    -d .whl "$spec"
done
[ -x "$PY312" ] || { echo "no Python 3.12 to build $SOURCE (set PY312)" >&2; exit 1; }
"$PY312" -m pip wheel -q --no-deps --no-binary :all: -w .whl $SOURCE
du -sh .whl
if [ "${1:-}" = "--model-parts" ]; then
  gguf=$(.venv/bin/python -c "from swarm.model.store import ensure_model, cache_root, KNOWN_MODELS as K
from pathlib import Path; ensure_model('smollm2-135m-instruct')  # fetched and checked once
print(cache_root() / 'sources' / 'smollm2-135m-instruct' / Path(K['smollm2-135m-instruct'].member).name)")
  rm -rf .m1 .m2 .m3 && mkdir -p .m1 .m2 .m3
  parts=$(mktemp -d) && split -n 3 -d -a 1 "$gguf" "$parts/p"
  for i in 1 2 3; do
    mv "$parts/p$((i - 1))" ".m$i/part"; grep -qx "/.m$i/" .git/info/exclude || echo "/.m$i/" >> .git/info/exclude
  done
  rmdir "$parts"
  du -sh .m1 .m2 .m3
fi
