"""The core's part in minted credentials: the `token` carrier, a fixed placement
(Entra ID: always Bearer), git's Basic challenge, and the exchange's signing step."""

from __future__ import annotations

import base64
from collections.abc import Callable

import pytest

from gateway.core import credentials
from gateway.core.addresses import Pinned
from gateway.core.leaks import LeakScan
from gateway.core.messages import Headers, RequestHead
from gateway.core.policy import Credential, Decision
from gateway.core.refusal import Refusal, answer
from gateway.core.target import Target
from gateway.pipeline.exchange import Exchange
from gateway.services.identity.signing_keys import SigningKeys
from gateway.services.identity.tokens import TokenService
from gateway.services.policy import load_policy_text
from gateway.services.state.base import MemoryState

POLICY = """
version: v1
name: agent
egress:
  - host: api.github.com
    credential: github
  - host: x.openai.azure.com
    credential: aoai
credentials:
  github: {type: github-app, app_id: 1, installation_id: 2, private_key: k}
  aoai: {type: azure-entra}
"""
CREDS = load_policy_text("p.yaml", POLICY).credentials
GITHUB: Credential = CREDS["github"]
AOAI: Credential = CREDS["aoai"]


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> TokenService:
    keys = SigningKeys.load(tmp_path_factory.mktemp("keys"))
    return TokenService(keys, MemoryState(), {"agent": ["github", "aoai"]}.get)


def _basic(token: str) -> str:
    return "Basic " + base64.b64encode(f"me:{token}".encode()).decode()


def _swap(service: TokenService, credential: Credential, host: str,
          carry: Callable[[str], list[tuple[str, str]]]) -> Headers:
    token = service.mint("s1", "agent").token
    headers = Headers.of(*carry(token))
    swap, path = credentials.plan(credential, headers, Target("https", host, 443, "/x"),
                                  service.verify(token), service.verify, "p.yaml:5")
    credentials.apply(swap, headers, path, "MINTED")
    assert token not in repr(headers.fields)
    return headers


@pytest.mark.parametrize(("carry", "expected"), [
    (lambda t: [("Authorization", f"token {t}")], "token MINTED"),
    (lambda t: [("Authorization", f"Bearer {t}")], "Bearer MINTED"),
    (lambda t: [("Authorization", _basic(t))],
     "Basic " + base64.b64encode(b"x-access-token:MINTED").decode()),
])
def test_github_token_goes_into_the_carrier_the_client_used(
        service: TokenService, carry: Callable[[str], list[tuple[str, str]]],
        expected: str) -> None:
    headers = _swap(service, GITHUB, "api.github.com", carry)
    assert headers.get("authorization") == expected


@pytest.mark.parametrize("carry", [lambda t: [("api-key", t)],
                                   lambda t: [("Authorization", f"Bearer {t}")]])
def test_entra_token_always_goes_as_bearer(
        service: TokenService, carry: Callable[[str], list[tuple[str, str]]]) -> None:
    headers = _swap(service, AOAI, "x.openai.azure.com", carry)
    assert headers.get("authorization") == "Bearer MINTED" and headers.get("api-key") is None


def test_no_token_on_a_github_rule_is_a_basic_challenge(service: TokenService) -> None:
    token = service.mint("s1", "agent").token
    with pytest.raises(Refusal) as info:
        credentials.plan(GITHUB, Headers(), Target("https", "github.com", 443, "/r.git"),
                         service.verify(token), service.verify, "p.yaml:5")
    assert info.value.code == "credential_required" and info.value.status == 401
    rendered = answer(info.value)
    assert rendered.status == 401 and rendered.reason.startswith("credential_required")
    assert rendered.headers.get("www-authenticate") == 'Basic realm="sandbox-gateway"'
    assert not rendered.close  # git retries on the same connection
    with pytest.raises(Refusal) as other:  # other credentials keep their 403
        credentials.plan(AOAI, Headers(), Target("https", "x.openai.azure.com", 443, "/"),
                         service.verify(token), service.verify, "p.yaml:7")
    assert other.value.code == "credential_not_in_scope"


class RecordingSigner:
    def __init__(self, needs_body: bool) -> None:
        self.body_needed = needs_body
        self.signed: list[bytes | None] = []

    def needs_body(self, head: RequestHead) -> bool:
        return self.body_needed

    def sign(self, head: RequestHead, target: Target, body: bytes | None) -> None:
        self.signed.append(body)
        head.headers.set("Authorization", f"SIGNED {len(body or b'')}")


def _exchange() -> Exchange:
    head = RequestHead("POST", "/model/m/converse", Headers.of(("Host", "h.example")),
                       "HTTP/1.1")
    ex = Exchange(None, None, None, None, head,  # type: ignore[arg-type]
                  Target("https", "h.example", 443, "/model/m/converse"),
                  Decision("allow", "ok", None), Pinned("h.example", 443, "127.0.0.1"), 0.0)
    ex.credential = "bedrock"
    ex.scan = LeakScan([], [])
    return ex


def test_a_body_signature_is_made_once_the_body_is_whole() -> None:
    ex, signer = _exchange(), RecordingSigner(needs_body=True)
    ex.sign_with(signer)
    assert ex.signing and signer.signed == [] and ex.hold_limit > 1024 * 1024
    assert ex.request_whole(b'{"a": 1}') == b'{"a": 1}'
    assert signer.signed == [b'{"a": 1}'] and ex.signed and not ex.signing
    assert ex.head.headers.get("authorization") == "SIGNED 8"


def test_a_body_signature_refuses_streaming() -> None:
    ex = _exchange()
    ex.sign_with(RecordingSigner(needs_body=True))
    with pytest.raises(Refusal) as info:
        ex.streaming()
    assert info.value.code == "unsupported" and "UNSIGNED-PAYLOAD" in info.value.reason
    with pytest.raises(Refusal):
        ex.request_data(b"chunk")


def test_an_unsigned_payload_is_signed_at_once_and_may_stream() -> None:
    ex, signer = _exchange(), RecordingSigner(needs_body=False)
    ex.sign_with(signer)
    assert signer.signed == [None] and not ex.signing
    ex.streaming()  # no refusal
    assert ex.request_data(b"x" * 100) is not None
