#!/usr/bin/env python3
"""Container health checks for the yinian services, with nothing but what the
image already has (no curl in python:3.11-slim).

    yinian-healthcheck http://127.0.0.1:8000/health   # gateway: 200 only with a ready worker
    yinian-healthcheck grpc 127.0.0.1:50052           # scheduler / worker: grpc.health.v1 SERVING

Exit status 0 when healthy, 1 otherwise (what Docker's HEALTHCHECK expects).
"""

from __future__ import annotations

import sys
import urllib.error
import urllib.request


def check_http(url: str, timeout: float) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return 200 <= resp.status < 300
    except (urllib.error.URLError, OSError):
        return False


def check_grpc(address: str, timeout: float, service: str = "") -> bool:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        try:
            resp = health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=service), timeout=timeout
            )
        except grpc.RpcError:
            return False
    return resp.status == health_pb2.HealthCheckResponse.SERVING


def main(argv: list[str] | None = None, timeout: float = 3.0) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) == 1 and args[0].startswith(("http://", "https://")):
        return 0 if check_http(args[0], timeout) else 1
    if len(args) in (2, 3) and args[0] == "grpc":
        return 0 if check_grpc(args[1], timeout, *args[2:]) else 1
    print("usage: yinian-healthcheck URL | grpc HOST:PORT [SERVICE]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
