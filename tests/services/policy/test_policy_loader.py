"""Loading policy files: parsing, validation with file:line errors, extends, directories."""

from __future__ import annotations

import os
import textwrap
from pathlib import Path

import pytest

from gateway.core.policy import PRESETS, Injection
from gateway.services.policy import (
    PolicyError,
    load_policy_dir,
    load_policy_text,
    load_policy_texts,
    policy_files,
)

EXAMPLE = """\
version: v1
name: coding-agent          # unique across files
mode: enforce
extends: [base]
egress:
  - host: pypi.org
  - host: "*.pythonhosted.org"
  - host: api.github.com
    ports: [443]
    methods: [GET, head]
    paths: ["/repos/**"]
  - host: api.openai.com
    credential: openai
    paths: ["/v1/chat/completions", "/v1/responses"]
  - host: github.com
    ports: [22]
    protocol: tcp
  - host: registry.npmjs.org
    inspect: true
credentials:
  openai: {preset: openai, secret: openai-api-key}
  internal-api: {hosts: [api.internal.example], secret: int-key, inject: {header: X-Api-Key}}
"""

BASE = """\
version: v1
name: base
egress:
  - host: files.example.com
"""


def dedent(text: str) -> str:
    return textwrap.dedent(text).lstrip("\n")


def errors_of(files: dict[str, str]) -> list[str]:
    with pytest.raises(PolicyError) as info:
        load_policy_texts({name: dedent(text) for name, text in files.items()})
    assert str(info.value) == "\n".join(info.value.errors)
    return info.value.errors


def test_example_loads() -> None:
    policy_set = load_policy_texts({"p/coding-agent.yaml": EXAMPLE, "p/base.yaml": BASE})
    policy = policy_set.policies["coding-agent"]
    assert policy.mode == "enforce"
    assert policy.source == "p/coding-agent.yaml"
    assert policy.extends == ("base",)
    hosts = [r.host for r in policy.rules]
    assert hosts == [
        "pypi.org",
        "*.pythonhosted.org",
        "api.github.com",
        "api.openai.com",
        "github.com",
        "registry.npmjs.org",
        "files.example.com",
    ]
    github = policy.rules[2]
    assert github.source == "p/coding-agent.yaml:8"
    assert github.methods == ("GET", "HEAD")
    assert github.ports == (443,)
    assert github.paths == ("/repos/**",)
    assert github.needs_inspection
    assert not policy.rules[0].needs_inspection
    assert policy.rules[4].protocol == "tcp"
    assert policy.rules[5].inspect and policy.rules[5].needs_inspection
    inherited = policy.rules[6]
    assert inherited.policy == "base" and inherited.source == "p/base.yaml:4"
    assert [r.host for r in policy.own_rules][-1] == "registry.npmjs.org"
    assert policy_set.rule_count == 7  # inherited copies are not counted twice
    openai = policy_set.credentials["openai"]
    assert openai.hosts == ("api.openai.com",)
    assert openai.injection == Injection("bearer")
    assert openai.secret == "openai-api-key"
    assert openai.binds("api.openai.com") and not openai.binds("evil.example")
    internal = policy_set.credentials["internal-api"]
    assert internal.injection == Injection("header", "X-Api-Key")
    assert internal.preset is None


def test_empty_egress_and_missing_egress_are_deny_all() -> None:
    policy_set = load_policy_texts(
        {
            "a.yaml": "version: v1\nname: a\negress: []\n",
            "b.yaml": "version: v1\nname: b\n",
            "c.yaml": "version: v1\nname: c\negress:\n",
        }
    )
    assert all(p.rules == () for p in policy_set.policies.values())


def test_multiple_documents_in_one_file() -> None:
    policy_set = load_policy_text("all.yaml", EXAMPLE + "---\n" + BASE)
    assert set(policy_set.policies) == {"coding-agent", "base"}


@pytest.mark.parametrize(
    ("inject", "want"),
    [
        ("{header: X-Key}", Injection("header", "X-Key")),
        ("{bearer: true}", Injection("bearer")),
        ("{query: key}", Injection("query", "key")),
        ("{basic: user}", Injection("basic", "user")),
    ],
)
def test_inject_forms(inject: str, want: Injection) -> None:
    text = f"""\
    version: v1
    name: a
    credentials:
      c: {{hosts: [api.example.com], secret: s, inject: {inject}}}
    """
    assert load_policy_text("a.yaml", dedent(text)).credentials["c"].injection == want


