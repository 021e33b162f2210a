"""Reading the workers of a running mesh: the scheduler's list, then each
worker's Prometheus metrics (for tests and benchmarks)."""

from __future__ import annotations

import functools
import ssl
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from proto.yinian.v1 import scheduler_pb2, scheduler_pb2_grpc
from services.common.tls import sync_channel


def list_workers(mesh):
    with sync_channel(mesh.scheduler_address, mesh.spec.tls) as channel:
        stub = scheduler_pb2_grpc.SchedulerStub(channel)
        return stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), timeout=5).workers


def workers_by_role(mesh) -> dict[str, list]:
    """role -> the WorkerInfo of each listed worker of that role."""
    out: dict[str, list] = {}
    for w in list_workers(mesh):
        out.setdefault(w.info.role, []).append(w.info)
    return out


def worker_metric(mesh, name: str, role: str | None = None, where: str = "") -> dict[str, float]:
    """Per worker (of one role, if given), the sum of the samples of a metric (those
    whose labels contain `where`, e.g. 'tier="host"')."""
    out: dict[str, float] = {}
    for w in list_workers(mesh):
        if role is not None and w.info.role != role:
            continue
        out[w.info.worker_id] = scrape(f"http://{w.info.metrics_address}/metrics", name, where)
    return out


@functools.cache
def default_tls() -> ssl.SSLContext:
    """The SSL context httpx builds for `verify=True`, built once per process: every
    new client builds its own, loading the CA bundle again (about 20 ms of CPU), so a
    client made per request (a fresh connection each time, as tests and benchmarks
    want) passes this as its `verify`."""
    return httpx.create_ssl_context()


@functools.cache
def _default_client() -> httpx.Client:
    """The client of every default-verified GET (tests and benchmarks scrape in loops),
    each request on a new connection as `httpx.get` would."""
    limits = httpx.Limits(max_keepalive_connections=0)
    return httpx.Client(timeout=5, limits=limits, verify=default_tls())


def http_get(url: str, verify=True) -> httpx.Response:
    """GET with a 5 s timeout; a TLS mesh's own SSL context (`verify`) gets a client of
    its own, as with `httpx.get` (a mesh builds a new context at each call)."""
    if verify is True:
        return _default_client().get(url)
    return httpx.get(url, timeout=5, verify=verify)


def scrape(url: str, name: str, where: str = "", verify=True) -> float:
    """The sum of the samples of metric `name` (every label set containing `where`)
    at a /metrics URL."""
    return sample_sum(http_get(url, verify).text, name, where)


def sample_sum(text: str, name: str, where: str = "") -> float:
    """The sum of the samples of metric `name` (every label set containing `where`) in
    a /metrics page's text."""
    return sum(
        float(line.split()[-1])
        for line in text.splitlines()
        if (line.startswith(name + "{") or line.startswith(name + " ")) and where in line
    )


def gateway_metric(mesh, name: str, where: str = "") -> float:
    """The sum of the first gateway's samples of a metric (those whose labels contain
    `where`)."""
    return scrape(f"{mesh.url}/metrics", name, where, verify=mesh.ssl_context() or True)


def metric_sum(mesh, name: str, role: str = "decode") -> float:
    return sum(worker_metric(mesh, name, role).values())


def placer_metric(mesh, name: str, where: str = "") -> float:
    """The sum of a placement metric's samples over every placer of the mesh: the
    scheduler and each gateway (a gateway placing requests itself counts its own)."""
    urls = [f"{url}/metrics" for url in mesh.urls[: mesh.spec.gateways]]
    verify = mesh.ssl_context() or True
    return scheduler_metric(mesh, name, where) + sum(
        scrape(url, name, where, verify=verify) for url in urls
    )


def scheduler_metric(mesh, name: str, where: str = "") -> float:
    """The sum of a scheduler metric's samples (those whose labels contain `where`)."""
    return scrape(mesh.metrics_endpoints()["scheduler"], name, where)


def index_sizes(mesh, tier: str = "gpu") -> dict[str, float]:
    """holder -> how many blocks the scheduler's KV index knows it has in `tier`."""
    return _index_sizes(http_get(mesh.metrics_endpoints()["scheduler"]).text, tier) or {}


def _index_sizes(text: str, tier: str) -> dict[str, float] | None:
    """holder -> `yinian:kv_index_blocks` in `tier`, of a /metrics page (None: the page
    has no such metric)."""
    families = [f for f in text_string_to_metric_families(text)
                if f.name == "yinian:kv_index_blocks"]  # fmt: skip
    if not families:
        return None
    return {sample.labels["holder"]: sample.value
            for sample in families[0].samples if sample.labels.get("tier") == tier}  # fmt: skip


