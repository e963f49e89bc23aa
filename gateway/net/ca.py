"""The gateway's certificate authority: create it once, hand it to mitmproxy.

`certs/ca.crt` is what sandboxes trust; `certs/ca.key` signs the leaf certificates
mitmproxy makes on the fly. The key is ECDSA P-256: leaf signing and TLS handshakes
cost a fraction of RSA-2048. mitmproxy reads `<confdir>/mitmproxy-ca.pem` (key then
certificate); we write that into a private runtime directory, never into `certs/`.
"""

from __future__ import annotations

import datetime
import os
import secrets
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

CA_CERT = "ca.crt"
CA_KEY = "ca.key"
ADMIN_TOKEN = "admin-token"
MITMPROXY_BASENAME = "mitmproxy"


class CAError(RuntimeError):
    """The CA files are missing, unreadable or do not belong together."""


def write_private(path: Path, data: bytes) -> None:
    """Write a file only its owner can read (created 0600, never world-readable)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o600)  # os.open's mode applies only when it creates the file
        f.write(data)


def create_ca(directory: Path, common_name: str = "sandbox-gateway CA") -> tuple[Path, Path]:
    """Generate a CA key and a 10-year self-signed CA certificate into `directory`."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([
        x509.NameAttribute(NameOID.COMMON_NAME, common_name),
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "sandbox-gateway"),
    ])
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(days=2))
        .not_valid_after(now + datetime.timedelta(days=3650))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True, key_cert_sign=True, crl_sign=True,
                content_commitment=False, key_encipherment=False, data_encipherment=False,
                key_agreement=False, encipher_only=False, decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    key_path, cert_path = directory / CA_KEY, directory / CA_CERT
    write_private(key_path, key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    ))
    directory.mkdir(parents=True, exist_ok=True)
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert_path, key_path


def ensure_ca(directory: Path) -> tuple[Path, Path]:
    """Return (cert, key) paths, creating the CA if neither file exists."""
    cert_path, key_path = directory / CA_CERT, directory / CA_KEY
    if not cert_path.exists() and not key_path.exists():
        return create_ca(directory)
    if not (cert_path.exists() and key_path.exists()):
        missing = key_path if cert_path.exists() else cert_path
        raise CAError(f"{missing} is missing; restore it or remove both CA files to make a new CA")
    return cert_path, key_path


def mitmproxy_confdir(cert_path: Path, key_path: Path, runtime_dir: Path) -> Path:
    """Write mitmproxy's combined `mitmproxy-ca.pem` (key + cert) and return the confdir."""
    try:
        key_pem = key_path.read_bytes()
        cert_pem = cert_path.read_bytes()
    except OSError as exc:
        raise CAError(f"cannot read the CA: {exc}") from None
    key = serialization.load_pem_private_key(key_pem, password=None)
    cert = x509.load_pem_x509_certificate(cert_pem)
    if cert.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    ) != key.public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    ):
        raise CAError(f"{cert_path} and {key_path} do not belong together")
    confdir = runtime_dir / "mitmproxy"
    confdir.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_private(confdir / f"{MITMPROXY_BASENAME}-ca.pem", key_pem.rstrip() + b"\n" + cert_pem)
    return confdir


def ensure_admin_token(directory: Path) -> tuple[str, bool]:
    """Read `certs/admin-token`, or generate it. Returns (token, created)."""
    path = directory / ADMIN_TOKEN
    if path.exists():
        token = path.read_text(encoding="utf-8").strip()
        if len(token) < 16:
            raise CAError(f"{path} holds a token shorter than 16 characters; replace it")
        return token, False
    token = secrets.token_urlsafe(32)
    write_private(path, token.encode() + b"\n")
    return token, True


def admin_token_line(certs: Path, configured: bool, created: bool) -> str:
    """Where the admin token is, for a banner: never the token itself (banners end up in
    logs). `configured`: it came from the config or the environment."""
    if configured:
        return "  admin token: from admin_token / SANDBOX_GATEWAY_ADMIN_TOKEN (not shown)"
    path = certs / ADMIN_TOKEN
    if created:
        return f"  admin token: generated into {path} (mode 0600; read it from there)"
    return f"  admin token: in {path}"
