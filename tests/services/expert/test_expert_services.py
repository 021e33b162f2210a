"""MoE experts on expert services, as real processes on this host: an engine
whose routed experts run on 2 or 4 expert services gives the single-process
engine's greedy tokens (float32), with ping-pong micro-batches off and on, over
mailboxes in shared memory (what `auto` takes on one host) and over gloo, for
Qwen3-MoE, Mixtral and DeepSeek-V3 (shared experts stay on the worker); a
service of another model is refused."""

from __future__ import annotations

import pickle

import pytest
from expert_cluster import (
    GREEDY,
    PROMPTS,
    balancer,
    expert_cluster,
    generate_remote,
    wait_for_placement,
)

from engine import LLM
from proto.yinian.v1 import expert_pb2
from services.expert_parallel.mailbox import MailboxPort

pytestmark = pytest.mark.timeout(240)
PING_PONG = {"micro_batches": 2, "micro_batch_decode_tokens": 2, "micro_batch_prefill_tokens": 2}


def reference(model) -> list[list[int]]:
    outputs = LLM(model, device="cpu").generate(PROMPTS, GREEDY)
    return [list(o.outputs[0].token_ids) for o in outputs]


@pytest.fixture(scope="module")
def tiny_moe(model_dir):
    model = str(model_dir("tiny-moe"))
    return model, reference(model)


@pytest.fixture(scope="module", params=[2, 4], ids=["2-services", "4-services"])
def cluster(request, tiny_moe):
    mesh = expert_cluster(tiny_moe[0], request.param)
    try:
        wait_for_placement(mesh, request.param)
        yield mesh
    finally:
        mesh.stop()


def hidden_seconds(stats: dict) -> float:
    """Expert round-trip time the worker spent on other work, not waiting."""
    return stats["round_trip_seconds"] - stats["wait_seconds"]


@pytest.mark.alone  # the overlap it measures needs the cores (failed once beside another test)
def test_tokens_equal_the_single_process_engine_with_ping_pong_off_and_on(cluster, tiny_moe):
    model, expected = tiny_moe
    whole, whole_stats = generate_remote(cluster, model)
    split, split_stats = generate_remote(cluster, model, **PING_PONG)
    gloo, gloo_stats = generate_remote(cluster, model, transport="collective", **PING_PONG)
    assert whole == expected
    assert split == expected
    assert gloo == expected
    assert whole_stats["transport"] == split_stats["transport"] == "shared"
    assert gloo_stats["transport"] == "collective"
    for stats in (whole_stats, split_stats, gloo_stats):
        # every (token, expert) pair went to a service; none fell back
        assert stats["remote_pairs"] > 0 and stats["local_pairs"] == 0
        assert stats["fallbacks"] == 0
    # micro-batches: two dispatches per MoE layer and step, and the services work
    # on one while the worker computes the other's attention
    assert split_stats["dispatches"] > 1.5 * whole_stats["dispatches"]
    # (2.7-3.5x on this 2-core machine; 3x failed about one run in four, before and
    # after the stream path came)
    assert hidden_seconds(split_stats) > 2 * hidden_seconds(whole_stats)


def test_tokens_over_the_stream_path_equal_the_single_process_engine(cluster, tiny_moe):
    """Every service gets every token and answers with its part of the layer (the
    stream-ordered path), one dispatch in flight or two (micro-batches)."""
    model, expected = tiny_moe
    for options in ({}, PING_PONG):
        got, stats = generate_remote(cluster, model, transport="stream", **options)
        assert got == expected
        assert stats["transport"] == "stream" and stats["fallbacks"] == 0
        assert stats["remote_pairs"] > 0 and stats["local_pairs"] == 0


def test_auto_takes_gloo_where_a_service_cannot_map_the_mailbox(cluster, tiny_moe, monkeypatch):
    """Each service refuses a mailbox it cannot open (FAILED_PRECONDITION, as one on
    another host would): the worker forms the collective group instead."""
    model, expected = tiny_moe
    made = MailboxPort.description

    def elsewhere(self, rank):
        desc = pickle.loads(made(self, rank))
        desc["path"] += "-not-on-this-host"
        return pickle.dumps(desc)

    monkeypatch.setattr(MailboxPort, "description", elsewhere)
    got, stats = generate_remote(cluster, model)
    assert got == expected
    assert stats["transport"] == "collective" and stats["fallbacks"] == 0


def assert_refused(mesh, other_model: str) -> None:
    """A service of another model exits at start with the balancer's reason, and
    the placement stays as it was."""
    members = len(
        balancer(mesh).GetExpertStatus(expert_pb2.ExpertStatusRequest()).placement.members
    )
    argv = ["--model", other_model, "--scheduler", mesh.scheduler_address,
            "--nats-url", mesh.nats_url, "--expert-id", "expert-9"]  # fmt: skip
    stranger = mesh._spawn("expert-9", "services.expert", argv)
    assert stranger.proc.wait(timeout=60) != 0
    stranger.pump.join(10)
    assert "refused" in (mesh.log_dir / "expert-9.log").read_text()
    assert len(wait_for_placement(mesh, members).placement.members) == members


@pytest.mark.parametrize("name", ["mixtral", "tiny-deepseek-v3"])
def test_other_moe_models_on_two_services(model_dir, name):
    model = str(model_dir(name))
    expected = reference(model)
    mesh = expert_cluster(model, 2)
    try:
        wait_for_placement(mesh, 2)
        got, stats = generate_remote(mesh, model, **PING_PONG)
        if name == "mixtral":  # while this cluster is up
            assert_refused(mesh, str(model_dir("tiny-moe")))
    finally:
        mesh.stop()
    assert got == expected
    assert stats["remote_pairs"] > 0 and stats["local_pairs"] == 0
