"""The credentials reader on its own: a policy's `credentials:` node in, `Credential`
objects out (added to the load's credentials: names are global across files), every
problem with its line. Which rules may use them is checked across files (`build.py`,
through the loader's tests); minted types' backends in tests/services/minting."""

from __future__ import annotations

from dataclasses import replace

import pytest
from yaml.nodes import Node

from gateway.core.policy.injection import Injection
from gateway.core.policy.minted import MintSpec, aws_hosts, cache_key
from gateway.core.policy.model import Credential
from gateway.core.policy.presets import PRESETS
from gateway.services.policy.nodes import Nodes
from gateway.services.policy.raw import CredentialDef
from gateway.services.policy.read_credentials import read_credentials
from tests.helpers.policy_yaml import FILE, read


def credentials(text: str, defined: dict[str, CredentialDef] | None = None
                ) -> tuple[dict[str, Credential], list[str]]:
    """The credentials ``text`` defines, in policy "team", and the problems."""
    known = dict(defined or {})
    before = set(known)

    def reader(nodes: Nodes, node: Node) -> None:
        read_credentials(nodes, node, "team", known)

    _, problems = read(reader, text)
    return {n: d.credential for n, d in known.items() if n not in before}, problems


STORED = [
    ("{preset: openai, secret: k}",
     Credential(name="c", secret="k", hosts=PRESETS["openai"].hosts,
                injection=PRESETS["openai"].injection, preset="openai")),
    ("{preset: openai, secret: k, hosts: [llm.corp.example], placeholder: sk-proj-}",
     Credential(name="c", secret="k", hosts=("llm.corp.example",),
                injection=PRESETS["openai"].injection, preset="openai",
                placeholder="sk-proj-")),
    ("{hosts: [API.example.com, '*.corp.example'], secret: k, inject: {header: X-Key},"
     " description: ours}",
     Credential(name="c", secret="k", hosts=("api.example.com", "*.corp.example"),
                injection=Injection("header", "X-Key"))),
    ("{hosts: [a.example.com], secret: k, inject: {bearer: true}}",
     Credential(name="c", secret="k", hosts=("a.example.com",), injection=Injection("bearer"))),
    ("{hosts: [a.example.com], secret: k, inject: {query: key}}",
     Credential(name="c", secret="k", hosts=("a.example.com",),
                injection=Injection("query", "key"))),
    ("{hosts: [a.example.com], secret: k, inject: {basic: user}}",
     Credential(name="c", secret="k", hosts=("a.example.com",),
                injection=Injection("basic", "user"), challenge=True)),  # (401 first: git)
]


@pytest.mark.parametrize(("text", "want"), STORED)
def test_a_stored_secret_credential_loads(text: str, want: Credential) -> None:
    found, problems = credentials(f"c: {text}\n")
    assert problems == []
    assert found == {"c": replace(want, source=f"{FILE}:1", policy="team")}


MINTED = [
    ("{type: github-app, app_id: 1, installation_id: '2', private_key: gh-key}",
     "github-app", ("github.com", "api.github.com"),
     {"app_id": 1, "installation_id": 2, "private_key": "gh-key",
      "api_url": "https://api.github.com"}),
    ("{type: github-app, app_id: 1, installation_id: 2, private_key: k, "
     "api_url: 'https://ghe.example.com/api/v3/', permissions: {contents: read}, "
     "repositories: [a, b], hosts: [ghe.example.com]}",
     "github-app", ("ghe.example.com",),
     {"app_id": 1, "installation_id": 2, "private_key": "k",
      "api_url": "https://ghe.example.com/api/v3", "permissions": (("contents", "read"),),
      "repositories": ("a", "b")}),
    ("{type: aws-sigv4, service: bedrock, region: us-east-1, access_key_id: ak, "
     "secret_access_key: sk, duration: 1h}",
     "aws-sigv4", aws_hosts("bedrock", "us-east-1"),
     {"service": "bedrock", "region": "us-east-1", "access_key_id": "ak",
      "secret_access_key": "sk", "duration": 3600, "session_name": "sandbox-gateway",
      "web_identity": False}),
    ("{type: oauth2-client-credentials, token_url: 'https://idp.example/token', "
     "client_id: 7, client_secret: cs, client_auth: body, hosts: [api.example.com]}",
     "oauth2-client-credentials", ("api.example.com",),
     {"token_url": "https://idp.example/token", "client_id": "7", "client_secret": "cs",
      "client_auth": "body"}),
]


@pytest.mark.parametrize(("text", "kind", "hosts", "options"), MINTED)
def test_a_minted_credential_loads(text: str, kind: str, hosts: tuple[str, ...],
                                   options: dict[str, object]) -> None:
    found, problems = credentials(f"c: {text}\n")
    assert problems == []
    credential = found["c"]
    spec = MintSpec.of(kind, options)  # type: ignore[arg-type]
    assert credential.mint == spec and credential.kind == kind
    assert credential.hosts == hosts
    assert credential.secret == cache_key("c", spec)
    assert (credential.source, credential.policy) == (f"{FILE}:1", "team")


