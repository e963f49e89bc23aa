"""`aws-sigv4`: the AWS credentials the gateway signs with.

From a static key pair in the secret store (``access_key_id``/``secret_access_key``
name the two secrets), optionally exchanged for a role's temporary credentials with
STS ``AssumeRole`` (``role_arn``), or, on EKS, ``AssumeRoleWithWebIdentity`` with the
pod's projected service-account token (``web_identity: true``; the file is
``token_file`` or ``$AWS_WEB_IDENTITY_TOKEN_FILE``). STS requests are built and their
answers parsed with botocore's STS model, serializer and parser, and signed with
botocore's SigV4 signer; they travel through `TokenHttp`. The value is the key set as
JSON, each part a leak marker; temporary credentials live until their Expiration.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import botocore.parsers
import botocore.serialize
import botocore.session
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
from botocore.exceptions import ParamValidationError

from gateway.core.policy.minted import MintSpec
from gateway.core.secret_value import MintedValue
from gateway.services.minting.base import MintContext, MintFailed, clean, read_secret

__all__ = ["AwsMinter", "key_set"]


@functools.cache
def _sts_model() -> Any:
    return botocore.session.get_session().get_service_model("sts")


def key_set(access_key_id: str, secret_access_key: str, session_token: str | None,
            lifetime: float | None) -> MintedValue:
    """The minted value of an AWS key set (JSON; each part a leak marker)."""
    data = {"access_key_id": access_key_id, "secret_access_key": secret_access_key,
            "session_token": session_token}
    return MintedValue(json.dumps(data, sort_keys=True), lifetime=lifetime,
                       parts=(access_key_id, secret_access_key, session_token or ""))


class AwsMinter:
    """Static, assumed-role or web-identity credentials for one aws-sigv4 credential."""

    def __init__(self, spec: MintSpec, context: MintContext) -> None:
        self.spec = spec
        self.context = context
        self.region = spec.text("region") or "us-east-1"
        self.role = spec.text("role_arn")
        self.sts_url = spec.text("sts_url") or f"https://sts.{self.region}.amazonaws.com"

    async def mint(self, fresh: bool) -> MintedValue:
        if self.spec.flag("web_identity"):
            token = self._web_identity_token()
            return await self._sts("AssumeRoleWithWebIdentity", {
                "RoleArn": self.role, "RoleSessionName": self._session_name(),
                "WebIdentityToken": token, "DurationSeconds": self._duration()}, None)
        access = await read_secret(self.context.secrets, self.spec.text("access_key_id") or "",
                                   "AWS access key id")
        secret = await read_secret(self.context.secrets,
                                   self.spec.text("secret_access_key") or "",
                                   "AWS secret access key")
        base = Credentials(access.reveal().strip(), secret.reveal().strip())
        if self.role is None:
            return key_set(base.access_key, base.secret_key, None, None)
        params: dict[str, Any] = {"RoleArn": self.role, "RoleSessionName": self._session_name(),
                                  "DurationSeconds": self._duration()}
        if self.spec.text("external_id"):
            params["ExternalId"] = self.spec.text("external_id")
        return await self._sts("AssumeRole", params, base)

    def _session_name(self) -> str:
        return self.spec.text("session_name") or "sandbox-gateway"

    def _duration(self) -> int:
        value = self.spec.get("duration")
        return value if isinstance(value, int) and not isinstance(value, bool) else 3600

    def _web_identity_token(self) -> str:
        path = self.spec.text("token_file") or os.environ.get("AWS_WEB_IDENTITY_TOKEN_FILE")
        if not path:
            raise MintFailed("web_identity: true, but no token file: set token_file: or "
                             "AWS_WEB_IDENTITY_TOKEN_FILE (the EKS pod identity webhook sets "
                             "it for a service account annotated with the role)")
        try:
            return Path(path).read_text().strip()
        except OSError as exc:
            raise MintFailed(f"cannot read the web identity token {path}: "
                             f"{exc.strerror or type(exc).__name__}", transient=True) from None

    async def _sts(self, action: str, params: dict[str, Any],
                   signer: Credentials | None) -> MintedValue:
        operation = _sts_model().operation_model(action)
        try:
            built = botocore.serialize.create_serializer("query").serialize_to_request(
                params, operation)
        except ParamValidationError as exc:
            raise MintFailed(f"STS {action}: {clean(exc, 300)}") from None
        body = urlencode(built["body"]).encode()
        request = AWSRequest(method="POST", url=self.sts_url + "/", data=body,
                             headers=dict(built["headers"]))
        if signer is not None:
            SigV4Auth(signer, "sts", self.region).add_auth(request)
        reply = await self.context.http.request("POST", request.url,
                                                headers=dict(request.headers.items()),
                                                data=body)
        parsed = botocore.parsers.create_parser("query").parse(
            {"status_code": reply.status, "headers": dict(reply.headers), "body": reply.body},
            operation.output_shape)
        error = parsed.get("Error") if isinstance(parsed, dict) else None
        if reply.status != 200 or error:
            code = clean((error or {}).get("Code", ""), 64)
            message = clean((error or {}).get("Message", ""), 200)
            raise MintFailed(f"STS {self.sts_url} {action} for {self.role} answered "
                             f"{reply.status}{f' ({code}: {message})' if code else ''}",
                             status=reply.status, retry_after=reply.retry_after(),
                             transient=reply.status == 429 or reply.status >= 500)
        try:
            creds = parsed["Credentials"]
            expiration = creds["Expiration"].timestamp()
            return key_set(creds["AccessKeyId"], creds["SecretAccessKey"],
                           creds["SessionToken"], expiration - self.context.clock())
        except (KeyError, TypeError, AttributeError):
            raise MintFailed(f"STS {action} answered without credentials") from None

    async def close(self) -> None:
        return None
