"""`python -m services.prefill`: a worker in the prefill role (the worker
process of services.decode with `--role prefill` as its default)."""

from __future__ import annotations

import sys

from services.decode.__main__ import main

if __name__ == "__main__":
    sys.exit(main(role="prefill"))
