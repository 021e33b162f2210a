"""Expert parallelism across processes, the parts workers, expert services and
the balancer share: EPLB (`eplb.py`), placements (`placement.py`), the
per-layer data path (`wire.py`, `group.py`), the worker's remote backend
(`remote.py`, `step_record.py`) and control loop (`control.py`), metrics.
The worker's choices (its settings check them; importing this package loads nothing
else) are named here."""

FALLBACKS = ("replicas", "local")  # a lost service's experts: surviving replicas, or here
# mailboxes on one host, or collectives; stream: the stream-ordered path (one host, named
# only: on a GPU a member that dies mid-step stalls the worker's stream)
TRANSPORTS = ("auto", "shared", "collective", "stream")
