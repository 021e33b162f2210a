"""Scheduling policy: FCFS by default, priorities on request, and preemption
that takes the lowest-priority work first."""

from __future__ import annotations

from engine import LLM, SamplingParams

PARAMS = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)


def finish_order(llm: LLM, requests) -> list[str]:
    engine = llm.engine
    for request_id, prompt, priority in requests:
        engine.add_request(request_id, prompt, PARAMS, priority=priority)
    order = []
    while engine.has_unfinished_requests():
        order += [o.request_id for o in engine.step() if o.finished]
    return order


def test_fcfs_ignores_priority(model_dir):
    llm = LLM(model_dir("tiny-llama"), device="cpu", max_num_seqs=1)
    order = finish_order(llm, [("a", [1, 2], 5), ("b", [3, 4], 0), ("c", [5, 6], -1)])
    assert order == ["a", "b", "c"]


def test_priority_runs_lower_values_first(model_dir):
    llm = LLM(model_dir("tiny-llama"), device="cpu", max_num_seqs=1, scheduling_policy="priority")
    order = finish_order(llm, [("a", [1, 2], 5), ("b", [3, 4], 0), ("c", [5, 6], -1)])
    assert order == ["c", "b", "a"]


def test_preemption_takes_the_lowest_priority(model_dir):
    # Two sequences of 40 + 30 tokens need 2 x 5 blocks of 16; 7 blocks hold one and a bit.
    llm = LLM(model_dir("tiny-llama"), device="cpu", num_gpu_blocks=8, scheduling_policy="priority")
    engine = llm.engine
    params = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    engine.add_request("low", list(range(1, 41)), params, priority=10)
    engine.add_request("high", list(range(2, 42)), params, priority=0)
    preempted_ids = set()
    outs = {}
    while engine.has_unfinished_requests():
        batch_before = {s.request_id: s.num_preemptions for s in engine.scheduler.running}
        for o in engine.step():
            outs[o.request_id] = o
        for seq in engine.scheduler.waiting:
            if seq.num_preemptions > batch_before.get(seq.request_id, seq.num_preemptions):
                preempted_ids.add(seq.request_id)
    assert engine.scheduler.num_preemptions > 0
    assert preempted_ids == {"low"}
    alone = LLM(model_dir("tiny-llama"), device="cpu").generate(
        [list(range(1, 41)), list(range(2, 42))], params
    )
    assert outs["low"].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert outs["high"].outputs[0].token_ids == alone[1].outputs[0].token_ids