def test_presets() -> None:
    assert PRESETS["anthropic"].injection.carriers == (
        Injection("header", "x-api-key"),
        Injection("bearer"),
    )
    assert PRESETS["gemini"].injection.carriers[1] == Injection("query", "key")
    assert PRESETS["azure-openai"].injection == Injection("header", "api-key")
    assert "router.huggingface.co" in PRESETS["huggingface"].hosts
    # every preset host is a valid pattern: loading a credential per preset succeeds
    body = "".join(f"  {n}: {{preset: {n}, secret: s}}\n" for n in PRESETS)
    policy_set = load_policy_text("a.yaml", "version: v1\nname: a\ncredentials:\n" + body)
    assert set(policy_set.credentials) == set(PRESETS)


def test_preset_narrowed_by_rule_host_and_overridable() -> None:
    text = """\
    version: v1
    name: a
    egress:
      - host: myres.openai.azure.com
        credential: azure
    credentials:
      azure: {preset: azure-openai, secret: s}
      custom: {preset: azure-openai, secret: s, hosts: [llm.corp.example]}
    """
    policy_set = load_policy_text("a.yaml", dedent(text))
    assert policy_set.credentials["custom"].hosts == ("llm.corp.example",)
    assert policy_set.credentials["custom"].injection == Injection("header", "api-key")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("version: v2\nname: a\n", ["a.yaml:1: unsupported version 'v2'; use version: v1"]),
        ("name: a\n", ["a.yaml:1: missing version; add version: v1"]),
        ("version: v1\n", ["a.yaml:1: missing name; add name: <policy name>"]),
        (
            "version: v1\nname: a\nmode: strict\n",
            ["a.yaml:3: invalid mode 'strict'; use enforce, report or learn"],
        ),
        (
            "version: v1\nname: a\negres: []\n",
            ['a.yaml:3: unknown key "egres" in a policy (did you mean "egress"?); known keys:'],
        ),
        (
            "version: v1\nname: a\nname: b\n",
            ['a.yaml:3: duplicate key "name" (first at line 2)'],
        ),
        ("- a\n", ["a.yaml:1: a policy must be a mapping"]),
        ("version: v1\nname: [a\n", ["a.yaml:3: invalid YAML"]),
        ("", ["a.yaml:1: empty policy file"]),
        ("version: v1\nname: a b\n", ['a.yaml:2: invalid policy name "a b"']),
        ("version: v1\nname: a\negress: {host: x.com}\n", ["a.yaml:3: egress must be a list"]),
    ],
)
def test_policy_level_errors(text: str, expected: list[str]) -> None:
    errors = errors_of({"a.yaml": text})
    assert len(errors) == len(expected), errors
    for got, want in zip(errors, expected, strict=True):
        assert got.startswith(want), errors


RULE_CASES = [
    ("{port: [443], host: a.example.com}", 'unknown key "port" in an egress rule (did you mean'),
    ("{ports: [443]}", "egress rule has no host; add host:"),
    ("{host: 5}", "host must be a non-empty string"),
    ("{host: '*.co.uk'}", "public suffix 'co.uk'"),
    ("{host: 'https://example.com'}", "drop it"),
    ("{host: éxämple.com}", "xn--xmple-gra7a.com"),
    ("{host: not-a-domain}", "single label"),
    ("{host: a.example.com, ports: [0]}", "invalid port 0; use a number from 1 to 65535"),
    ("{host: a.example.com, ports: [65536]}", "invalid port 65536"),
    ("{host: a.example.com, ports: [true]}", "invalid port True"),
    ("{host: a.example.com, ports: 443}", "ports must be a non-empty list"),
    ("{host: a.example.com, ports: []}", "ports must be a non-empty list"),
    ("{host: a.example.com, methods: [G E T]}", 'unknown method "G E T"'),
    ("{host: a.example.com, methods: [GTE]}", 'unknown method "GTE"; did you mean GET?'),
    ("{host: a.example.com, methods: [GET, PSOT]}", "did you mean POST?"),
    ("{host: a.example.com, methods: [FROBNICATE]}", "omit methods to allow every method"),
    ("{host: a.example.com, methods: [propfind]}",
     'method "propfind" must be written in uppercase (PROPFIND)'),
    ("{host: a.example.com, methods: [PRI]}", 'unknown method "PRI"'),
    ("{host: a.example.com, methods: ['*']}", "omit methods to allow every method"),
    ("{host: a.example.com, methods: []}", "methods is empty"),
    ("{host: a.example.com, methods: GET}", "methods must be a list"),
    ("{host: a.example.com, paths: [v1]}", "path pattern 'v1' must start with '/'"),
    ("{host: a.example.com, paths: []}", "paths is empty"),
    ("{host: a.example.com, inspect: maybe}", "inspect must be true or false"),
    ("{host: a.example.com, protocol: udp}", "invalid protocol 'udp'; use http or tcp"),
    ("{host: a.example.com, protocol: tcp}", "protocol: tcp needs explicit ports"),
    (
        "{host: a.example.com, protocol: tcp, ports: [22], methods: [GET], inspect: true}",
        "protocol: tcp cannot be combined with methods, inspect",
    ),
    ("{host: a.example.com, credential: nope}", 'unknown credential "nope"'),
    ("{host: a.example.com, credential: opena}", '(did you mean "openai"?)'),
    ("{host: api.github.com, credential: openai}", "which host api.github.com never reaches"),
    ("{host: '*.example.com', credential: openai}", "never reaches"),
]


