"""What the deployment tests share: where deploy/ is, and a yinian service's
command as that service's own argument parser takes it."""

from __future__ import annotations

import os

import pytest
from paths import ROOT

from services.decode import config as decode_config
from services.expert import config as expert_config
from services.gateway import config as gateway_config
from services.kvstore import config as kvstore_config
from services.prefill import config as prefill_config
from services.scheduler import config as scheduler_config

DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "k8s"

PARSERS = {
    "services.gateway": gateway_config.parse,
    "services.scheduler": scheduler_config.parse,
    "services.decode": decode_config.parse,
    "services.prefill": prefill_config.parse,
    "services.kvstore": kvstore_config.parse,
    "services.expert": expert_config.parse,
}


def parse_command(monkeypatch, argv: list[str], env: dict[str, str]):
    """The service config that `python -m argv[0] argv[1:]` gets in `env`."""
    for name in list(os.environ):
        if name.startswith(("YINIAN_", "OTEL_")):
            monkeypatch.delenv(name)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    module, *args = argv
    assert module in PARSERS, f"{module} is not a yinian service module"
    try:
        return PARSERS[module](args)
    except SystemExit as exc:  # argparse: unknown flag, bad value or a missing --model
        pytest.fail(f"python -m {' '.join(argv)} is refused by its parser (exit {exc.code})")
