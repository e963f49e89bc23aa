"""PolicyReloader: startup load, change detection (rewrites, symlink swaps), keep last good."""

from __future__ import annotations

import asyncio
import logging
import os
from pathlib import Path

import pytest

from gateway.core.policy import PolicySet
from gateway.observability.metrics import POLICY_RELOADS, POLICY_RULES
from gateway.services.policy import PolicyError, PolicyReloader, fingerprint


def policy(name: str, *hosts: str) -> str:
    rules = "".join(f'  - host: "{h}"\n' for h in hosts)
    return (
        f"version: v1\nname: {name}\negress:\n{rules}" if hosts else f"version: v1\nname: {name}\n"
    )


def reloads(result: str) -> float:
    value = POLICY_RELOADS.labels(result=result)._value.get()
    return float(value)


class Recorder:
    def __init__(self) -> None:
        self.sets: list[PolicySet] = []
        self.errors: list[list[str]] = []

    def reloader(self, directory: Path) -> PolicyReloader:
        return PolicyReloader(
            directory, on_reload=self.sets.append, on_error=self.errors.append, interval=0.01
        )


def hosts(policy_set: PolicySet | None, name: str) -> list[str]:
    assert policy_set is not None
    return [r.host for r in policy_set.policies[name].rules]


def test_load_now_and_in_place_rewrite(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    file = tmp_path / "a.yaml"
    file.write_text(policy("a", "one.example.com", "two.example.com"))
    rec = Recorder()
    reloader = rec.reloader(tmp_path)
    ok_before = reloads("ok")
    first = reloader.load_now()
    assert reloader.current is first and hosts(first, "a") == ["one.example.com", "two.example.com"]
    assert reloads("ok") == ok_before + 1
    assert POLICY_RULES._value.get() == 2
    assert rec.sets == []  # startup load does not call back

    async def scenario() -> None:
        assert await reloader.check() is False  # nothing changed
        file.write_text(policy("a", "three.example.com"))  # in-place rewrite
        assert await reloader.check() is True
        assert hosts(reloader.current, "a") == ["three.example.com"]
        # a broken change: errors reported once, the last good set keeps serving
        errors_before = reloads("error")
        file.write_text(policy("a", "*.com"))
        with caplog.at_level(logging.ERROR, logger="gateway.policy"):
            assert await reloader.check() is False
            assert await reloader.check() is False  # same fingerprint: not reported again
        assert reloads("error") == errors_before + 1
        assert len(rec.errors) == 1 and "public suffix" in rec.errors[0][0]
        assert any("public suffix" in r.getMessage() for r in caplog.records)
        assert hosts(reloader.current, "a") == ["three.example.com"]
        # fixed again
        (tmp_path / "b.yml").write_text(policy("b", "b.example.com"))
        file.write_text(policy("a", "four.example.com"))
        assert await reloader.check() is True
        assert set(reloader.current.policies) == {"a", "b"}  # type: ignore[union-attr]
        assert reloader.last_errors == []

    asyncio.run(scenario())
    assert len(rec.sets) == 2


def test_load_now_raises_and_keeps_none(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("version: v9\nname: a\n")
    reloader = PolicyReloader(tmp_path)
    with pytest.raises(PolicyError):
        reloader.load_now()
    assert reloader.current is None
    assert reloader.last_errors and "v9" in reloader.last_errors[0]


def test_configmap_symlink_swap_is_detected(tmp_path: Path) -> None:
    """Kubernetes swaps ..data to a new timestamped dir; file names stay the same."""
    old = tmp_path / "..2024_01_01"
    new = tmp_path / "..2024_01_02"
    old.mkdir()
    new.mkdir()
    (old / "a.yaml").write_text(policy("a", "old.example.com"))
    (new / "a.yaml").write_text(policy("a", "new.example.com"))
    os.symlink(old.name, tmp_path / "..data")
    os.symlink("..data/a.yaml", tmp_path / "a.yaml")
    rec = Recorder()
    reloader = rec.reloader(tmp_path)
    reloader.load_now()
    before = fingerprint(tmp_path)
    # atomic swap, as the kubelet does it
    os.symlink(new.name, tmp_path / "..data_tmp")
    os.replace(tmp_path / "..data_tmp", tmp_path / "..data")
    assert fingerprint(tmp_path) != before
    assert asyncio.run(reloader.check()) is True
    assert hosts(reloader.current, "a") == ["new.example.com"]


def test_symlinked_directory_swap_is_detected(tmp_path: Path) -> None:
    """git-sync style: the policies directory itself is a symlink to a revision."""
    for rev, host in (("rev1", "one.example.com"), ("rev2", "two.example.com")):
        (tmp_path / rev).mkdir()
        (tmp_path / rev / "a.yaml").write_text(policy("a", host))
    link = tmp_path / "policies"
    os.symlink("rev1", link)
    reloader = PolicyReloader(link)
    reloader.load_now()
    os.symlink("rev2", tmp_path / "tmp-link")
    os.replace(tmp_path / "tmp-link", link)
    assert asyncio.run(reloader.check()) is True
    assert hosts(reloader.current, "a") == ["two.example.com"]


def test_background_task_polls(tmp_path: Path) -> None:
    file = tmp_path / "a.yaml"
    file.write_text(policy("a", "one.example.com"))
    rec = Recorder()
    reloader = rec.reloader(tmp_path)
    reloader.load_now()

    async def scenario() -> None:
        task = reloader.start()
        assert reloader.start() is task
        file.write_text(policy("a", "two.example.com", "three.example.com"))
        for _ in range(500):
            if rec.sets:
                break
            await asyncio.sleep(0.01)
        await reloader.stop()
        assert task.done()

    asyncio.run(scenario())
    assert len(rec.sets) == 1
    assert hosts(rec.sets[0], "a") == ["two.example.com", "three.example.com"]


def test_deleted_directory_keeps_last_good(tmp_path: Path) -> None:
    directory = tmp_path / "p"
    directory.mkdir()
    (directory / "a.yaml").write_text(policy("a", "one.example.com"))
    rec = Recorder()
    reloader = rec.reloader(directory)
    good = reloader.load_now()
    (directory / "a.yaml").unlink()
    directory.rmdir()
    assert asyncio.run(reloader.check()) is False
    assert reloader.current is good
    assert rec.errors and "cannot read policy directory" in rec.errors[0][0]


def test_learn_loads_every_policy_in_learn_mode(tmp_path: Path) -> None:
    """`run --learn` (config `learn: true`): the files as written, each policy compiled in
    learn mode, at startup and at every reload."""
    (tmp_path / "a.yaml").write_text("version: v1\nname: a\negress: [{host: x.example}]\n")
    reloader = PolicyReloader(tmp_path, learn=True)
    assert {p.mode for p in reloader.load_now().policies.values()} == {"learn"}
    (tmp_path / "b.yaml").write_text("version: v1\nname: b\nmode: report\negress: []\n")
    assert asyncio.run(reloader.check())
    assert reloader.current is not None
    assert {n: p.mode for n, p in reloader.current.policies.items()} == {
        "a": "learn", "b": "learn"}
    assert {p.mode for p in PolicyReloader(tmp_path).load_now().policies.values()} == {
        "enforce", "report"}
