"""A stand-in for api.openai.com on 127.0.0.1: TLS with a throwaway CA, one endpoint
(`POST /v1/chat/completions`) that answers only the real key, and a record of every
Authorization header it received."""

from __future__ import annotations

import datetime
import json
import ssl
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID


def _cert(subject: str, key: ec.EllipticCurvePrivateKey, issuer: x509.Name,
          signer: ec.EllipticCurvePrivateKey, ca: bool) -> x509.Certificate:
    now = datetime.datetime.now(datetime.UTC)
    builder = (x509.CertificateBuilder()
               .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
               .issuer_name(issuer).public_key(key.public_key())
               .serial_number(x509.random_serial_number())
               .not_valid_before(now - datetime.timedelta(hours=1))
               .not_valid_after(now + datetime.timedelta(days=1))
               .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True))
    if not ca:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.DNSName(subject)]), critical=False)
    return builder.sign(signer, hashes.SHA256())


class FakeOpenAI:
    """Started on 127.0.0.1:<port>; `ca_path` is the CA the gateway must trust."""

    def __init__(self, directory: Path, real_key: str) -> None:
        self.real_key = real_key
        self.seen_authorization: list[str] = []
        ca_key = ec.generate_private_key(ec.SECP256R1())
        ca_cert = _cert("demo provider CA", ca_key, x509.Name(
            [x509.NameAttribute(NameOID.COMMON_NAME, "demo provider CA")]), ca_key, ca=True)
        leaf_key = ec.generate_private_key(ec.SECP256R1())
        leaf = _cert("api.openai.com", leaf_key, ca_cert.subject, ca_key, ca=False)
        self.ca_path = directory / "provider-ca.pem"
        self.ca_path.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
        (directory / "provider.pem").write_bytes(
            leaf.public_bytes(serialization.Encoding.PEM) + leaf_key.private_bytes(
                serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption()))
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(directory / "provider.pem")
        handler = type("Handler", (_Handler,), {"fake": self})
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.server.daemon_threads = True
        self.server.socket = ctx.wrap_socket(self.server.socket, server_side=True)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    fake: FakeOpenAI

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        auth = self.headers.get("Authorization", "")
        self.fake.seen_authorization.append(auth)
        if auth != f"Bearer {self.fake.real_key}":
            return self._json(401, {"error": {"message": "Incorrect API key provided",
                                              "type": "invalid_request_error",
                                              "code": "invalid_api_key"}})
        return self._json(200, {
            "id": "chatcmpl-demo", "object": "chat.completion", "created": 0,
            "model": "gpt-4o-mini", "choices": [{
                "index": 0, "finish_reason": "stop",
                "message": {"role": "assistant", "content": "Hello from the provider!"}}],
            "usage": {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}})

    def _json(self, status: int, doc: object) -> None:
        body = json.dumps(doc).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
