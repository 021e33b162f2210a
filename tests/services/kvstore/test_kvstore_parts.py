"""The KV store's parts that need no Redis or network: the block format's
checks, fingerprints, quota files and the numbering of SharedKvEvents."""

from __future__ import annotations

import pytest

from services.common.kv_checksum import block_checksum
from services.kvstore.block_format import TAG_BYTES, BlockCorrupt, decode, encode
from services.kvstore.fingerprint import Fingerprint
from services.kvstore.quotas import Quotas, parse_quota_file
from services.kvstore.redis_layout import Namespace, member, parse_member
from services.kvstore.shared_events import SharedEventLog

FP = Fingerprint("m", "bfloat16", 16, "2x16x8x64", 4, 1)
KEY = bytes(range(32))


def _value(payload=b"kv" * 100, tenant="a", block_hash=7, parent=3, key=KEY):
    checksum = block_checksum(payload)
    return encode(FP.canonical(), tenant, block_hash, parent, checksum, payload, key=key)


def test_block_round_trip_and_each_check():
    block = decode(_value(), fingerprint=FP.canonical(), tenant="a", block_hash=7, key=KEY)
    assert (block.block_hash, block.parent_hash, block.payload) == (7, 3, b"kv" * 100)
    cases = {
        "tenant": dict(tenant="b"),
        "hash": dict(block_hash=8),
        "fingerprint": dict(fingerprint=Fingerprint("m", "float16", 16, "2x16x8x64", 4, 1)),
    }
    for reason, ask in cases.items():
        kwargs = dict(fingerprint=FP.canonical(), tenant="a", block_hash=7, key=KEY)
        kwargs.update({k: v.canonical() if k == "fingerprint" else v for k, v in ask.items()})
        with pytest.raises(BlockCorrupt) as err:
            decode(_value(), **kwargs)
        assert err.value.reason == reason
    value = _value()
    end = len(value) - TAG_BYTES  # the payload's end: the tag follows it
    for broken, reason in [
        (value[:10], "truncated"),
        (value[:-1], "truncated"),
        (b"XXXX" + value[4:], "magic"),
        (value[: end - 1] + bytes([value[end - 1] ^ 1]) + value[end:], "checksum"),
        (value[:-1] + bytes([value[-1] ^ 1]), "tag"),
        # rewritten with every checksum recomputed, by someone without the key
        (_value(payload=b"!!" * 100, key=bytes(32)), "tag"),
    ]:
        with pytest.raises(BlockCorrupt) as err:
            decode(broken, fingerprint=FP.canonical(), tenant="a", block_hash=7, key=KEY)
        assert err.value.reason == reason


def test_fingerprint_checks_and_ids():
    assert FP.id == Fingerprint.from_canonical(FP.canonical()).id
    assert FP.id != Fingerprint("m", "bfloat16", 16, "2x16x8x64", 4, 2).id
    for bad in [
        dict(model_id=""),
        dict(block_size=0),
        dict(num_layers=0),
        dict(layout="x" * 300),
    ]:
        fields = dict(model_id="m", dtype="f", block_size=16, layout="l", num_layers=1)
        with pytest.raises(ValueError):
            Fingerprint(**{**fields, **bad})


def test_keys_share_a_hash_tag_per_tenant():
    for tenant in ["", "acme", "we{ird}"]:
        ns = Namespace(tenant)
        tag = ns.prefix.split("{")[1].split("}")[0]
        assert tag and all(f"{{{tag}}}" in key for key in [ns.block("x"), *ns.accounting])
    assert Namespace("a").prefix != Namespace("b").prefix
    assert parse_member(member(FP.id, 2**64 - 1)) == (FP.id, 2**64 - 1)


def test_quota_file():
    quotas = parse_quota_file('# per tenant\nacme 1000\n"" 50  # the default tenant\n\n')
    assert quotas == {"acme": 1000, "": 50}
    q = Quotas(capacity=800, default=100, overrides=quotas)
    assert (q.for_tenant("acme"), q.for_tenant(""), q.for_tenant("other")) == (800, 50, 100)
    assert Quotas(capacity=800).for_tenant("x") == 800
    with pytest.raises(ValueError, match="line 2"):
        parse_quota_file("a 1\nb lots\n")


def test_shared_events_are_numbered_and_start_with_a_reset():
    log = SharedEventLog(max_hashes=3)
    log.snapshot([1, 2, 3, 4])
    log.stored([5])
    log.removed([2])
    batches = log.batches()
    assert [(b.event_id, b.reset) for b in batches] == [(1, True), (2, False)]
    assert batches[0].stored + batches[1].stored == [1, 3, 4, 5]
    assert batches[0].removed == batches[1].removed == []
    assert log.batches() == []
    log.stored([6])
    log.removed([6, 1])
    (batch,) = log.batches()
    assert (batch.event_id, batch.stored, batch.removed) == (3, [], [6, 1])


def test_changes_during_a_snapshot_are_kept():
    log = SharedEventLog()
    log.begin_snapshot()
    log.stored([9])  # a put that finished while the snapshot was read
    log.removed([1])  # an eviction of a block the scan already saw
    log.snapshot([1, 2])
    (batch,) = log.batches()
    assert batch.reset and batch.stored == [2, 9] and batch.removed == []
