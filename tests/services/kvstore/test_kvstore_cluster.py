"""The shared tier on a Redis Cluster (--redis-cluster): each tenant's keys
share a hash tag, so its scripts run on one node, while tenants spread over
the nodes; quotas, global capacity, public reads and snapshots still hold."""

from __future__ import annotations

import pytest
from kvstore_helpers import FP, chain, harness, run, value_bytes
from redis_server import RedisClusterServers, redis_server_binary

from services.kvstore.redis_layout import Namespace

pytestmark = pytest.mark.skipif(redis_server_binary() is None, reason="no redis-server")


def test_shared_tier_on_a_cluster():
    async def body(cluster):
        size = value_bytes("t0")
        tenants = [f"t{i}" for i in range(6)]
        async with harness(
            cluster.url, cluster=True, capacity=8 * size, overrides={"t0": 2 * size}
        ) as h:
            a = chain(3, start=1)
            for x in a:
                assert (await h.put("t0", x)).status == "stored"
            nodes = {h.tier.r.get_node_from_key(Namespace(t).lru).name for t in tenants}
            assert len(nodes) > 1, "tenants spread over the nodes"
            assert await h.tier.usage("t0") == (2, 2 * size), "its quota: 2 blocks"
            for i, tenant in enumerate(tenants[1:]):
                for x in chain(2, start=10 + i):
                    assert (await h.put(tenant, x)).status == "stored"
            # 12 blocks into a capacity of 8: the 4 oldest went, whichever node held them.
            held = [(await h.tier.usage(t))[0] for t in tenants]
            assert held == [0, 0, 2, 2, 2, 2]
            assert await h.tier.reconcile() == 8 * size
            (public,) = chain(1, start=99)
            await h.put("__public__", public)
            assert (await h.store.lookup("t3", FP, [public])).shared_prefix_blocks == 1
            assert public in await h.tier.snapshot()

    with RedisClusterServers() as cluster:
        run(body(cluster))
