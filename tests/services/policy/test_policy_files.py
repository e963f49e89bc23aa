"""Policy files stay inside their directory, and load errors never echo a file.

Real symlinks in temporary directories, through the loader, `policy check` / `policy
test` (the CLI) and the reloader: a Kubernetes ConfigMap's `..data` links keep working;
a symlink (of a file or of a directory) resolving outside the directory is refused with
a `file:line` error naming the link; the outside file is never read, so its lines never
appear. Errors quote at most a short, clipped piece of a file. Sources name the
directory by its name (`policies/agent.yaml:4`), never by the host's absolute path.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
from pathlib import Path

import pytest

from gateway.cli import main
from gateway.services.policy import PolicyError, PolicyReloader, load_policy_dir, load_policy_text
from gateway.services.policy.revision import policy_revision

POLICY = "version: v1\nname: {name}\negress:\n  - host: {name}.example.com\n"
# What a symlink out of the directory could reach: a secret file's lines.
SECRET = "hunter2-0123456789abcdefghijklmnopqrstuvwxyz-SECRET"
OUTSIDE_TEXT = f"root:{SECRET}:19000:0:99999:7:::\napi-key: {SECRET}\n{SECRET}: x\n"


def configmap(directory: Path, files: dict[str, str], stamp: str = "..2026_01_01_00_00_00.1"
              ) -> None:
    """The kubelet's layout: name.yaml -> ..data/name.yaml, ..data -> ..<timestamp>/."""
    target = directory / stamp
    target.mkdir(parents=True)
    for name, text in files.items():
        (target / name).write_text(text)
    tmp = directory / "..data_tmp"
    os.symlink(stamp, tmp)
    os.replace(tmp, directory / "..data")
    for name in files:
        if not (directory / name).is_symlink():
            os.symlink(f"..data/{name}", directory / name)


@pytest.fixture
def outside(tmp_path: Path) -> Path:
    """A directory next to the policies directory, holding a secret file."""
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "shadow.yaml").write_text(OUTSIDE_TEXT)
    return tmp_path / "elsewhere"


@pytest.fixture
def policies(tmp_path: Path) -> Path:
    directory = tmp_path / "policies"
    directory.mkdir()
    (directory / "good.yaml").write_text(POLICY.format(name="good"))
    return directory


def _never_echoed(text: str) -> None:
    assert SECRET[:20] not in text, text
    assert "hunter2" not in text, text


# -- ConfigMap links inside the directory keep working ----------------------------------


