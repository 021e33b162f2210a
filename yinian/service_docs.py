"""Each service's flag table in docs/structures.md, made from its config class
(so the map never drifts from the flags): `python -m yinian.service_docs`
rewrites the tables between `<!-- flags:NAME -->` and `<!-- /flags -->`;
tests/yinian/test_docs.py fails when they are out of date."""

from __future__ import annotations

import dataclasses
import importlib
import re
import sys
from pathlib import Path

from basis.flags import env_name, flag_fields

DOC = Path(__file__).resolve().parent.parent / "docs" / "structures.md"
# table name -> (config class, fields of another table it leaves out)
TABLES = {
    "gateway": ("services.gateway.config:GatewayConfig", None),
    "scheduler": ("services.scheduler.config:SchedulerConfig", None),
    "worker": ("services.worker.settings:WorkerSettings", None),
    "decode": ("services.decode.config:DecodeConfig", "worker"),
    "kvstore": ("services.kvstore.config:KvStoreConfig", None),
    "expert": ("services.expert.config:ExpertConfig", None),
    "engine": ("engine.config:EngineConfig", None),
}
_BLOCK = re.compile(r"(<!-- flags:(\w+) -->\n).*?(<!-- /flags -->)", re.S)


def _load(path: str):
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def table(name: str) -> str:
    path, minus = TABLES[name]
    skip = {f.name for f in flag_fields(_load(TABLES[minus][0]))} if minus else set()
    rows = ["| flag | default | env | what |", "|---|---|---|---|"]
    for f in flag_fields(_load(path)):
        if f.name in skip:
            continue
        default = "(required)" if f.default is dataclasses.MISSING else f.default
        default = "" if default in ("", None) else f"`{default}`"
        env = env_name(f) or ""
        help_text = f.metadata.get("help", "").replace("|", "\\|")
        rows.append(f"| `--{f.name.replace('_', '-')}` | {default} | {env} | {help_text} |")
    return "\n".join(rows) + "\n"


def render(text: str) -> str:
    return _BLOCK.sub(lambda m: m.group(1) + table(m.group(2)) + m.group(3), text)


def main() -> int:
    text = DOC.read_text()
    new = render(text)
    if new != text:
        DOC.write_text(new)
        print(f"updated {DOC}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
