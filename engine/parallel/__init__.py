"""Tensor and pipeline parallelism inside one engine worker: one process per rank
(rank 0 hosts the scheduler), `torch.distributed` between them (NCCL on CUDA,
gloo on the CPU).

- `state.py`: this process's place (tensor rank, pipeline stage) and its groups;
- `comm.py`: the collectives the model calls (no-ops without parallelism);
- `sharding.py`: each rank's part of the model and of each checkpoint tensor;
- `step_wire.py`: a step's inputs packed for the other ranks;
- `launcher.py`, `follower.py`: rank 0 starting the others, and their loop.
"""