def test_configmap_links_load_check_and_reload(tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    directory = tmp_path / "policies"
    directory.mkdir()
    configmap(directory, {"a.yaml": POLICY.format(name="a")})
    loaded = load_policy_dir(directory)
    assert loaded.policies["a"].rules[0].source == "policies/a.yaml:4"
    assert main(["policy", "check", str(directory)]) == 0
    assert "1 policies" in capsys.readouterr().out
    reloader = PolicyReloader(directory)
    reloader.load_now()
    configmap(directory, {"a.yaml": POLICY.format(name="b").replace("name: b", "name: a")},
              stamp="..2026_01_02_00_00_00.1")
    assert asyncio.run(reloader.check()) is True
    assert reloader.current is not None
    assert reloader.current.policies["a"].rules[0].host == "b.example.com"


def test_a_symlinked_policies_directory_is_its_own_inside(tmp_path: Path) -> None:
    """git-sync: the directory itself is a link; files inside it are inside."""
    (tmp_path / "rev1").mkdir()
    (tmp_path / "rev1" / "a.yaml").write_text(POLICY.format(name="a"))
    os.symlink("rev1", tmp_path / "policies")
    assert load_policy_dir(tmp_path / "policies").policies["a"].source == "policies/a.yaml"


# -- symlinks out of the directory are refused ------------------------------------------

LINKS = [
    # (id, make the link(s) in `policies` to `outside`, the link the error names)
    ("file-absolute", lambda p, o: os.symlink(o / "shadow.yaml", p / "x.yaml"), "x.yaml"),
    ("file-relative", lambda p, o: os.symlink("../elsewhere/shadow.yaml", p / "x.yaml"),
     "x.yaml"),
    ("directory", lambda p, o: (os.symlink(o, p / "..data"),
                                os.symlink("..data/shadow.yaml", p / "x.yaml")), "x.yaml"),
    ("chain", lambda p, o: (os.symlink(o / "shadow.yaml", p / ".hidden"),
                            os.symlink(".hidden", p / "x.yaml")), "x.yaml"),
]


@pytest.mark.parametrize("make", [pytest.param(m, id=i) for i, m, _ in LINKS])
def test_a_link_out_is_refused_by_the_loader(policies: Path, outside: Path, make: object
                                            ) -> None:
    make(policies, outside)  # type: ignore[operator]
    with pytest.raises(PolicyError) as info:
        load_policy_dir(policies)
    (error,) = info.value.errors
    assert error.startswith("policies/x.yaml:1: x.yaml is a symbolic link to ")
    assert str(outside / "shadow.yaml") in error  # where it goes, for the operator
    assert "outside the policies directory" in error and "copy the file" in error
    _never_echoed(error)


def test_a_link_out_is_refused_by_policy_check(policies: Path, outside: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    os.symlink(outside / "shadow.yaml", policies / "x.yaml")
    assert main(["policy", "check", str(policies)]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("policies/x.yaml:1: x.yaml is a symbolic link to ")
    assert f"1 error(s) in {policies}" in err
    _never_echoed(out + err)


def test_a_link_out_is_refused_by_policy_test(policies: Path, outside: Path,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    (policies / "tests").mkdir()
    os.symlink(outside / "shadow.yaml", policies / "tests" / "cases.yaml")
    assert main(["policy", "test", str(policies)]) == 2
    err = capsys.readouterr().err
    assert "policies/tests/cases.yaml:1: tests/cases.yaml is a symbolic link to " in err
    _never_echoed(err)


def test_a_link_out_is_refused_by_the_reloader(policies: Path, outside: Path,
                                               caplog: pytest.LogCaptureFixture) -> None:
    errors: list[list[str]] = []
    reloader = PolicyReloader(policies, on_error=errors.append)
    good = reloader.load_now()
    os.symlink(outside / "shadow.yaml", policies / "x.yaml")
    with caplog.at_level(logging.ERROR, logger="gateway.policy"):
        assert asyncio.run(reloader.check()) is False
    assert reloader.current is good  # the last good set keeps serving
    assert errors and errors[0][0].startswith("policies/x.yaml:1: x.yaml is a symbolic link")
    assert "policies/x.yaml:1: x.yaml is a symbolic link" in caplog.text
    _never_echoed(caplog.text + "\n".join(errors[0]))


def test_a_revision_file_out_of_the_directory_is_ignored(policies: Path, outside: Path
                                                         ) -> None:
    (outside / "token").write_text("sk-live-revision-lookalike-0123456789\n")
    os.symlink(outside / "token", policies / "REVISION")
    revision = policy_revision(policies, {"good.yaml": b""})
    assert revision.startswith("sha256:") or len(revision) >= 40  # content hash or git
    assert "sk-live" not in revision


# -- errors quote at most a short, clipped piece of a file ------------------------------


def test_a_secret_file_inside_is_not_echoed(policies: Path) -> None:
    """A file that is no policy (here, a secret file copied in): errors say what is
    wrong, quoting at most a clipped key name."""
    (policies / "x.yaml").write_text(OUTSIDE_TEXT)
    with pytest.raises(PolicyError) as info:
        load_policy_dir(policies)
    text = "\n".join(info.value.errors)
    assert all(e.startswith("policies/x.yaml:") for e in info.value.errors), text
    assert SECRET not in text
    for quoted in re.findall(r'unknown key "([^"]*)"', text):
        assert len(quoted) <= 40, quoted


LONG = "Z" * 40 + SECRET + "Z" * 200  # a value much longer than any error may quote
FIELDS = [
    # (id, a policy with LONG in one place: every error path that quotes content)
    ("unknown key", f"version: v1\nname: a\n{LONG}: 1\n"),
    ("duplicate key", f"version: v1\nname: a\nname: b\n{LONG}: 1\n{LONG}: 2\n"),
    ("version", f"version: {LONG}\nname: a\n"),
    ("name", f"version: v1\nname: {LONG}\n"),
    ("mode", f"version: v1\nname: a\nmode: {LONG}\n"),
    ("host", f"version: v1\nname: a\negress:\n  - host: '{LONG}'\n"),
    ("host url", f"version: v1\nname: a\negress:\n  - host: 'https://{LONG}/x'\n"),
    ("port", f"version: v1\nname: a\negress:\n  - {{host: a.example.com, ports: [{LONG}]}}\n"),
    ("method", f"version: v1\nname: a\negress:\n  - {{host: a.example.com, methods: [{LONG}]}}\n"),
    ("path", f"version: v1\nname: a\negress:\n  - {{host: a.example.com, paths: ['{LONG}']}}\n"),
    ("protocol", f"version: v1\nname: a\negress:\n  - {{host: a.example.com, protocol: {LONG}}}\n"),
    ("model", f"version: v1\nname: a\negress:\n  - {{host: api.openai.com, credential: o, "
              f"models: ['{LONG} x']}}\ncredentials:\n  o: {{preset: openai, secret: k}}\n"),
    ("extends", f"version: v1\nname: a\nextends: [{LONG}]\n"),
    ("credential ref", f"version: v1\nname: a\negress:\n  - {{host: a.example.com, "
                       f"credential: {LONG}}}\n"),
    ("credential name", f"version: v1\nname: a\ncredentials:\n  '{LONG} x': {{preset: openai}}\n"),
    ("preset", f"version: v1\nname: a\ncredentials:\n  c: {{preset: {LONG}, secret: k}}\n"),
    ("inject", f"version: v1\nname: a\ncredentials:\n  c: {{secret: k, hosts: [a.example.com], "
               f"inject: {{header: '{LONG} x'}}}}\n"),
    ("type", f"version: v1\nname: a\ncredentials:\n  c: {{type: {LONG}}}\n"),
    ("token url", f"version: v1\nname: a\ncredentials:\n  c: {{type: oauth2-client-credentials,"
                  f" token_url: 'http://{LONG}', client_id: x, client_secret: s, "
                  f"hosts: [a.example.com]}}\n"),
    ("budget", f"version: v1\nname: a\nbudgets:\n  - {{name: b, per: {LONG}, window: {LONG}, "
               f"tokens: {LONG}}}\n"),
    ("budget name", f"version: v1\nname: a\nbudgets:\n  - {{name: '{LONG} x', per: sandbox, "
                    f"window: 1h, tokens: 1}}\n"),
    ("yaml", f"version: v1\nname: a\negress: [{LONG}\n"),
    ("ask timeout", f"version: v1\nname: a\nask: {{hosts: true, timeout: {LONG}}}\n"),
    ("ask notify", f"version: v1\nname: a\nask: {{hosts: true, notify: ['{LONG} x']}}\n"),
    ("rule ask", f"version: v1\nname: a\negress:\n  - {{host: a.example.com, ask: {LONG}}}\n"),
]


@pytest.mark.parametrize("text", [pytest.param(t, id=i) for i, t in FIELDS])
def test_errors_clip_what_they_quote(text: str) -> None:
    with pytest.raises(PolicyError) as info:
        load_policy_text("policies/a.yaml", text)
    joined = "\n".join(info.value.errors)
    assert SECRET not in joined, joined
    for error in info.value.errors:
        longest = max((len(run) for run in re.findall(r"Z+[^ '\"]*", error)), default=0)
        assert longest <= 64, error


# -- sources name the directory, never the host's absolute path -------------------------


def test_sources_are_relative_to_the_directory(tmp_path: Path) -> None:
    directory = tmp_path / "deploy" / "policies"
    directory.mkdir(parents=True)
    (directory / "agent.yaml").write_text(
        "version: v1\nname: agent\negress:\n  - host: a.example.com\n    credential: c\n"
        "credentials:\n  c: {secret: k, hosts: [a.example.com], inject: {bearer: true}}\n"
        "budgets:\n  - {name: b, per: sandbox, window: 1h, requests: 1}\n")
    loaded = load_policy_dir(directory)
    policy = loaded.policies["agent"]
    assert policy.source == "policies/agent.yaml"
    assert policy.rules[0].source == "policies/agent.yaml:4"
    assert loaded.credentials["c"].source == "policies/agent.yaml:7"
    assert policy.budgets[0].source == "policies/agent.yaml:9"
    assert str(tmp_path) not in repr(loaded)
