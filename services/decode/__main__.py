"""`python -m services.decode`: one worker process."""

from __future__ import annotations

import asyncio
import logging
import sys

from services.decode.config import parse
from services.decode.service import run_worker


def main(argv: list[str] | None = None, role: str = "colocated") -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    config = parse(argv, role=role)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(run_worker(config))
    return 0


if __name__ == "__main__":
    sys.exit(main())
