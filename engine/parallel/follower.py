"""`python -m engine.parallel.follower`: one rank of a parallel engine other than
rank 0. It builds its shard of the model and of the KV cache, then runs every
step rank 0 sends (the forward pass, its part of each collective, its slice of
the logits) until told to stop. It schedules and samples nothing."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from basis.model_config import ModelConfig
from engine.config import EngineConfig
from engine.parallel import state as parallel_state
from engine.parallel import step_wire
from kernels import ops


def serve(runner) -> None:
    device = runner.device
    while True:
        step = step_wire.receive(device)
        if step is None:
            return
        shape, d64, d32 = step
        t = step_wire.unpack(shape, d64, d32)
        with torch.inference_mode(), ops.using(runner.kernel_mode):
            hidden = runner.model(t.input_ids, t.positions, runner.kv_caches, t.meta,
                                  runner.backend)  # fmt: skip
            if shape.num_sampled:
                runner.model.compute_logits(hidden.index_select(0, t.sample_rows))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="one rank of a parallel yinian engine")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--tp", type=int, required=True)
    p.add_argument("--pp", type=int, required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--model", required=True)
    p.add_argument("--options", required=True, help="the engine options, as JSON")
    args = p.parse_args(argv)
    from engine.model_runner import ModelRunner, resolve_device

    config = EngineConfig.from_options(**json.loads(args.options))
    device = resolve_device(config.device)
    parallel_state.initialize(args.tp, args.pp, args.rank, args.store, device)
    runner = ModelRunner(ModelConfig.from_pretrained(args.model), config, args.model)
    try:
        serve(runner)
    finally:
        parallel_state.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
