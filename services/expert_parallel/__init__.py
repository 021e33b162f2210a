"""Expert parallelism across processes, the parts workers, expert services and
the balancer share: EPLB (`eplb.py`), placements (`placement.py`), the
per-layer data path (`wire.py`, `group.py`), the worker's remote backend
(`remote.py`, `step_record.py`) and control loop (`control.py`), metrics.
The worker's choices (its settings check them; importing this package loads nothing
else) are named here."""

FALLBACKS = ("replicas", "local")  # a lost service's experts: surviving replicas, or here
TRANSPORTS = ("auto", "shared", "collective")  # mailboxes on one host, or collectives
