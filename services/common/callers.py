"""Who is calling, inside a mesh: each service `yinian up` starts has a credential
of its own, `NAME.SECRET` in `YINIAN_MESH_TOKEN` (NAME as the mesh names it:
`gateway`, `scheduler`, `kvstore`, `worker-0`, `prefill-1`, `expert-0`, and
`owner` for the process that started the mesh). Every internal server reads
the table of the mesh's callers (`YINIAN_MESH_CALLERS`: a file of `NAME
SHA256(SECRET)` lines, only the mesh's owner may read it) and knows from a call
which service made it; a service cannot speak as another, since the table holds
digests, not secrets.

What each kind of service may call (`POLICY`): only the gateway names a tenant
to a worker (`Decode/Generate`: the tenant a worker serves comes from the
gateway's credential), only a worker registers (and only itself: the scheduler
checks the worker id against the caller, `caller_of`), only the KV store's
clients (workers) read or write blocks, only an expert service registers as an
expert (itself), only the scheduler moves experts, only the owner reads the KV index
(`Scheduler/Holders`). Methods not named here take
any service of the mesh. `owner` may call anything (tests, benchmarks, tools).

Without a table (a deployment handing every service one shared secret), any
holder of the secret may call anything, as before; `caller_of` is then None.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import secrets
from pathlib import Path

ENV = "YINIAN_MESH_CALLERS"
OWNER = "owner"
WORKERS = frozenset({"worker", "prefill", "decode"})

_S = "/yinian.v1."
POLICY: dict[str, frozenset[str]] = {
    f"{_S}Scheduler/Register": WORKERS,
    f"{_S}Scheduler/Deregister": WORKERS,
    f"{_S}Scheduler/Place": frozenset({"gateway"}),
    f"{_S}Scheduler/ListWorkers": frozenset({"gateway"}),
    f"{_S}Scheduler/Holders": frozenset(),  # the mesh's owner (tools) only
    f"{_S}Decode/Generate": frozenset({"gateway"}),
    f"{_S}Decode/Link": frozenset({"gateway"}),  # Generate's requests, many a call
    f"{_S}Decode/Abort": frozenset({"gateway"}),
    f"{_S}Prefill/Prefill": WORKERS,
    f"{_S}Prefill/ReleaseKv": WORKERS,
    **{f"{_S}KvStore/{m}": WORKERS
       for m in ("Lookup", "Put", "Get", "Stats", "PutFrom", "GetInto", "Lend")},
    f"{_S}ExpertBalancer/RegisterExpert": frozenset({"expert"}),
    f"{_S}ExpertBalancer/DeregisterExpert": frozenset({"expert"}),
    f"{_S}ExpertBalancer/Rebalance": frozenset(),
    f"{_S}Expert/Join": WORKERS,
    **{f"{_S}Expert/{m}": frozenset({"scheduler"})
       for m in ("LoadExperts", "FreeExperts", "GetExpertLoad", "SetLoadCollection")},
}  # fmt: skip


def new_credential(name: str) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_-]+", name):
        raise ValueError(f"a service name of letters, digits, '-' and '_': {name!r}")
    return f"{name}.{secrets.token_urlsafe(32)}"


def _digest(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def role_of(name: str) -> str:
    """`worker-3` -> `worker`; `gateway` -> `gateway`."""
    return re.sub(r"-\d+$", "", name)


class CallerTable:
    """The file of the mesh's callers, read again when a name it lacks calls
    (a service started after this one) and the file has changed."""

    def __init__(self, path: str):
        self.path = Path(path)
        self._mtime = -1.0
        self._digests: dict[str, str] = {}
        self._read()

    def _read(self) -> None:
        mtime = self.path.stat().st_mtime
        if mtime == self._mtime:
            return
        rows = (line.split() for line in self.path.read_text().splitlines() if line.strip())
        self._digests = {name: digest for name, digest in rows}
        self._mtime = mtime

    def caller(self, credential: str) -> str | None:
        """The name a credential proves, or None."""
        name, _, secret = credential.partition(".")
        if not secret:
            return None
        if name not in self._digests:
            self._read()
        expected = self._digests.get(name)
        if expected is None or not hmac.compare_digest(_digest(secret), expected):
            return None
        return name


def table() -> CallerTable | None:
    path = os.environ.get(ENV, "")
    return CallerTable(path) if path else None


def write_table(path: Path, credentials: dict[str, str]) -> None:
    """The callers' file for these `name -> credential`s (readable by its owner only)."""
    text = "".join(f"{name} {_digest(c.partition('.')[2])}\n" for name, c in credentials.items())
    tmp = path.with_suffix(".tmp")
    tmp.touch(mode=0o600)
    tmp.write_text(text)
    os.replace(tmp, path)


def permitted(caller: str, method: str) -> bool:
    if caller == OWNER:
        return True
    allowed = POLICY.get(method)
    return allowed is None or role_of(caller) in allowed
