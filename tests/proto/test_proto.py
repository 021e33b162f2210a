"""The committed stubs are exactly what the .proto files generate."""

from __future__ import annotations

from proto.generate import ROOT, generate


def test_stubs_are_fresh(tmp_path):
    fresh = generate(tmp_path)
    assert fresh, "no stubs generated"
    for path in fresh:
        committed = ROOT / path.relative_to(tmp_path)
        assert committed.is_file(), f"{committed} is missing: run python -m proto.generate"
        assert committed.read_bytes() == path.read_bytes(), (
            f"{committed.name} is stale: run python -m proto.generate"
        )