def test_methods_standard_any_case_registered_uppercase() -> None:
    text = """\
    version: v1
    name: dav
    egress:
      - {host: dav.example.com, methods: [get, Options, PROPFIND, MKCOL, REPORT, QUERY]}
    """
    policy = load_policy_texts({"dav.yaml": text}).policies["dav"]
    assert policy.rules[0].methods == ("GET", "OPTIONS", "PROPFIND", "MKCOL", "REPORT", "QUERY")


@pytest.mark.parametrize(("rule", "message"), RULE_CASES)
def test_rule_errors(rule: str, message: str) -> None:
    text = f"""\
    version: v1
    name: a
    egress:
      - host: ok.example.com
      - {rule}
    credentials:
      openai: {{preset: openai, secret: k}}
    """
    errors = errors_of({"a.yaml": text})
    assert len(errors) == 1, errors
    assert errors[0].startswith("a.yaml:5: "), errors
    assert message in errors[0], errors


def test_reachable_credential_rules_load() -> None:
    text = """\
    version: v1
    name: a
    egress:
      - {host: api.openai.com, credential: openai}
      - {host: "**.openai.com", credential: openai}
      - {host: "*.openai.azure.com", credential: azure}
      - {host: "res1.openai.azure.com", credential: azure}
      - {host: "**.azure.com", credential: azure}
    credentials:
      openai: {preset: openai, secret: k}
      azure: {preset: azure-openai, secret: k}
    """
    assert len(load_policy_text("a.yaml", dedent(text)).policies["a"].rules) == 5


@pytest.mark.parametrize(
    ("credential", "message"),
    [
        ("{secret: k}", 'credential "c" needs preset: (one of openai'),
        ("{hosts: [a.example.com], secret: k}", "or both hosts: and inject:"),
        ("{preset: opnai, secret: k}", 'unknown preset "opnai" (did you mean "openai"?)'),
        ("{preset: openai}", 'credential "c" has no secret'),
        ("{preset: openai, secret: k, scret: x}", 'unknown key "scret"'),
        ("{preset: openai, secret: k, hosts: ['*.com']}", "public suffix"),
        ("{preset: openai, secret: k, inject: {bearer: false}}", "use bearer: true"),
        ("{preset: openai, secret: k, inject: {header: a, query: b}}", "exactly one of"),
        ("{preset: openai, secret: k, inject: {header: 'a b'}}", 'invalid header name "a b"'),
        ("[openai]", "must be a mapping"),
    ],
)
def test_credential_errors(credential: str, message: str) -> None:
    text = f"version: v1\nname: a\ncredentials:\n  c: {credential}\n"
    errors = errors_of({"a.yaml": text})
    assert len(errors) == 1, errors
    assert errors[0].startswith("a.yaml:4: ") and message in errors[0], errors


def test_cross_file_errors_and_all_errors_reported() -> None:
    files = {
        "p/one.yaml": """\
        version: v1
        name: one
        extends: [two, nothing]
        egress:
          - host: "*.com"
          - host: a.example.com
            ports: [0]
        credentials:
          key: {preset: openai, secret: k}
        """,
        "p/two.yaml": """\
        version: v1
        name: two
        extends: [one]
        credentials:
          key: {preset: groq, secret: k}
        ---
        version: v1
        name: one
        """,
    }
    errors = errors_of(files)
    assert errors == [
        'p/one.yaml:3: policy "one" extends unknown policy "nothing"',
        "p/one.yaml:5: host pattern '*.com' puts a wildcard directly over the public suffix "
        "'com', which would allow every site under it; name a domain you trust "
        "(e.g. *.example.com)",
        "p/one.yaml:7: invalid port 0; use a number from 1 to 65535",
        "p/two.yaml:3: extends cycle one -> two -> one; remove one of these extends",
        'p/two.yaml:5: duplicate credential "key" (first defined at p/one.yaml:9); credential '
        "names are global across all policy files",
        'p/two.yaml:7: duplicate policy name "one" (also in p/one.yaml:1); policy names must be '
        "unique across files",
    ]


