"""The services of the yinian mesh, one package per inference stage."""

import os

# Children start by fork and exec while gRPC's threads run. gRPC's fork handlers (on by
# default) restart its poller in the forked child, which then dies (SIGABRT, "epoll_wait
# error: Bad file descriptor") on the descriptors subprocess closes before the exec.
# Nothing here uses gRPC across a fork, so they are off unless asked for.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "0")
