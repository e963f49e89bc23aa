"""The CA: created once, private key 0600, mitmproxy confdir that mitmproxy loads, admin token."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from mitmproxy.certs import CertStore

from gateway.net import ca


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_ensure_ca_creates_an_ec_ca_once(tmp_path: Path) -> None:
    directory = tmp_path / "certs"
    cert_path, key_path = ca.ensure_ca(directory)
    assert (cert_path, key_path) == (directory / "ca.crt", directory / "ca.key")
    assert mode(key_path) == 0o600

    key = serialization.load_pem_private_key(key_path.read_bytes(), password=None)
    assert isinstance(key, ec.EllipticCurvePrivateKey)
    assert key.curve.name == "secp256r1"
    cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    assert cert.subject == cert.issuer
    assert cert.public_key() == key.public_key()
    constraints = cert.extensions.get_extension_for_class(x509.BasicConstraints)
    assert constraints.critical and constraints.value.ca
    usage = cert.extensions.get_extension_for_class(x509.KeyUsage).value
    assert usage.key_cert_sign and usage.crl_sign
    assert (cert.not_valid_after_utc - cert.not_valid_before_utc).days > 365 * 9

    before = (cert_path.read_bytes(), key_path.read_bytes())
    assert ca.ensure_ca(directory) == (cert_path, key_path)
    assert (cert_path.read_bytes(), key_path.read_bytes()) == before


@pytest.mark.parametrize("missing", [ca.CA_KEY, ca.CA_CERT])
def test_ensure_ca_refuses_half_a_pair(tmp_path: Path, missing: str) -> None:
    ca.ensure_ca(tmp_path)
    (tmp_path / missing).unlink()
    with pytest.raises(ca.CAError) as info:
        ca.ensure_ca(tmp_path)
    message = str(info.value)
    assert str(tmp_path / missing) in message
    assert "missing" in message and "remove both" in message
    assert not (tmp_path / missing).exists()  # never silently replaced


def test_mitmproxy_confdir_is_loadable_and_issues_leaf_certs(tmp_path: Path) -> None:
    cert_path, key_path = ca.ensure_ca(tmp_path / "certs")
    confdir = ca.mitmproxy_confdir(cert_path, key_path, tmp_path / "run")
    assert confdir == tmp_path / "run" / "mitmproxy"
    combined = confdir / f"{ca.MITMPROXY_BASENAME}-ca.pem"
    assert mode(combined) == 0o600
    assert mode(confdir) == 0o700
    assert not list((tmp_path / "certs").glob("mitmproxy*"))  # never written into certs/

    store = CertStore.from_files(combined, confdir / "mitmproxy-dhparam.pem")
    ca_cert = x509.load_pem_x509_certificate(cert_path.read_bytes())
    entry = store.get_cert("example.test", [])
    leaf = x509.load_pem_x509_certificate(entry.cert.to_pem())
    assert leaf.issuer == ca_cert.subject
    cn = leaf.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
    assert [a.value for a in cn] == ["example.test"]
    with_san = store.get_cert("api.example.test", [x509.DNSName("api.example.test")])
    sans = x509.load_pem_x509_certificate(with_san.cert.to_pem()).extensions \
        .get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.DNSName) == ["api.example.test"]
    ca_key = ca_cert.public_key()
    assert isinstance(ca_key, ec.EllipticCurvePublicKey)
    ca_key.verify(leaf.signature, leaf.tbs_certificate_bytes,
                  ec.ECDSA(leaf.signature_hash_algorithm))  # type: ignore[arg-type]


def test_mitmproxy_confdir_rewrites_with_private_mode(tmp_path: Path) -> None:
    cert_path, key_path = ca.ensure_ca(tmp_path / "certs")
    confdir = tmp_path / "run" / "mitmproxy"
    confdir.mkdir(parents=True)
    stale = confdir / "mitmproxy-ca.pem"
    stale.write_bytes(b"stale")
    stale.chmod(0o644)
    ca.mitmproxy_confdir(cert_path, key_path, tmp_path / "run")
    assert mode(stale) == 0o600
    assert stale.read_bytes().startswith(key_path.read_bytes().rstrip())


def test_mitmproxy_confdir_refuses_a_mismatched_pair(tmp_path: Path) -> None:
    cert_a, _ = ca.ensure_ca(tmp_path / "a")
    _, key_b = ca.ensure_ca(tmp_path / "b")
    with pytest.raises(ca.CAError, match="do not belong together"):
        ca.mitmproxy_confdir(cert_a, key_b, tmp_path / "run")
    assert not (tmp_path / "run" / "mitmproxy" / "mitmproxy-ca.pem").exists()


def test_mitmproxy_confdir_missing_files(tmp_path: Path) -> None:
    with pytest.raises(ca.CAError, match="cannot read the CA"):
        ca.mitmproxy_confdir(tmp_path / "ca.crt", tmp_path / "ca.key", tmp_path / "run")


def test_admin_token_generated_once(tmp_path: Path) -> None:
    token, created = ca.ensure_admin_token(tmp_path / "certs")
    path = tmp_path / "certs" / ca.ADMIN_TOKEN
    assert created
    assert len(token) >= 32
    assert mode(path) == 0o600
    assert path.read_text() == token + "\n"
    assert ca.ensure_admin_token(tmp_path / "certs") == (token, False)
    assert ca.ensure_admin_token(tmp_path / "other")[0] != token


def test_admin_token_operator_supplied(tmp_path: Path) -> None:
    (tmp_path / ca.ADMIN_TOKEN).write_text("  operator-chosen-token-123  \n")
    assert ca.ensure_admin_token(tmp_path) == ("operator-chosen-token-123", False)


@pytest.mark.parametrize("content", ["", "short\n", "   \n"])
def test_admin_token_too_short(tmp_path: Path, content: str) -> None:
    (tmp_path / ca.ADMIN_TOKEN).write_text(content)
    with pytest.raises(ca.CAError, match="shorter than 16 characters"):
        ca.ensure_admin_token(tmp_path)


def test_write_private_tightens_an_existing_file(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "secret"
    ca.write_private(path, b"one")
    assert mode(path) == 0o600
    path.chmod(0o666)
    ca.write_private(path, b"two")
    assert path.read_bytes() == b"two"
    assert mode(path) == 0o600
