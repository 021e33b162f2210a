"""The services of the yinian mesh, one package per inference stage."""

import basis.grpc_fork  # noqa: F401  (before any gRPC import)
