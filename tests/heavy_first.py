"""The order the suite's files are handed to its two processes (pytest-xdist,
`--dist loadfile`, which hands out whole files in the order they are collected):
the slowest files first, so that the last files to run are short ones and one
process does not run a long file alone at the end while the other waits. The
list is the slowest files of a serial run (`--durations=0`, summed by file, this
2-core machine, stop 70); a file not listed keeps its place after them. A stale
list costs only balance: every file still runs, each in its own order."""

from __future__ import annotations

SLOWEST = (
    "tests/bench/test_bench_gpu_dry_runs.py",  # 86 s
    "tests/mesh/test_chaos.py",  # 62 s
    "tests/engine/test_engine_kernels.py",  # 35 s
    "tests/mesh/test_openai_surface.py",  # 35 s
    "tests/mesh/test_kvstore_mesh.py",  # 28 s
    "tests/mesh/test_drain.py",  # 27 s
    "tests/engine/test_parallel.py",  # 27 s
    "tests/services/expert/test_expert_services.py",  # 25 s
    "tests/engine/test_speculative.py",  # 20 s
    "tests/services/gateway/test_gateway_stall.py",  # 20 s
    "tests/yinian/test_autoscale.py",  # 19 s
    "tests/mesh/test_pd_failures.py",  # 18 s
    "tests/mesh/test_parallel_mesh.py",  # 17 s
    "tests/kernels/test_kernels_attention.py",  # 16 s
    "tests/engine/test_engine_equivalence.py",  # 16 s
    "tests/mesh/test_mesh_failures.py",  # 16 s
    "tests/yinian/test_up_conventions.py",  # 14 s
    "tests/mesh/test_fuzz.py",  # 14 s
    "tests/services/kv_transport/test_kv_transport.py",  # 13 s
    "tests/mesh/test_expert_mesh.py",  # 12 s
    "tests/yinian/test_supervisor.py",  # 12 s
    "tests/services/worker/test_kvstore_slow.py",  # 10 s
)
_RANK = {path: i for i, path in enumerate(SLOWEST)}


def order(items: list) -> None:
    """Sorts `items` in place: the listed files first, slowest first; within a file and
    among the others, the collected order."""
    items.sort(key=lambda item: _RANK.get(item.nodeid.split("::")[0], len(SLOWEST)))
