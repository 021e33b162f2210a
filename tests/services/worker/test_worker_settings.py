"""A worker's own flags: values it cannot use are refused before anything starts."""

from __future__ import annotations

import pytest

from services.decode.config import parse


def test_a_switch_interval_out_of_range_is_refused(model_dir, capsys):
    folder = str(model_dir("tiny-llama"))
    assert parse(["--model", folder, "--switch-interval", "0.0005"]).switch_interval == 0.0005
    assert parse(["--model", folder]).switch_interval == 0.005  # Python's own
    for bad in ("0", "-1", "2"):
        with pytest.raises(SystemExit) as exited:
            parse(["--model", folder, f"--switch-interval={bad}"])
        assert exited.value.code == 2
        assert "switch_interval must be > 0 and at most 1 second" in capsys.readouterr().err
