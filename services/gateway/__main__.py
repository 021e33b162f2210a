"""`python -m services.gateway`: the gateway process."""

from __future__ import annotations

import asyncio
import logging
import sys

from services.gateway.config import parse
from services.gateway.server import run_gateway


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = parse(argv)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(run_gateway(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
