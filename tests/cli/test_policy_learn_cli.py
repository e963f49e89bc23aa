"""`policy learn --from-state`: the lines of the state store's request log (what the
console shows), in a real SQLite store, learned like an audit file's."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.cli import main as cli_main
from gateway.services.state.log import LogEntry
from gateway.services.state.sqlite import SqliteState


def _record(path: str, **extra: Any) -> dict[str, Any]:
    return {"sandbox": "s", "policy": "agent", "method": "GET", "scheme": "https",
            "host": "api.example", "port": 443, "path": path, "decision": "report",
            "error": None, "engine": "h1", "credential": None, **extra}


async def _fill(db: Path, records: list[dict[str, Any]]) -> None:
    store = SqliteState(db)
    await store.start()
    try:
        await store.log_append([LogEntry.of(r, 1.0 + i, json.dumps(r))
                                for i, r in enumerate(records)])
    finally:
        await store.close()


def test_learn_from_the_state_stores_request_log(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    db = tmp_path / "state" / "gateway.db"
    db.parent.mkdir()
    records = [_record("/v1/items/1"), _record("/v1/items/2"),
               _record("/other", policy="someone-else")]
    asyncio.run(_fill(db, records))
    (tmp_path / "policies").mkdir()
    (tmp_path / "policies" / "agent.yaml").write_text(
        "version: v1\nname: agent\nmode: learn\negress: []\n")
    config = tmp_path / "gateway.yaml"
    config.write_text(yaml.safe_dump({"policies": str(tmp_path / "policies"),
                                      "state": {"store": "sqlite", "path": str(db)}}))
    assert cli_main(["policy", "learn", "--config", str(config), "--from-state",
                     "--policy", "agent", "--replay"]) == 0
    out, err = capsys.readouterr()
    assert yaml.safe_load(out)["egress"] == [
        {"host": "api.example", "methods": ["GET"], "paths": ["/v1/items/*"]}], out
    assert "learned agent from 2 lines" in err and ": OK" in err, err


def test_learn_needs_a_policy_when_the_lines_name_several(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    audit = tmp_path / "audit.jsonl"
    audit.write_text("".join(json.dumps(_record("/", policy=p)) + "\n" for p in ("a", "b")))
    assert cli_main(["policy", "learn", str(audit), "--dir", str(tmp_path)]) == 2
    assert "the lines name a, b; say which to learn with --policy NAME" in \
        capsys.readouterr().err
