"""Minted credential types in policy files: fields checked per type, defaults, hosts,
carriers, and the secret-cache name that changes with the spec."""

from __future__ import annotations

import pytest

from gateway.core.policy.minted import MINTED_PREFIX, TYPES
from gateway.services.policy import PolicyError, load_policy_text
from gateway.services.policy.diff import diff_sets

HEAD = """
version: v1
name: agent
egress:
  - host: {host}
    credential: c
credentials:
  c: {spec}
"""


def _load(spec: str, host: str = "api.github.com") -> object:
    return load_policy_text("p.yaml", HEAD.format(spec=spec, host=host)).credentials["c"]


def _errors(spec: str, host: str = "api.github.com") -> str:
    with pytest.raises(PolicyError) as info:
        load_policy_text("p.yaml", HEAD.format(spec=spec, host=host))
    return "\n".join(info.value.errors)


GITHUB = "{type: github-app, app_id: 12, installation_id: '34', private_key: gh-key}"


def test_github_app_defaults() -> None:
    c = _load(GITHUB)
    assert c.kind == "github-app" and c.hosts == ("github.com", "api.github.com")
    assert c.mint is not None and c.mint.get("app_id") == 12
    assert c.mint.get("installation_id") == 34
    assert c.mint.text("api_url") == "https://api.github.com"
    assert c.mint.secrets == ("gh-key",) and c.challenge and not c.signs
    assert [k.kind for k in c.injection.carriers] == ["basic", "bearer", "token"]
    assert c.injection.name == "x-access-token" and c.places is None
    assert c.secret.startswith(MINTED_PREFIX + "c:")


@pytest.mark.parametrize(("spec", "host", "hosts", "places"), [
    ("{type: azure-entra}", "x.openai.azure.com",
     ("*.openai.azure.com", "*.cognitiveservices.azure.com"), "bearer"),
    ("{type: aws-sigv4, service: bedrock, region: eu-west-1, access_key_id: a, "
     "secret_access_key: b}", "bedrock-runtime.eu-west-1.amazonaws.com",
     ("bedrock-runtime.eu-west-1.amazonaws.com", "bedrock.eu-west-1.amazonaws.com",
      "bedrock-agent-runtime.eu-west-1.amazonaws.com"), None),
    ("{type: aws-sigv4, service: s3, region: us-east-2, web_identity: true, "
     "role_arn: 'arn:aws:iam::1:role/r'}", "s3.us-east-2.amazonaws.com",
     ("s3.us-east-2.amazonaws.com",), None),
    ("{type: gcp-service-account, key: sa}", "us-central1-aiplatform.googleapis.com",
     ("aiplatform.googleapis.com", "*-aiplatform.googleapis.com"), "bearer"),
    ("{type: oauth2-client-credentials, token_url: 'https://login.example/t', "
     "client_id: 7, client_secret: cs, hosts: [api.example]}", "api.example",
     ("api.example",), "bearer"),
    ("{type: oauth2-refresh-token, token_url: 'https://login.example/t/', client_id: x, "
     "refresh_token: rt, hosts: [api.example]}", "api.example", ("api.example",), "bearer"),
])
def test_each_type_loads_with_its_hosts(spec: str, host: str, hosts: tuple[str, ...],
                                        places: str | None) -> None:
    c = _load(spec, host)
    assert c.hosts == hosts
    assert (c.places.kind if c.places else None) == places
    assert c.signs == (c.kind == "aws-sigv4")


def test_defaults_are_filled_in() -> None:
    entra = _load("{type: azure-entra}", "x.openai.azure.com").mint
    assert entra.text("scope") == "https://cognitiveservices.azure.com/.default"
    assert entra.text("credential") == "default"
    aws = _load("{type: aws-sigv4, service: bedrock, region: us-east-1, access_key_id: a, "
                "secret_access_key: b, duration: 30m}",
                "bedrock-runtime.us-east-1.amazonaws.com").mint
    assert aws.get("duration") == 1800 and aws.text("session_name") == "sandbox-gateway"
    assert aws.secret_fields == (("access_key_id", "a"), ("secret_access_key", "b"))
    oauth = _load("{type: oauth2-client-credentials, token_url: 'https://l.example/t/', "
                  "client_id: 7, client_secret: cs, hosts: [api.example]}",
                  "api.example").mint
    assert oauth.text("token_url") == "https://l.example/t" and oauth.text("client_id") == "7"
    assert oauth.text("client_auth") == "basic"


