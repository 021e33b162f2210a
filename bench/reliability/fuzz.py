"""Fuzzing the gateway's REST API from its own OpenAPI document (schemathesis):
requests that fit the document (positive) and requests that break it (negative) for
every operation, each answer checked: no server error (5xx), a status and content
type the document lists, a body that fits its schema, invalid data refused. A valid
request must still succeed after the run. The test suite runs a bounded number
(tests/mesh/test_fuzz.py); this script runs the long one on a CPU mesh of its own.

Usage: python -m bench.reliability.fuzz [--requests 10000] [--seed 1]
           [--out bench/results/fuzz.json]
Writes the JSON (counts per operation and status, every failure) and the table (fuzz.md).
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, seed, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.core.failures import FailureGroup
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from bench.reliability.rounds import write_results

CHECKS = [
    not_a_server_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
    negative_data_rejection,
]
POST_SHARE = 0.9  # of the requests, to the POST operations (the bodies worth fuzzing)
MAX_ROUNDS = 10


@dataclass
class FuzzReport:
    requests: int = 0
    statuses: Counter = field(default_factory=Counter)
    per_operation: dict[str, Counter] = field(default_factory=dict)
    failures: list[dict] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def server_errors(self) -> int:
        return sum(n for status, n in self.statuses.items() if int(status) >= 500)

    def as_dict(self) -> dict:
        return {"requests": self.requests, "server_errors": self.server_errors,
                "failures": len(self.failures), "seconds": round(self.seconds, 1),
                "statuses": dict(sorted(self.statuses.items())),
                "per_operation": {op: dict(sorted(c.items()))
                                  for op, c in self.per_operation.items()},
                "failure_samples": self.failures[:50]}  # fmt: skip


def _budgets(operations: list, total: int) -> dict[str, int]:
    posts = [op for op in operations if op.method.upper() == "POST"]
    others = [op for op in operations if op not in posts]
    share = {op.label: total * POST_SHARE / len(posts) for op in posts}
    share |= {op.label: total * (1 - POST_SHARE) / max(1, len(others)) for op in others}
    return {label: max(1, round(n / 2)) for label, n in share.items()}  # per mode


def _runner(op, mode, base_url: str, session, timeout: float, report: FuzzReport):
    """Sends one generated case and checks the answer, recording what happened."""
    counts = report.per_operation.setdefault(op.label, Counter())

    def one(case) -> None:
        response = case.call(base_url=base_url, session=session, timeout=timeout)
        report.requests += 1
        report.statuses[str(response.status_code)] += 1
        counts[str(response.status_code)] += 1
        try:
            case.validate_response(response, checks=CHECKS)
        except (Exception, FailureGroup) as exc:  # noqa: BLE001 - each is recorded
            report.failures.append({
                "operation": op.label, "mode": mode.value, "status": response.status_code,
                "failure": str(exc)[:600], "body": repr(case.body)[:300],
            })  # fmt: skip

    return one


def fuzz(base_url: str, total: int, seed_value: int = 1, timeout: float = 120) -> FuzzReport:
    """About `total` generated requests against the gateway at `base_url`."""
    schema = schemathesis.openapi.from_url(f"{base_url}/openapi.json", wait_for_schema=30)
    operations = [result.ok() for result in schema.get_all_operations()]
    report = FuzzReport()
    session = requests.Session()
    start = time.monotonic()
    for round_ in range(MAX_ROUNDS):  # until `total`: hypothesis stops early on small spaces
        budgets = _budgets(operations, total - report.requests)
        for op in operations:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                run = _runner(op, mode, base_url, session, timeout, report)
                settings_ = settings(max_examples=budgets[op.label], database=None,
                                     deadline=None, phases=[Phase.generate],
                                     suppress_health_check=list(HealthCheck))  # fmt: skip
                test = given(case=op.as_strategy(generation_mode=mode))(run)
                try:
                    seed(seed_value + round_)(settings_(test))()
                except Exception as exc:  # noqa: BLE001 - e.g. no invalid data for it
                    counts = report.per_operation.setdefault(op.label, Counter())
                    counts[f"not generated ({mode.value}): {type(exc).__name__}"] += 1
        if report.requests >= total:
            break
    report.seconds = time.monotonic() - start
    return report


def still_serving(base_url: str, model: str) -> bool:
    body = {"model": model, "prompt": "hi", "max_tokens": 2}
    return httpx.post(f"{base_url}/v1/completions", json=body, timeout=60).status_code == 200


def table(result: dict) -> str:
    lines = [f"{result['requests']} requests in {result['seconds']} s; "
             f"server errors (5xx): {result['server_errors']}; failed checks: "
             f"{result['failures']}; a valid request after the run: "
             f"{'served' if result['still_serving'] else 'FAILED'}", "",
             "| operation | answers (status: count) |", "|---|---|"]  # fmt: skip
    for op, counts in result["per_operation"].items():
        lines.append(f"| {op} | {', '.join(f'{k}: {v}' for k, v in counts.items())} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> dict:
    from yinian.default_model import ensure_default_model
    from yinian.mesh import Mesh, MeshSpec

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=10000, help="generated requests")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--context", type=int, default=256, help="the mesh's context length")
    parser.add_argument("--out", type=Path, default=Path("bench/results/fuzz.json"))
    args = parser.parse_args(argv)

    spec = MeshSpec(model=str(ensure_default_model()), workers=1, port=0,
                    engine_argv=["--device", "cpu", "--max-model-len", str(args.context)],
                    gateway_argv=["--max-model-len", str(args.context)])  # fmt: skip
    with Mesh(spec) as mesh:
        report = fuzz(mesh.url, args.requests, args.seed)
        result = report.as_dict() | {"still_serving": still_serving(mesh.url, "pydoc-llama")}
    result["setup"] = {"mesh": "pydoc-llama on CPU: 1 colocated worker, scheduler, gateway, "
                       "NATS", "context": args.context, "seed": args.seed,
                       "checks": [c.__name__ for c in CHECKS]}  # fmt: skip
    write_results(args.out, result, table(result))
    return result


if __name__ == "__main__":
    main()
