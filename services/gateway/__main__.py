"""`python -m services.gateway`: the gateway process."""

from __future__ import annotations

from services.common.entry import exit_process, run_service
from services.gateway.app import run
from services.gateway.config import parse


def main(argv: list[str] | None = None) -> int:
    return run_service(run(parse(argv)))


if __name__ == "__main__":
    exit_process(main())
