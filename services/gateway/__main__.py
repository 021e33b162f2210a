"""`python -m services.gateway`: the gateway process."""

from __future__ import annotations

import sys

from services.common.entry import run_service
from services.gateway.config import parse
from services.gateway.server import run_gateway


def main(argv: list[str] | None = None) -> int:
    return run_service(run_gateway(parse(argv)))


if __name__ == "__main__":
    sys.exit(main())
