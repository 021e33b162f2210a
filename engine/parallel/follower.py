"""`python -m engine.parallel.follower`: one rank of a parallel engine other than
rank 0. It builds its shard of the model (its stage's layers, its tensor slice)
and of the KV cache, then runs every step rank 0 sends — from the token ids or
the previous stage's output, its part of each collective, then the next stage's
input or, on the last stage, the logits rank 0 samples from — until told to
stop. It schedules and samples nothing."""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from basis.model_config import ModelConfig
from engine.config import EngineConfig
from engine.parallel import comm, step_wire
from engine.parallel import state as parallel_state
from engine.parallel.pipeline import StageLink
from kernels import ops


def serve(runner) -> None:
    state, device = parallel_state.current(), runner.device
    link = StageLink(state, runner.model_config.hidden_size, runner.dtype, device)
    busy = [0.0, 0]  # seconds computing (waiting for the previous stage excluded), steps
    while True:
        step = step_wire.receive(device, lambda: [busy[0], comm.CLOCK.seconds, busy[1]])
        if step is None:
            link.drain()
            return
        shape, d64, d32 = step
        t = step_wire.unpack(shape, d64, d32)
        with torch.inference_mode(), ops.using(runner.kernel_mode):
            carried = None if state.first_stage else link.recv_carried(shape.total)
            start = time.perf_counter()
            out = runner.model.forward_stage(t.input_ids, carried, t.positions,
                                             runner.kv_caches, t.meta, runner.backend)  # fmt: skip
            if not state.last_stage:
                link.send_carried(*out)
            elif shape.num_sampled:
                logits = runner.model.compute_logits(out.index_select(0, t.sample_rows))
                if logits is not None and state.pp_size > 1:
                    link.send_logits(logits)
            busy[0] += time.perf_counter() - start
            busy[1] += 1


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
