#!/usr/bin/env bash
# The serving gate's two codes on one machine. Writes OLD's code (engine, services,
# yinian, bench, kernels, proto, basis, pyproject.toml) into .gate_old/ beside this tree,
# without bench/results and the committed models (the call links the new tree's: the
# working tree and its carry stay under 64 MiB), then prints the two `run` commands that serve
# the default mesh at 8 and 16 req/s (320 prompts) with the new code, the old, the new and
# the old again on one machine (two calls), their results in one archive (gate.tgz) a call.
# Pool with
#   python -m bench.kv_serving_pool gate_new1.json gate_new2.json --against gate_old1.json gate_old2.json
# .gate_old/ travels as an untracked file: delete it before committing.
#   bash bench/gpu/gate_tree.sh b31bcd9
set -euo pipefail
old=${1:?usage: bash bench/gpu/gate_tree.sh OLD_COMMIT}
rm -rf .gate_old && mkdir .gate_old
git archive "$old" engine services bench yinian proto basis kernels pyproject.toml | tar -x -C .gate_old
rm -rf .gate_old/bench/results .gate_old/yinian/models
du -sh .gate_old
# RUN: another run to compare the two codes by (its --out is added), e.g.
#   RUN="bench.gpu.structured --skip tools default_dtypes" bash bench/gpu/gate_tree.sh 41aad6c
sweep=${RUN:-"bench.gpu.kv_serving --meshes default --rates 8,16 --prompts-per-rate 320"}
new() { echo "bash bench/gpu/device_call.sh 250 \"$sweep --out \\\$OUT/gate_new$1.json\""; }
old() { echo "(cd .gate_old && bash bench/gpu/device_call.sh 250 \"$sweep --out \\\$OUT/gate_old$1.json\")"; }
links="ln -sfn \$PWD/yinian/models .gate_old/yinian/models; ln -sfn ../.whl .gate_old/.whl;"
# both trees start from the carried kernels (their cache entries name this tree's paths)
links="$links tar xzf .kcache.tgz 2>/dev/null; cp .kcache.tgz .gate_old/ 2>/dev/null;"
pack="cd \$OUT && tar czf gate.tgz --remove-files gate_* \$(ls meshlogs.tgz 2>/dev/null)"  # few files come back
echo "Two runs (carry [\".whl\", \".kcache.tgz\"], timeout 600; about 150 s a sweep with warm"
echo "kernels; after the first, cat its kcache.tgz.* > .kcache.tgz):"
echo "$links $(new 1); $(old 1); $pack"
echo "$links $(old 2); $(new 2); $pack"
