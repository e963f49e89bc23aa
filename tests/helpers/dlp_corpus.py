"""FAKE credentials in each detector's real format (issue 43), generated here from a
seeded generator: none is a live key. One `Fake` per detector: the text a leaking client
would send (a bare key, or a key beside the name it is assigned to, for detectors that
need the name) and the detector that must find it."""

from __future__ import annotations

import base64
import functools
import json
import random
import string
from dataclasses import dataclass

__all__ = ["CORPUS", "Fake", "fake"]

_R = random.Random(43)
ALNUM = string.ascii_letters + string.digits
LOWER = string.ascii_lowercase + string.digits
HEX = "0123456789abcdef"
URLSAFE = ALNUM + "-_"


def _s(alphabet: str, n: int) -> str:
    return "".join(_R.choice(alphabet) for _ in range(n))


def _b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


@functools.cache
def _pem() -> str:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    # (from a seeded scalar, as every fake here: a key made at random each run holds an
    # anchor here or there, and a test reading where anchors fall passed or not by it)
    order = 0xFFFFFFFF00000000FFFFFFFFFFFFFFFFBCE6FAADA7179E84F3B9CAC2FC632551
    key = ec.derive_private_key(random.Random(47).randrange(1, order), ec.SECP256R1())
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption()).decode()


@dataclass(frozen=True)
class Fake:
    detector: str
    text: str
    opt_in: bool = False
    value: str = ""  # the credential inside `text`, where `text` holds more

    @property
    def secret(self) -> str:
        return self.value or self.text


def _jwt() -> str:
    head = _b64url(b'{"alg":"HS256","typ":"JWT"}')
    body = _b64url(json.dumps({"sub": "fake-user", "iat": 1700000000}).encode())
    return f"{head}.{body}.{_b64url(_R.randbytes(32))}"


def _gcp() -> Fake:
    key_id = _s(HEX, 40)
    return Fake("gcp-service-account", json.dumps({
        "type": "service_account", "project_id": "fake-project-43", "private_key_id": key_id,
        "private_key": _pem(), "client_email": "fake@fake-project-43.iam.gserviceaccount.com"}),
        value=key_id)


def _azure() -> Fake:
    key = _s(ALNUM + "+/", 86) + "=="
    return Fake("azure-storage", "DefaultEndpointsProtocol=https;AccountName=fakeacct;"
                f"AccountKey={key};EndpointSuffix=core.windows.net", value=key)


def _with(detector: str, template: str, value: str, opt_in: bool = False) -> Fake:
    return Fake(detector, template.format(value), opt_in, value)


def _build() -> tuple[Fake, ...]:
    return (
        Fake("aws", "AKIA" + _s(string.ascii_uppercase + string.digits, 16)),
        _azure(),
        _with("basic-auth", "https://deploy:{}@git.example.test/repo.git", _s(ALNUM, 18)),
        Fake("github", "ghp_" + _s(ALNUM, 36)),
        Fake("gitlab", "glpat-" + _s(URLSAFE, 20)),
        Fake("slack", f"xoxb-{_s(string.digits, 12)}-{_s(string.digits, 13)}-{_s(LOWER, 24)}"),
        Fake("stripe", "sk_live_" + _s(ALNUM, 24)),
        Fake("twilio", "AC" + _s(HEX, 32)),
        Fake("private-key", _pem()),
        Fake("jwt", _jwt()),
        Fake("openai", "sk-proj-" + _s(ALNUM, 74) + "T3BlbkFJ" + _s(ALNUM, 74)),
        Fake("anthropic", "sk-ant-api03-" + _s(URLSAFE, 93) + "AA"),
        Fake("huggingface", "hf_" + _s(string.ascii_letters, 34)),
        _gcp(),
        Fake("gcp-api-key", "AIza" + _s(URLSAFE, 35)),
        _with("npm", "//registry.npmjs.org/:_authToken={}", "npm_" + _s(ALNUM, 36)),
        Fake("pypi", "pypi-AgEIcHlwaS5vcmc" + _s(URLSAFE, 150)),
        Fake("sendgrid", f"SG.{_s(URLSAFE, 22)}.{_s(URLSAFE, 43)}"),
        Fake("mailchimp", _s(HEX, 32) + "-us12"),
        Fake("square", "sq0csp-" + _s(URLSAFE, 43)),
        Fake("artifactory", "AKC" + _s(ALNUM, 70)),
        Fake("discord", f"M{_s(URLSAFE, 23)}.{_s(URLSAFE, 6)}.{_s(URLSAFE, 27)}", True),
        Fake("telegram", f"{_s(string.digits, 9)}:{_s(URLSAFE, 35)}", True),
        _with("cloudant", 'cloudant_password = "{}"', _s(HEX, 64), True),
        _with("ibm-cloud-iam", 'ibm_cloud_iam_api_key = "{}"', _s(URLSAFE, 44), True),
        _with("ibm-cos-hmac", 'ibm_cos_hmac_secret_access_key = "{}"', _s(HEX, 48), True),
        _with("softlayer", 'softlayer_api_key = "{}"', _s(LOWER, 64), True),
        _with("keyword", 'db_password = "{}"', _s(ALNUM, 20), True),
        _with("high-entropy", '"{}"', _s(ALNUM + "+/", 44), True),
    )


CORPUS: tuple[Fake, ...] = _build()
DEFAULT_CORPUS = tuple(f for f in CORPUS if not f.opt_in)


def fake(detector: str) -> Fake:
    return next(f for f in CORPUS if f.detector == detector)
