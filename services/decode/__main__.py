"""`python -m services.decode`: one worker process (`--role colocated|prefill|decode`)."""

from __future__ import annotations

import sys

from services.common.entry import run_service
from services.decode.config import parse
from services.decode.service import run_worker


def main(argv: list[str] | None = None, role: str = "colocated") -> int:
    return run_service(run_worker(parse(argv, role=role)))


if __name__ == "__main__":
    sys.exit(main())
