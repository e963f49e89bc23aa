"""What is generated from the configuration's schema (scripts/config-schema.py) is what the
repository holds: docs/configuration.md's table of keys and the gateway keys of the Helm
chart's values.schema.json. A drift fails here; `make config-schema` rewrites them."""

from __future__ import annotations

import importlib.util
import json
import re
import shutil
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import jsonschema
import pytest
import yaml

from gateway.config import keys, load_config

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "config-schema.py"


@pytest.fixture(scope="module")
def gen() -> ModuleType:
    spec = importlib.util.spec_from_file_location("config_schema", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generated_files_are_up_to_date(gen: ModuleType) -> None:
    for path, text in gen.outputs().items():
        assert path.read_text() == text, f"{path.relative_to(REPO)} is stale: make config-schema"


def _copies(gen: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    docs, chart = tmp_path / "configuration.md", tmp_path / "values.schema.json"
    shutil.copy(gen.DOCS, docs)
    shutil.copy(gen.CHART_SCHEMA, chart)
    monkeypatch.setattr(gen, "DOCS", docs)
    monkeypatch.setattr(gen, "CHART_SCHEMA", chart)
    monkeypatch.setattr(gen, "REPO", tmp_path)
    monkeypatch.setattr(sys, "argv", ["config-schema.py", "--check"])
    return docs, chart


@pytest.mark.parametrize("drift", ["a chart leaf", "a chart key", "a docs row", "a default"])
def test_a_drift_fails_the_check_and_is_rewritten(
        gen: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str], drift: str) -> None:
    docs, chart = _copies(gen, tmp_path, monkeypatch)
    assert gen.main() == 0
    values = json.loads(chart.read_text())
    config = values["properties"]["config"]["properties"]
    if drift == "a chart leaf":
        config["tokens"]["properties"]["max_ttl"] = {"type": "string"}
    elif drift == "a chart key":
        config["network"]["properties"]["allow_cidr"] = {"type": "array"}
    if drift.startswith("a chart"):
        chart.write_text(json.dumps(values, indent=2) + "\n")
    elif drift == "a docs row":
        docs.write_text(re.sub(r"\| `tokens\.max_ttl` .*\n", "", docs.read_text()))
    else:
        docs.write_text(docs.read_text().replace("| `64k` |", "| `32k` |", 1))
    assert gen.main() == 1
    assert "is stale: run `make config-schema`" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["config-schema.py"])
    assert gen.main() == 0  # rewritten ...
    monkeypatch.setattr(sys, "argv", ["config-schema.py", "--check"])
    assert gen.main() == 0  # ... and up to date again


def test_every_key_has_a_row(gen: ModuleType) -> None:
    rows = re.findall(r"^\| `([a-z_.]+)` \|", gen.DOCS.read_text(), re.M)
    assert rows == [key for key, _, _ in keys()]


def _example() -> dict[str, Any]:
    """The commented example at the top of docs/configuration.md."""
    block = re.search(r"```yaml\n(.*?)```", (REPO / "docs" / "configuration.md").read_text(),
                      re.S)
    assert block is not None
    loaded = yaml.safe_load(block.group(1))
    assert isinstance(loaded, dict)
    return loaded


def test_the_docs_example_is_a_valid_config_of_known_keys(gen: ModuleType, tmp_path: Path) -> None:
    example = _example()
    jsonschema.Draft7Validator(gen.gateway_schema()).validate(example)
    path = tmp_path / "gateway.yaml"
    path.write_text(yaml.safe_dump(example))
    load_config(path, env={})  # and the gateway reads it


def test_the_gateway_schema_refuses_an_unknown_key(gen: ModuleType) -> None:
    schema = jsonschema.Draft7Validator(gen.gateway_schema())
    assert schema.is_valid({"tokens": {"max_ttl": "2h"}, "limits": {"memory": "85%"}})
    for wrong in ({"tokens": {"max_tl": "2h"}}, {"listne": {}}, {"workers": "four"},
                  {"tokens": {"max_ttl": "soon"}}, {"limits": {"memory": "lots"}}):
        assert not schema.is_valid(wrong), wrong


def _properties(schema: dict[str, Any], prefix: str = "") -> set[str]:
    found = set()
    for name, sub in schema.get("properties", {}).items():
        found |= _properties(sub, f"{prefix}{name}.") if "properties" in sub else {prefix + name}
    return found


def test_the_charts_identity_values_are_gateway_keys() -> None:
    """`identity.kubernetes` is rendered key for key into gateway.yaml by the template (with
    its own narrowing: Kubernetes names, `""` for none), so its keys are checked, not
    generated."""
    chart = json.loads((REPO / "charts" / "sandbox-gateway" / "values.schema.json").read_text())
    identity = _properties(chart["properties"]["identity"], "identity.")
    gateway = {key for key, _, _ in keys() if key.startswith("identity.")}
    assert identity == gateway


def test_the_charts_config_keys_are_gateway_keys_and_the_template_renders_them(
        gen: ModuleType) -> None:
    known = {key for key, _, _ in keys()}
    assert set(gen.CHART_CONFIG) <= known and set(gen.CHART_DNS.values()) <= known
    helpers = (REPO / "charts" / "sandbox-gateway" / "templates" / "_helpers.tpl").read_text()
    for section in {key.split(".")[0] for key in gen.CHART_CONFIG}:
        assert f".Values.config.{section}" in helpers, section
