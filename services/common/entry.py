"""How every service process starts: logging, uvloop where available, and its
async main run to completion."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable


def run_service(main: Awaitable[None]) -> int:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(main)
    return 0
