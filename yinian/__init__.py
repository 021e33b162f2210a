"""The `yinian` command."""

import basis.grpc_fork  # noqa: F401  (before any gRPC import)
