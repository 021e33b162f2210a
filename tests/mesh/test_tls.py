"""TLS on every link: a mesh whose services hold certificates of one CA serves
HTTPS and TLS gRPC, its services speak mutual TLS among themselves (a request
crosses gateway -> scheduler, gateway -> decode, decode -> prefill, workers ->
KV store), and a worker refuses any client without a certificate of that CA."""

from __future__ import annotations

import time

import grpc
import httpx
import pytest

from proto.yinian.v1 import (
    inference_pb2,
    inference_pb2_grpc,
    kvstore_pb2,
    kvstore_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from services.common.tls import sync_channel
from yinian.local_ca import make_local_ca
from yinian.mesh import Mesh, MeshSpec
from yinian.mesh_probe import metric_sum, workers_by_role


def get_info(channel: grpc.Channel):
    return worker_pb2_grpc.WorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=5)


def test_mesh_with_mutual_tls_refuses_clients_without_a_certificate(tmp_path, model_dir):
    tls = make_local_ca(tmp_path / "tls", ["127.0.0.1"])
    spec = MeshSpec(model=str(model_dir("tiny-llama")), workers=0, prefill=1, decode=1,
                    kvstore=True, port=0, engine_argv=["--device", "cpu"],
                    scheduler_argv=["--disagg-min-tokens", "1"], tls=tls)  # fmt: skip
    with Mesh(spec) as mesh:
        assert mesh.url.startswith("https://")
        body = {"model": "tiny-llama", "prompt": list(range(1, 65)), "max_tokens": 8}
        resp = httpx.post(f"{mesh.url}/v1/completions", json=body, timeout=60,
                          verify=mesh.ssl_context())  # fmt: skip
        assert resp.status_code == 200, resp.text
        # The prompt was prefilled on the prefill worker: decode -> prefill over mTLS.
        assert metric_sum(mesh, "yinian:kv_transfer_blocks_total") >= 4
        assert metric_sum(mesh, "yinian:kv_handoff_fallbacks_total") == 0
        with pytest.raises(httpx.HTTPError):  # no plaintext on the REST port
            httpx.post(f"http://127.0.0.1:{spec.port}/v1/completions", json=body, timeout=10)

        ca = open(tls.ca, "rb").read()
        worker = workers_by_role(mesh)["decode"][0].address
        assert get_info(sync_channel(worker, tls)).worker_id == "decode-0"
        other = make_local_ca(tmp_path / "other", ["127.0.0.1"])
        strangers = {
            "no certificate": grpc.ssl_channel_credentials(root_certificates=ca),
            "another CA's certificate": grpc.ssl_channel_credentials(
                root_certificates=ca, private_key=open(other.key, "rb").read(),
                certificate_chain=open(other.cert, "rb").read()),
        }  # fmt: skip
        for who, credentials in strangers.items():
            with pytest.raises(grpc.RpcError) as refused:
                get_info(grpc.secure_channel(worker, credentials))
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE, who
        with pytest.raises(grpc.RpcError):
            get_info(grpc.insecure_channel(worker))

        # The gateway's public gRPC serves TLS to product clients, no certificate asked.
        public = grpc.secure_channel(f"127.0.0.1:{mesh.grpc_port}", strangers["no certificate"])
        models = inference_pb2_grpc.InferenceStub(public).ListModels(
            inference_pb2.ListModelsRequest(), timeout=5
        )
        assert list(models.models) == ["tiny-llama"]

        # The workers' link to the KV store: the prompt, sent again, is a prefix hit, and
        # the default (selective) policy writes the blocks it reused through.
        resp = httpx.post(f"{mesh.url}/v1/completions", json=body, timeout=60,
                          verify=mesh.ssl_context())  # fmt: skip
        assert resp.status_code == 200, resp.text
        store = kvstore_pb2_grpc.KvStoreStub(sync_channel(mesh.kvstore_address, tls))
        deadline = time.monotonic() + 15
        while store.Stats(kvstore_pb2.StatsRequest(), timeout=5).shared_blocks == 0:
            assert time.monotonic() < deadline, "no block reached the KV store"
            time.sleep(0.2)
