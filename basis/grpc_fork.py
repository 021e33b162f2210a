"""Importing this turns gRPC's fork handlers off in this process (unless
GRPC_ENABLE_FORK_SUPPORT is set already); it must come before gRPC is imported.

Our processes start children by fork and exec while gRPC's threads run. gRPC's
fork handlers (on by default) restart its poller in the forked child, which then
dies (SIGABRT, "epoll_wait error: Bad file descriptor") on the descriptors
subprocess closes before the exec. Nothing here uses gRPC across a fork: every
multiprocessing use is `spawn`."""

from __future__ import annotations

import os

os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
