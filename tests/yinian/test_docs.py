"""The map (docs/structures.md) stays true: its flag tables are those the config
classes make, and every module it names exists."""

from __future__ import annotations

import re

from paths import ROOT

from yinian import service_docs


def test_flag_tables_are_up_to_date():
    text = service_docs.DOC.read_text()
    assert service_docs.render(text) == text, "run: python -m yinian.service_docs"
    for name in service_docs.TABLES:
        assert f"<!-- flags:{name} -->" in text


def test_every_service_package_is_on_the_map():
    text = service_docs.DOC.read_text()
    for package in sorted((ROOT / "services").iterdir()):
        if (package / "__main__.py").is_file():
            assert f"services/{package.name}/" in text, package.name


def test_named_modules_exist():
    text = service_docs.DOC.read_text()
    for folder in ("basis", "engine", "kernels", "yinian"):
        section = text.split(f"### {folder}/", 1)[1].split("\n### ", 1)[0]
        for name in re.findall(r"`([a-z_]+\.py)`", section):
            hits = list((ROOT / folder).rglob(name))
            assert hits, f"{folder}/: {name} is on the map but not in the tree"