# (A problem with a whole credential is at its mapping's line: for "c:\n  type: ..." the
# line of its first key, 2.)
REFUSED = [
    ("c: {secret: k}\n", ['1: credential "c" needs preset: (one of '
                          f'{", ".join(PRESETS)}) or both hosts: and inject:']),
    ("c: {preset: opnai, secret: k}\n",
     [f'1: unknown preset "opnai" (did you mean "openai"?); presets: {", ".join(PRESETS)}']),
    ("c: {preset: openai}\n", ['1: credential "c" has no secret; add secret: <secret name>']),
    ("c:\n  preset: openai\n  secret: 'minted:x'\n",
     ['3: secret names starting "minted:" are the gateway\'s own (minted values); rename the '
      "secret"]),
    ("c:\n  preset: openai\n  secret: k\n  placeholder: 'a b'\n",
     ["4: placeholder 'a b': a key prefix of 1 to 32 letters, digits, \"_\" or \"-\", e.g. "
      "sk-ant-api03-"]),
    ("c:\n  preset: openai\n  secret: k\n  hosts: []\n",
     ["4: hosts is empty; list the hosts this credential may be sent to"]),
    ("c:\n  preset: openai\n  secret: k\n  inject: {bearer: false}\n",
     ["4: bearer: false injects nothing; use bearer: true"]),
    ("c:\n  preset: openai\n  secret: k\n  inject: {header: a, query: b}\n",
     ["4: inject needs exactly one of {header: NAME}, {bearer: true}, {query: NAME}, "
      "{basic: USER}"]),
    ("c:\n  preset: openai\n  secret: k\n  inject: {header: 'a b'}\n",
     ['4: invalid header name "a b"']),
    ("c: [openai]\n", ['1: credential "c" must be a mapping (key: value)']),
    ("'a b': {preset: openai, secret: k}\n",
     ["1: invalid credential name 'a b'; use letters, digits, '.', '_', '-'"]),
    ("c:\n  type: github-ap\n", ['2: unknown credential type "github-ap" (did you mean '
                                 '"github-app"?); types: github-app, azure-entra, aws-sigv4, '
                                 "gcp-service-account, oauth2-client-credentials, "
                                 "oauth2-refresh-token (or no type: and preset:/secret: for a "
                                 "key from the secret store)"]),
    ("c:\n  type: github-app\n  app_id: 1\n  private_key: k\n",
     ['2: credential "c" (type github-app) has no installation_id; add installation_id: '
      "<number>"]),
    ("c:\n  type: github-app\n  app_id: 0\n  installation_id: 1\n  private_key: 'a b'\n",
     ["3: app_id must be a positive whole number",
      "5: private_key: \"a b\" is not a secret name; name the secret in the store that holds "
      "it (letters, digits, '.', '_', '-')"]),
    ("c:\n  type: github-app\n  app_id: 1\n  installation_id: 1\n  private_key: k\n"
     "  permissions: {contents: all}\n",
     ['6: credential "c" (type github-app): permission contents: \'all\' is not one of read, '
      "write, admin"]),
    ("c:\n  type: oauth2-client-credentials\n  token_url: 'http://idp/t'\n  client_id: x\n"
     "  client_secret: s\n  hosts: [a.example.com]\n",
     ['3: token_url: "http://idp/t" must be an https:// URL without query or credentials '
      "(the gateway's own calls use TLS only)"]),
    ("c:\n  type: aws-sigv4\n  service: bedrock\n  region: us-east-1\n  access_key_id: a\n",
     ['5: credential "c" (type aws-sigv4): access_key_id and secret_access_key go together '
      "(the names of the two secrets holding the key pair)"]),
    ("c:\n  type: aws-sigv4\n  service: bedrock\n  region: us-east-1\n  web_identity: true\n",
     ['2: credential "c" (type aws-sigv4): web_identity: true needs role_arn: (the role to '
      "assume)"]),
    ("c:\n  type: gcp-service-account\n", ['2: credential "c" (type gcp-service-account): '
                                           "needs exactly one of key: (the secret holding the "
                                           "service account's JSON key) or workload_identity: "
                                           "true"]),
    ("c:\n  type: oauth2-client-credentials\n  token_url: 'https://idp/t'\n  client_id: x\n"
     "  client_secret: s\n",
     ['2: credential "c" (type oauth2-client-credentials) has no hosts; add hosts: [<the API '
      "hosts this token may be sent to>]"]),
]


@pytest.mark.parametrize(("text", "problems"), REFUSED)
def test_what_is_refused_and_where(text: str, problems: list[str]) -> None:
    assert credentials(text) == ({}, problems)


def test_names_are_global_across_files() -> None:
    first = CredentialDef(Credential(name="c", secret="k", hosts=("a.example.com",),
                                     injection=Injection("bearer")), "policies/other.yaml:7")
    found, problems = credentials("c: {preset: openai, secret: k}\nd: {preset: openai, "
                                  "secret: k}\nd: {preset: openai, secret: k}\n", {"c": first})
    assert list(found) == ["d"]
    assert problems == [
        '1: duplicate credential "c" (first defined at policies/other.yaml:7); credential '
        "names are global across all policy files",
        f'3: duplicate credential "d" (first defined at {FILE}:2); credential names are '
        "global across all policy files"]


@pytest.mark.parametrize(("text", "problems"), [
    ("~", []),
    ("[a]", ["1: credentials must be a mapping of name: {preset: ..., secret: ...}"]),
])
def test_the_section(text: str, problems: list[str]) -> None:
    assert credentials(text) == ({}, problems)
