#!/usr/bin/env bash
# The wheels a device call carries (.whl): ../shared/tools/gpu-wheels.sh with what the
# mesh and the GPU scripts need beyond its list, less what no device call uses, so that
# the tree, the wheels and a stripped kernel cache stay under the 64 MiB a call carries.
#   bash bench/gpu/wheels.sh            # then: carry [".whl", ".kcache.tgz"]
#   THIRD_PARTY=1 bash bench/gpu/wheels.sh   # also .whl_tp (guidellm): carry it too
# Python 3.12 x86-64 wheels, as the GPU machine runs; versions as installed here.
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=${DIR:-.whl}
# hiredis (Redis replies), xxhash and blake3 (block checksums and tags), jsonschema and
# its own (bench/gpu/structured.py validates answers with it), httptools (the gateway's HTTP)
DIR=$dir bash ../shared/tools/gpu-wheels.sh hiredis xxhash blake3 jsonschema \
  jsonschema-specifications referencing rpds-py attrs httptools
# llguidance's wheels of this version are tagged manylinux_2_31, which gpu-wheels.sh does not
# ask for (it says "no wheel for llguidance==..."): fetched here with that tag
v=$(python3 -m pip show llguidance 2>/dev/null | awk '/^Version:/{print $2}')
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  -d "$dir" "llguidance${v:+==$v}" 2>/dev/null || echo "no wheel for llguidance $v" >&2
# the README's client example and `yinian up --tls`: no device call uses them
rm -f "$dir"/openai-* "$dir"/cryptography-* "$dir"/cffi-* "$dir"/pycparser-*
du -sh "$dir"
# guidellm (bench/loadgen/guidellm_run.py: a load generator we did not write) and what it
# needs beyond the GPU machine's image (which has pyarrow, pandas, xxhash, fsspec, httpx,
# rich, uvloop...): its own folder, carried only by calls that run it (about 6 MB)
if [ "${THIRD_PARTY:-}" = 1 ]; then
  DIR=.whl_tp bash ../shared/tools/gpu-wheels.sh guidellm datasets dill multiprocess culsans \
    aiologic eval-type-backport faker ftfy loguru more-itertools pydantic-settings python-dotenv \
    sanic sanic-routing html5tagger tracerite tomlkit truststore tzdata ujson wcwidth websockets \
    h2 hpack hyperframe httpcore2 >/dev/null
  # gpu-wheels.sh's own list is in .whl already, less what no call uses
  (cd .whl && ls) | while read -r f; do rm -f ".whl_tp/$f"; done
  rm -f .whl_tp/openai-* .whl_tp/cryptography-* .whl_tp/cffi-* .whl_tp/pycparser-*
  du -sh .whl_tp
fi
