"""`python -m services.expert`: an expert service process."""

from __future__ import annotations

import sys

from services.common.entry import run_service
from services.expert.app import run
from services.expert.config import parse


def main(argv: list[str] | None = None) -> int:
    return run_service(run(parse(argv)))


if __name__ == "__main__":
    sys.exit(main())