def wait_indexed(
    mesh, blocks: float, before: dict[str, float] | None = None, *, tier: str = "gpu",
    timeout: float = 15.0, among: set[str] | None = None,
) -> str | None:  # fmt: skip
    """Waits until one holder (of `among`, if given) has `blocks` more in `tier` of the
    scheduler's KV index than `before` (an earlier `index_sizes`) said, i.e. until the
    KV events of the request that stored them have reached it, and the gateways that
    place requests themselves know as much (`wait_placers_caught_up`); returns that
    holder (None if the time ran out). One holder's count, so that a late batch of
    another's is not taken for this request's."""
    before = before or {}

    def grown() -> str | None:
        for holder, count in index_sizes(mesh, tier).items():
            if among is not None and holder not in among:
                continue
            if count >= before.get(holder, 0) + blocks:
                return holder
        return None

    found = _poll(grown, timeout)
    if found is not None and not wait_placers_caught_up(mesh, found, timeout, tier):
        return None  # a gateway's index did not follow within the time
    return found


def gpu_holders(mesh, block_hashes: list[int]) -> list[set[str]]:
    """Per leading block of a prompt (its chained hashes) the workers the scheduler's KV
    index says hold it on their GPU, up to the first block nobody holds anywhere."""
    request = scheduler_pb2.HoldersRequest(block_hashes=block_hashes)
    with sync_channel(mesh.scheduler_address, mesh.spec.tls) as channel:
        answer = scheduler_pb2_grpc.SchedulerStub(channel).Holders(request, timeout=5)
    return [set(b.gpu) for b in answer.blocks]


def wait_held(mesh, block_hashes: list[int], timeout: float = 15.0) -> str | None:
    """Waits until one worker holds every one of `block_hashes` on its GPU by the
    scheduler's KV index (the KV events of the request that stored exactly these
    blocks have reached it), and the gateways that place requests themselves know as
    much (`wait_placers_caught_up`); returns that worker (None if the time ran out)."""

    def holder() -> str | None:
        held = gpu_holders(mesh, block_hashes)
        if len(held) != len(block_hashes) or not held:
            return None
        return min(set.intersection(*held), default=None)

    found = _poll(holder, timeout)
    if found is not None and not wait_placers_caught_up(mesh, found, timeout):
        return None  # a gateway's index did not follow within the time
    return found


def wait_placers_caught_up(mesh, holder: str, timeout: float = 15.0, tier: str = "gpu") -> bool:
    """Waits until every gateway that places requests itself knows at least as many
    of `holder`'s blocks in `tier` as the scheduler's index now does (they hear the
    same KV events, each in its own time); True once they do (at once for gateways
    that ask the scheduler: they export no index), False if the time ran out."""
    want = index_sizes(mesh, tier).get(holder, 0)

    def caught_up() -> bool | None:
        for url in mesh.urls[: mesh.spec.gateways]:
            text = http_get(f"{url}/metrics", mesh.ssl_context() or True).text
            sizes = _index_sizes(text, tier)
            if sizes is not None and sizes.get(holder, 0) < want:
                return None
        return True

    return bool(_poll(caught_up, timeout))


def _poll(check, timeout: float):
    """`check()` every 50 ms until it returns something other than None, which is
    returned; None once `timeout` seconds have passed."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found is not None or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def wait_store_mapped(mesh, timeout: float = 120.0) -> float:
    """Waits until every worker has mapped (and pinned) the KV store's memory tier,
    whose blocks it then copies straight to its device (pinning many GiB takes seconds
    after the worker is ready); the seconds waited."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        mapped = worker_metric(mesh, "yinian:kv_store_memory_mapped")
        if mapped and all(mapped.values()):
            break
        time.sleep(0.2)
    return time.monotonic() - start


def wait_running(metrics_address: str, timeout: float = 60.0, steps: int = 0) -> None:
    """Waits until the worker at `metrics_address` reports a request running, and then
    until its engine has run `steps` more steps (a running request has then had tokens
    out: a test that kills a worker mid-stream waits for this, not for a fixed time)."""
    deadline = time.monotonic() + timeout
    url = f"http://{metrics_address}/metrics"
    first = None  # the engine's steps when a request was first seen running
    while True:
        page = http_get(url).text
        ran = sample_sum(page, "yinian:engine_steps", 'kind="all"')
        if first is None and sample_sum(page, "yinian:num_requests_running") >= 1:
            first = ran
        if first is not None and ran >= first + steps:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"no request ran on {metrics_address} within {timeout:g} s")
        time.sleep(0.05)