def test_extends_is_transitive_and_diamond_safe() -> None:
    files = {
        "a.yaml": "version: v1\nname: a\nextends: [b, c]\negress: [{host: a.example.com}]\n",
        "b.yaml": "version: v1\nname: b\nextends: [d]\negress: [{host: b.example.com}]\n",
        "c.yaml": "version: v1\nname: c\nextends: [d]\nmode: report\n",
        "d.yaml": "version: v1\nname: d\negress: [{host: d.example.com}]\n",
    }
    policy_set = load_policy_texts(files)
    assert [r.host for r in policy_set.policies["a"].rules] == [
        "a.example.com",
        "b.example.com",
        "d.example.com",
    ]
    # mode is not inherited
    assert policy_set.policies["a"].mode == "enforce"
    assert policy_set.policies["c"].mode == "report"


def test_self_extends_is_a_cycle() -> None:
    errors = errors_of({"a.yaml": "version: v1\nname: a\nextends: [a]\n"})
    assert errors == ["a.yaml:3: extends cycle a -> a; remove one of these extends"]


def write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")


def test_directory_reads_yaml_and_yml_and_skips_others(tmp_path: Path) -> None:
    write(tmp_path / "coding-agent.yaml", EXAMPLE)
    write(tmp_path / "base.yml", BASE)
    write(tmp_path / ".hidden.yaml", "broken: [")
    write(tmp_path / "README.md", "not yaml")
    write(tmp_path / "sub" / "nested.yaml", "broken: [")
    policy_set = load_policy_dir(tmp_path)
    assert set(policy_set.policies) == {"coding-agent", "base"}
    # Named by the directory's name, never the host's absolute path (they reach agents).
    assert policy_set.policies["base"].source == f"{tmp_path.name}/base.yml"
    assert policy_set.files == (f"{tmp_path.name}/base.yml", f"{tmp_path.name}/coding-agent.yaml")


def test_directory_configmap_layout(tmp_path: Path) -> None:
    """Kubernetes mounts: name.yaml -> ..data/name.yaml, ..data -> ..<timestamp>/."""
    stamp = tmp_path / "..2024_01_01_00_00_00.1"
    write(stamp / "coding-agent.yaml", EXAMPLE)
    write(stamp / "base.yaml", BASE)
    os.symlink(stamp.name, tmp_path / "..data")
    for name in ("coding-agent.yaml", "base.yaml"):
        os.symlink(f"..data/{name}", tmp_path / name)
    assert [p.name for p in policy_files(tmp_path)] == ["base.yaml", "coding-agent.yaml"]
    policy_set = load_policy_dir(tmp_path)
    assert policy_set.policies["coding-agent"].rules[0].source == (
        f"{tmp_path.name}/coding-agent.yaml:6"
    )


def test_directory_errors(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="no policy files"):
        load_policy_dir(tmp_path)
    with pytest.raises(PolicyError, match="cannot read policy directory"):
        load_policy_dir(tmp_path / "missing")
    os.symlink("nowhere.yaml", tmp_path / "dangling.yaml")
    with pytest.raises(PolicyError, match="no policy files"):
        load_policy_dir(tmp_path)
    write(tmp_path / "bad.yaml", "version: v1\nname: a\negress:\n  - host: '*.com'\n")
    with pytest.raises(PolicyError) as info:
        load_policy_dir(tmp_path)
    assert info.value.errors[0].startswith(f"{tmp_path.name}/bad.yaml:4: ")


SHAPED = """
version: v1
name: agent
egress:
  - host: api.anthropic.com
    credential: anthropic
credentials:
  anthropic: {preset: anthropic, secret: k, placeholder: %s}
"""


def test_a_credential_placeholder() -> None:
    """A key-shaped prefix `env` puts before the token; only a short key prefix."""
    policy_set = load_policy_texts({"p/a.yaml": dedent(SHAPED % "sk-ant-api03-")})
    assert policy_set.credentials["anthropic"].placeholder == "sk-ant-api03-"
    for bad in ('"sk ant"', '"a/b"', '"' + "x" * 33 + '"', '""'):
        found = errors_of({"p/a.yaml": SHAPED % bad})
        assert any("placeholder" in e for e in found), found


@pytest.mark.parametrize(("tokens", "expected"), [
    ("{ttl: 8h}", 8 * 3600.0),
    ("{ttl: 90m}", 5400.0),
    ("{ttl: 30s}", "tokens.ttl must be from 1m to 30d"),
    ("{ttl: 31d}", "tokens.ttl must be from 1m to 30d"),
    ("{ttl: soon}", "tokens.ttl: 'soon' is not a duration"),
    ("{lifetime: 1h}", "unknown key"),
])
def test_a_policy_token_ttl(tokens: str, expected: float | str) -> None:
    text = f"version: v1\nname: p\ntokens: {tokens}\negress:\n  - host: a.example\n"
    if isinstance(expected, float):
        assert load_policy_text("policies/p.yaml", text).policies["p"].token_ttl == expected
        return
    assert any(expected in e for e in errors_of({"p.yaml": text})), errors_of({"p.yaml": text})
