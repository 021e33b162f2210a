"""`python -m services.decode`: a decode worker (`--role colocated|decode`)."""

from __future__ import annotations

from services.common.entry import exit_process, run_service
from services.decode.app import run
from services.decode.config import parse


def main(argv: list[str] | None = None) -> int:
    return run_service(run(parse(argv)))


if __name__ == "__main__":
    exit_process(main())
