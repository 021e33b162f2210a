"""Where things are, for tests in any folder under tests/."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parent  # the helpers beside this file
ROOT = TESTS.parent  # the repository