@pytest.mark.parametrize(("spec", "host", "message"), [
    ("{type: github-ap, app_id: 1}", "api.github.com",
     'unknown credential type "github-ap" (did you mean "github-app"?)'),
    ("{type: github-app, installation_id: 2, private_key: k}", "api.github.com",
     "has no app_id; add app_id: <number>"),
    ("{type: github-app, app_id: -1, installation_id: 2, private_key: k}", "api.github.com",
     "app_id must be a positive whole number"),
    ("{type: github-app, app_id: 1, installation_id: 2, private_key: 'a key'}",
     "api.github.com", 'private_key: "a key" is not a secret name'),
    ("{type: github-app, app_id: 1, installation_id: 2, private_key: k, secret: s}",
     "api.github.com", 'unknown key "secret" in credential "c" (type github-app)'),
    ("{type: github-app, app_id: 1, installation_id: 2, private_key: k, "
     "permissions: {contents: all}}", "api.github.com",
     "permission contents: 'all' is not one of read, write, admin"),
    ("{type: github-app, app_id: 1, installation_id: 2, private_key: k, "
     "api_url: 'http://ghe.example/api/v3'}", "api.github.com",
     'api_url: "http://ghe.example/api/v3" must be an https:// URL'),
    ("{type: azure-entra, credential: msi}", "x.openai.azure.com",
     "invalid credential 'msi'; use one of default, workload, managed"),
    ("{type: aws-sigv4, region: us-east-1, access_key_id: a, secret_access_key: b}",
     "x.amazonaws.com", "has no service"),
    ("{type: aws-sigv4, service: bedrock, region: us-east-1, access_key_id: a}",
     "bedrock-runtime.us-east-1.amazonaws.com",
     "access_key_id and secret_access_key go together"),
    ("{type: aws-sigv4, service: bedrock, region: us-east-1}",
     "bedrock-runtime.us-east-1.amazonaws.com", "needs a key pair"),
    ("{type: aws-sigv4, service: bedrock, region: us-east-1, web_identity: true}",
     "bedrock-runtime.us-east-1.amazonaws.com", "web_identity: true needs role_arn"),
    ("{type: aws-sigv4, service: bedrock, region: US_EAST, access_key_id: a, "
     "secret_access_key: b}", "x.amazonaws.com", "region 'US_EAST' is not an AWS region"),
    ("{type: aws-sigv4, service: bedrock, region: us-east-1, access_key_id: a, "
     "secret_access_key: b, role_arn: role}", "bedrock-runtime.us-east-1.amazonaws.com",
     "role_arn 'role' must be an ARN"),
    ("{type: aws-sigv4, service: bedrock, region: us-east-1, access_key_id: a, "
     "secret_access_key: b, duration: 5m}", "bedrock-runtime.us-east-1.amazonaws.com",
     "duration must be between 15m and 12h"),
    ("{type: gcp-service-account}", "aiplatform.googleapis.com",
     "needs exactly one of key:"),
    ("{type: gcp-service-account, key: k, workload_identity: true}",
     "aiplatform.googleapis.com", "needs exactly one of key:"),
    ("{type: oauth2-client-credentials, token_url: 'https://l.example/t', client_id: x, "
     "client_secret: s}", "api.example", "has no hosts; add hosts:"),
    ("{type: oauth2-client-credentials, token_url: 'https://l.example/t?x=1', client_id: x,"
     " client_secret: s, hosts: [api.example]}", "api.example",
     "must be an https:// URL without query"),
    ("{type: oauth2-refresh-token, token_url: 'https://l.example/t', client_id: x, "
     "hosts: [api.example]}", "api.example", "has no refresh_token"),
    ("{preset: openai, secret: 'minted:x'}", "api.openai.com",
     'secret names starting "minted:" are the gateway\'s own'),
    ("{type: azure-entra}", "api.openai.com",
     'credential "c" is only sent to *.openai.azure.com'),
])
def test_mistakes_are_reported_with_their_line(spec: str, host: str, message: str) -> None:
    errors = _errors(spec, host)
    assert message in errors, errors
    assert errors.startswith("p.yaml:")


def test_every_type_is_documented() -> None:
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[3] / "docs" / "credentials.md").read_text()
    for name, kind in TYPES.items():
        assert f"`{name}`" in doc, name
        for f in kind.fields:
            assert f"`{f.name}`" in doc, (name, f.name)


def test_a_changed_spec_gets_another_cache_name() -> None:
    a = _load(GITHUB)
    b = _load(GITHUB.replace("'34'", "35"))
    assert a.secret != b.secret and _load(GITHUB).secret == a.secret


def test_policy_diff_shows_the_type_and_fields() -> None:
    base = load_policy_text("p.yaml", HEAD.format(spec=GITHUB, host="api.github.com"))
    head = load_policy_text("p.yaml", HEAD.format(spec=GITHUB.replace("'34'", "35"),
                                                  host="api.github.com"))
    text = repr(diff_sets(base, head))
    assert "installation_id" in text and "35" in text and MINTED_PREFIX not in text


def test_the_documented_examples_load() -> None:
    import re
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[3] / "docs" / "credentials.md").read_text()
    blocks = re.findall(r"```yaml\n(.*?)```", doc, re.S)
    assert len(blocks) == 5
    for i, block in enumerate(blocks):
        policy_set = load_policy_text(f"example{i}.yaml", block)
        assert all(c.mint is not None for c in policy_set.credentials.values())
