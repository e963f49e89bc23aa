"""A local fake of the Kubernetes API server, real enough for the real ``kubectl``.

It listens on 127.0.0.1:<random port> over TLS (a throwaway ``LocalCA``; SANs 127.0.0.1
and localhost, HTTP/1.1 only) in background threads. ``write_kubeconfig`` writes a
kubeconfig for it (the CA file, ``https://127.0.0.1:<port>``, a bearer token), so
``kubectl --kubeconfig FILE get pods`` works. Tests drive the cluster from Python
(``add_pod``, ``update_pod``, ``delete_pod``, ``compact``, ``cut_watches``,
``issue_token``) and read back every request (``requests``, ``seen``). What it serves:

* Authentication: ``Authorization: Bearer <admin_token>`` (user ``kubernetes-admin``,
  group ``system:masters``) or a service-account token of its own that is valid for the
  API audiences (``api_audiences``, by default the issuer, as ``--api-audiences``
  defaults to ``--service-account-issuer``). Anything else gets 401 with a ``Status``,
  except the paths a cluster opens to anonymous users (``/healthz``, ``/livez``,
  ``/readyz``, ``/version``, the OIDC discovery pair). No authorization: every
  authenticated user may do everything.
* Discovery (plain, not aggregated: the API server answers plain JSON to a client that
  also accepts it): ``/api``, ``/api/v1``, ``/apis``, ``/apis/authentication.k8s.io[/v1]``.
* Pods (``/api/v1/pods``, ``/api/v1/namespaces/{ns}/pods[/{name}]``): get and list, with
  ``labelSelector`` (``k=v``, ``k==v``, ``k!=v``, ``k``, ``!k``, ``k in (a,b)``,
  ``k notin (a,b)``), ``fieldSelector`` (the fields a pod is selectable by: ``metadata.name``,
  ``status.podIP``, ``spec.nodeName``, ...), ``limit``/``continue`` (a consistent snapshot
  at the first page's resourceVersion) and ``resourceVersion`` (+ ``resourceVersionMatch=
  Exact``). A client that asks for ``as=Table`` (kubectl's human output) gets a
  ``meta.k8s.io/v1`` Table with the columns the real server prints.
* Watch (``?watch=1``): chunked, newline-delimited JSON events (``ADDED``, ``MODIFIED``,
  ``DELETED``) for every change after ``resourceVersion`` (history replayed; none or
  ``0``: the current pods as ``ADDED`` first), filtered as the watch cache filters (a pod
  that stops matching the selector arrives as ``DELETED``, one that starts matching as
  ``ADDED``); ``allowWatchBookmarks=true``: a ``BOOKMARK`` every ``bookmark_interval``
  seconds; ``sendInitialEvents=true``: the current pods then a bookmark annotated
  ``k8s.io/initial-events-end``; ``timeoutSeconds`` ends the stream cleanly. A watch from
  before the compaction horizon (``compact()``) gets one ``ERROR`` event (410 Expired)
  and the end of the stream, as from the real server. ``cut_watches()`` drops every open
  stream without the final chunk (a restarting API server or a broken connection).
  ``freeze()`` makes the server go silent as behind a dropped route: open streams send
  nothing more (not even bookmarks), new connections and requests get no answer, until
  ``thaw()`` (or ``stop()``). A stream whose client hung up ends within a quarter of a
  second.
  ``resourceVersion`` is one global counter over every write, as etcd's revision.
* Namespaces: get/list (``kubectl get pod X`` asks for the namespace after a 404, to
  say which is missing); the usual four exist, others come with their first pod or
  service account, each with its ``default`` service account.
* Service accounts: get/list, and the TokenRequest subresource
  (``POST .../serviceaccounts/{sa}/token``, bound to a pod or not), which ``kubectl
  create token`` calls with a protobuf body (decoded here; answers are always JSON).
  Service accounts come into being with the first pod that names them (or
  ``add_service_account``).
* ``POST /apis/authentication.k8s.io/v1/tokenreviews`` (201) and ``selfsubjectreviews``
  (``kubectl auth whoami``). A review checks what the real service-account authenticator
  checks: signature, issuer, expiry and not-before, audiences (the request's
  ``spec.audiences``, else ``api_audiences``), that the service account still exists with
  the same uid and that the bound pod still exists with the same uid. As the real server,
  a failed review's status has no ``authenticated`` key (Go's ``omitempty``), a
  ``user: {}`` and an ``error``.
* Projected service-account tokens (``issue_token``): RS256 JWTs signed with the fake's
  RSA key (``kid`` = the key's SHA-256 thumbprint, as kube-apiserver), with the claims a
  1.32 API server writes (``iss``, ``sub``, ``aud``, ``exp``, ``iat``, ``nbf``, ``jti``,
  ``kubernetes.io`` with the namespace, pod, node and service account); the issuer is
  the server's base URL, published with ``GET /.well-known/openid-configuration`` and
  ``GET /openid/v1/jwks``.

The fake keeps the state in memory: pods are replaced, never changed in place, and every
write appends to a history (each entry with the object before it), from which old
resourceVersions are rebuilt for watches, continue tokens and exact reads.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import copy
import hashlib
import json
import re
import select
import socket
import ssl
import sys
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import jwt
import yaml
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from helpers.tls import LocalCA
from jwt.algorithms import RSAAlgorithm

from fakes.http_body import read_body

JSON = dict[str, Any]
HOSTS = ["127.0.0.1", "localhost"]
# What /version reports. Google Cloud SDK's kubectl is a dispatcher that reads it first
# (before any -v logging) and runs the kubectl release matching the server's minor.
SERVER_VERSION = {"major": "1", "minor": "32", "gitVersion": "v1.32.0-fake",
                  "gitCommit": "0" * 40, "gitTreeState": "clean",
                  "buildDate": "2024-12-11T00:00:00Z", "goVersion": "go1.23.3",
                  "compiler": "gc", "platform": "linux/amd64"}
PHASES = ("Pending", "Running", "Succeeded", "Failed", "Unknown")
INITIAL_NAMESPACES = ("default", "kube-node-lease", "kube-public", "kube-system")
NODE_IP = "10.89.0.2"  # the hostIP of every pod (one node's address)
PUBLIC_PATHS = frozenset({"/healthz", "/livez", "/readyz", "/version",
                          "/.well-known/openid-configuration", "/openid/v1/jwks"})
ADMIN_USER: JSON = {"username": "kubernetes-admin",
                    "groups": ["system:masters", "system:authenticated"]}
LIVENESS = 0.25  # seconds between checks that a watching client is still there

# Fields a pod can be selected by (pkg/registry/core/pod/strategy.go ToSelectableFields).
POD_FIELDS: dict[str, Callable[[JSON], str]] = {
    "metadata.name": lambda p: p["metadata"]["name"],
    "metadata.namespace": lambda p: p["metadata"]["namespace"],
    "spec.nodeName": lambda p: p["spec"].get("nodeName", ""),
    "spec.restartPolicy": lambda p: p["spec"].get("restartPolicy", ""),
    "spec.schedulerName": lambda p: p["spec"].get("schedulerName", ""),
    "spec.serviceAccountName": lambda p: p["spec"].get("serviceAccountName", ""),
    "spec.hostNetwork": lambda p: str(p["spec"].get("hostNetwork", False)).lower(),
    "status.phase": lambda p: p["status"].get("phase", ""),
    "status.podIP": lambda p: p["status"].get("podIP", ""),
    "status.nominatedNodeName": lambda p: p["status"].get("nominatedNodeName", ""),
}
META_FIELDS: dict[str, Callable[[JSON], str]] = {
    "metadata.name": lambda o: o["metadata"]["name"],
    "metadata.namespace": lambda o: o["metadata"]["namespace"],
}


def dumps(value: Any) -> bytes:
    """JSON as the API server writes it (compact)."""
    return json.dumps(value, separators=(",", ":")).encode()


def rfc3339(at: float | None = None) -> str:
    """A timestamp as the API server writes it (seconds, UTC, ``Z``)."""
    moment = datetime.now(UTC) if at is None else datetime.fromtimestamp(at, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def human_duration(seconds: float) -> str:
    """An age as kubectl's AGE column shows it (apimachinery's ``HumanDuration``)."""
    s = int(seconds)
    if s < -1:
        return "<invalid>"
    if s < 0:
        return "0s"
    if s < 120:
        return f"{s}s"
    minutes, hours = s // 60, s // 3600
    if minutes < 10:
        return f"{minutes}m{s % 60}s" if s % 60 else f"{minutes}m"
    if minutes < 180:
        return f"{minutes}m"
    if hours < 8:
        return f"{hours}h{minutes % 60}m" if minutes % 60 else f"{hours}h"
    if hours < 48:
        return f"{hours}h"
    if hours < 24 * 8:
        return f"{hours // 24}d{hours % 24}h" if hours % 24 else f"{hours // 24}d"
    return f"{hours // 24}d"


def status_object(code: int, reason: str, message: str,
                  details: JSON | None = None) -> JSON:
    """A ``Status`` (the API server's error body)."""
    out: JSON = {"kind": "Status", "apiVersion": "v1", "metadata": {},
                 "status": "Failure", "message": message, "reason": reason}
    if details is not None:
        out["details"] = details
    out["code"] = code
    return out


class ApiError(Exception):
    """An error the server answers with a ``Status`` body."""

    def __init__(self, code: int, reason: str, message: str,
                 details: JSON | None = None) -> None:
        super().__init__(message)
        self.code, self.reason, self.message, self.details = code, reason, message, details

    def status(self) -> JSON:
        return status_object(self.code, self.reason, self.message, self.details)


def not_found(resource: str, name: str) -> ApiError:
    return ApiError(404, "NotFound", f'{resource} "{name}" not found',
                    {"name": name, "kind": resource})


def bad_request(message: str) -> ApiError:
    return ApiError(400, "BadRequest", message)


def parse_bool(value: str) -> bool:
    """A query flag as Go's ``strconv.ParseBool`` reads it."""
    if value in ("1", "t", "T", "true", "TRUE", "True"):
        return True
    if value in ("", "0", "f", "F", "false", "FALSE", "False"):
        return False
    raise bad_request(f'invalid boolean value "{value}"')


# -- selectors -------------------------------------------------------------------------

_KEY = r"[A-Za-z0-9](?:[-A-Za-z0-9_./]*[A-Za-z0-9])?"
_VALUE = r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?)?"
_SET_REQ = re.compile(rf"({_KEY})\s+(in|notin)\s*\(([^()]*)\)")
_EQ_REQ = re.compile(rf"({_KEY})\s*(==|!=|=)\s*({_VALUE})")
_EXISTS_REQ = re.compile(rf"(!?)\s*({_KEY})")


@dataclass(frozen=True)
class Selector:
    """A parsed label or field selector; an object matches when every requirement holds.
    Requirements are (key, operator, values) with operators ``=`` (also for ``==``),
    ``!=``, ``in``, ``notin``, ``exists`` and ``!`` (absent)."""

    requirements: tuple[tuple[str, str, tuple[str, ...]], ...] = ()

    def matches(self, values: dict[str, str]) -> bool:
        for key, op, wanted in self.requirements:
            have = values.get(key)
            if op == "exists":
                ok = have is not None
            elif op == "!":
                ok = have is None
            elif op == "=":
                ok = have == wanted[0]
            elif op == "!=":
                ok = have != wanted[0]
            elif op == "in":
                ok = have in wanted
            else:  # notin
                ok = have not in wanted
            if not ok:
                return False
        return True


def _split_top(text: str) -> list[str]:
    """Comma-separated parts, ignoring commas inside parentheses (``k in (a,b)``)."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    parts.append(text[start:])
    return parts


def parse_label_selector(text: str) -> Selector:
    """A ``labelSelector`` in the API's string form; 400 when it does not parse."""
    if not text.strip():
        return Selector()
    reqs: list[tuple[str, str, tuple[str, ...]]] = []
    for raw in _split_top(text):
        part = raw.strip()
        if m := _SET_REQ.fullmatch(part):
            values = tuple(v.strip() for v in m[3].split(","))
            if not all(re.fullmatch(_VALUE, v) for v in values):
                raise bad_request(f"unable to parse requirement: invalid values in {part!r}")
            reqs.append((m[1], m[2], values))
        elif m := _EQ_REQ.fullmatch(part):
            reqs.append((m[1], "!=" if m[2] == "!=" else "=", (m[3],)))
        elif m := _EXISTS_REQ.fullmatch(part):
            reqs.append((m[2], "!" if m[1] else "exists", ()))
        else:
            raise bad_request(f"unable to parse requirement: found '{part}'")
    return Selector(tuple(reqs))


def parse_field_selector(text: str, allowed: dict[str, Callable[[JSON], str]]) -> Selector:
    """A ``fieldSelector`` (``f=v``, ``f==v``, ``f!=v``) over the resource's selectable
    fields; another field is refused (400) as the real server refuses it."""
    if not text.strip():
        return Selector()
    reqs: list[tuple[str, str, tuple[str, ...]]] = []
    for raw in text.split(","):
        m = re.fullmatch(r"\s*([^=!\s]+)\s*(==|!=|=)(.*)", raw)
        if not m:
            raise bad_request(f"invalid selector: '{text}'; can't understand '{raw}'")
        if m[1] not in allowed:
            raise bad_request(f'field label not supported: {m[1]}')
        reqs.append((m[1], "!=" if m[2] == "!=" else "=", (m[3].strip(),)))
    return Selector(tuple(reqs))


# -- state -----------------------------------------------------------------------------

@dataclass
class Recorded:
    """One request the fake received (``path`` without the query; ``user``: who it
    authenticated as, "" when nobody)."""

    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: bytes
    user: str = ""
    status: int = 0

    def param(self, name: str) -> str | None:
        values = self.query.get(name)
        return values[-1] if values else None

    @property
    def watch(self) -> bool:
        return (self.param("watch") or "").lower() in ("1", "true", "t")

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass(frozen=True)
class _Change:
    """One write to a pod: ``obj`` its state after (for DELETED: the last state, at the
    deletion's resourceVersion), ``prev`` its state before (None for ADDED)."""

    rv: int
    type: str
    key: str
    obj: JSON
    prev: JSON | None


@dataclass(eq=False)
class _Watcher:
    """An open watch stream: the changes not yet written to it."""

    namespace: str | None
    labels: Selector
    fields: Selector
    start_rv: int
    pending: deque[_Change] = field(default_factory=deque)
    cut: bool = False

    def matches(self, pod: JSON) -> bool:
        meta = pod["metadata"]
        return ((self.namespace is None or meta["namespace"] == self.namespace)
                and self.labels.matches(meta.get("labels") or {})
                and self.fields.matches({k: f(pod) for k, f in POD_FIELDS.items()}))

    def event(self, change: _Change) -> JSON | None:
        """The event this watcher sees for a change (the watch cache's rules), if any."""
        now = change.type != "DELETED" and self.matches(change.obj)
        before = change.prev is not None and self.matches(change.prev)
        if now and not before:
            return {"type": "ADDED", "object": change.obj}
        if now and before:
            return {"type": "MODIFIED", "object": change.obj}
        if before and change.type == "DELETED":
            return {"type": "DELETED", "object": change.obj}
        if before:  # no longer selected: a deletion of the previous state, at this rv
            assert change.prev is not None
            return {"type": "DELETED", "object": _at_rv(change.prev, change.rv)}
        return None


def _at_rv(obj: JSON, rv: int) -> JSON:
    out = copy.deepcopy(obj)
    out["metadata"]["resourceVersion"] = str(rv)
    return out


def _key(namespace: str, name: str) -> str:
    return f"{namespace}/{name}"


@dataclass
class FakeKubeAPI:
    """The fake API server; use as a context manager or call ``start`` / ``stop``."""

    directory: Path
    admin_token: str = "fake-kube-admin-token"
    bookmark_interval: float = 1.0  # seconds between BOOKMARK events on a watch
    api_audiences: list[str] | None = None  # None: [the issuer]
    node_name: str = "fake-node"  # the node every pod runs on
    first_resource_version: int = 1000
    requests: list[Recorded] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ca = LocalCA.create(self.directory, name="fake kube-apiserver CA")
        self._key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
        der = self._key.public_key().public_bytes(
            serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        self.kid = base64.urlsafe_b64encode(hashlib.sha256(der).digest()).rstrip(b"=").decode()
        self._server: _Server | None = None
        self._cond = threading.Condition()
        self._rv = self.first_resource_version
        self._compacted = self._rv  # history after this rv is kept
        self._history: list[_Change] = []
        self._pods: dict[str, JSON] = {}  # "ns/name" -> pod (never changed in place)
        self._service_accounts: dict[str, JSON] = {}
        self._namespaces: dict[str, JSON] = {}
        for namespace in INITIAL_NAMESPACES:
            self._ensure_namespace(namespace)
        self._watchers: set[_Watcher] = set()
        self._connections: set[socket.socket] = set()
        self._stopping = False
        self._frozen = False

    # -- lifecycle -----------------------------------------------------------------------

    @property
    def ca_path(self) -> Path:
        return self.ca.cert_path

    @property
    def port(self) -> int:
        assert self._server is not None, "start the fake first"
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    @property
    def issuer(self) -> str:
        """The service-account issuer (``iss`` of every token): the base URL."""
        return self.url

    @property
    def audiences(self) -> list[str]:
        """The API audiences: what a review without ``spec.audiences`` accepts."""
        return list(self.api_audiences) if self.api_audiences is not None else [self.issuer]

    def client_context(self) -> ssl.SSLContext:
        """A client context trusting only the fake's CA."""
        return ssl.create_default_context(cafile=str(self.ca_path))

    def start(self) -> FakeKubeAPI:
        handler = type("Handler", (_Handler,), {"fake": self})
        server = _Server(("127.0.0.1", 0), handler)
        # The handshake happens in the connection's thread (``_Handler.setup``), so a
        # client that connects and says nothing cannot stall the accept loop.
        server.socket = self.ca.server_context(self.directory, HOSTS).wrap_socket(
            server.socket, server_side=True, do_handshake_on_connect=False)
        self._server = server
        self._stopping = False
        self._thread = threading.Thread(target=server.serve_forever, args=(0.05,),
                                        daemon=True, name="fake-kube-api")
        self._thread.start()
        return self

    def stop(self) -> None:
        """End every watch (cleanly), close every connection, stop serving."""
        if self._server is None:
            return
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: not self._watchers, timeout=5)
        self._server.shutdown()
        with self._cond:
            connections = list(self._connections)
        for conn in connections:  # idle keep-alive connections: wake their readers
            with contextlib.suppress(OSError):
                socket.socket.shutdown(conn, socket.SHUT_RDWR)
        self._server.server_close()
        self._thread.join(timeout=5)
        self._server = None

    def freeze(self) -> None:
        """Go silent without closing anything (a partition, a hung server): see the
        module's docstring."""
        with self._cond:
            self._frozen = True
            self._cond.notify_all()

    def thaw(self) -> None:
        with self._cond:
            self._frozen = False
            self._cond.notify_all()

    def _wait_thawed(self) -> None:
        """Block (a handler) while frozen; returns at once when not, or on stop()."""
        with self._cond:
            self._cond.wait_for(lambda: not self._frozen or self._stopping)

    def __enter__(self) -> FakeKubeAPI:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def write_kubeconfig(self, path: Path, *, namespace: str = "default",
                         token: str | None = None) -> Path:
        """A kubeconfig for this server (context ``fake``), with the admin token (or
        ``token``, e.g. an issued service-account token)."""
        config = {
            "apiVersion": "v1", "kind": "Config", "preferences": {},
            "clusters": [{"name": "fake", "cluster": {
                "server": self.url, "certificate-authority": str(self.ca_path)}}],
            "users": [{"name": "fake-user", "user": {"token": token or self.admin_token}}],
            "contexts": [{"name": "fake", "context": {
                "cluster": "fake", "user": "fake-user", "namespace": namespace}}],
            "current-context": "fake",
        }
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    # -- what tests read -----------------------------------------------------------------

    def seen(self, method: str | None = None, path: str | None = None,
             *, watch: bool | None = None) -> list[Recorded]:
        """The requests so far, those with this method, path (no query), watch flag."""
        with self._cond:
            recorded = list(self.requests)
        return [r for r in recorded if (method is None or r.method == method)
                and (path is None or r.path == path)
                and (watch is None or r.watch == watch)]

    @property
    def open_watches(self) -> int:
        with self._cond:
            return len(self._watchers)

    def wait_for_watches(self, count: int = 1, timeout: float = 5.0) -> bool:
        """Wait until at least ``count`` watch streams are open."""
        with self._cond:
            return self._cond.wait_for(lambda: len(self._watchers) >= count, timeout)

    @property
    def resource_version(self) -> int:
        with self._cond:
            return self._rv

    def get_pod(self, namespace: str, name: str) -> JSON | None:
        with self._cond:
            pod = self._pods.get(_key(namespace, name))
        return copy.deepcopy(pod) if pod is not None else None

    def pods(self) -> list[JSON]:
        with self._cond:
            return [copy.deepcopy(self._pods[k]) for k in sorted(self._pods)]

    # -- driving the cluster -------------------------------------------------------------

    def _write(self, type_: str, key: str, obj: JSON, prev: JSON | None) -> JSON:
        """Record a change to a pod (under the lock; ``obj`` already at the new rv) and
        hand it to every open watch."""
        change = _Change(self._rv, type_, key, obj, prev)
        if type_ == "DELETED":
            self._pods.pop(key, None)
        else:
            self._pods[key] = obj
        self._history.append(change)
        for watcher in self._watchers:
            watcher.pending.append(change)
        self._cond.notify_all()
        return copy.deepcopy(obj)

    def _ensure_namespace(self, name: str) -> None:
        """Create a namespace if new (under the lock), with its ``default`` account (the
        service-account controller's)."""
        if name in self._namespaces:
            return
        self._rv += 1
        self._namespaces[name] = {
            "kind": "Namespace", "apiVersion": "v1",
            "metadata": {"name": name, "uid": str(uuid.uuid4()),
                         "resourceVersion": str(self._rv), "creationTimestamp": rfc3339(),
                         "labels": {"kubernetes.io/metadata.name": name}},
            "spec": {"finalizers": ["kubernetes"]}, "status": {"phase": "Active"}}
        self._ensure_service_account(name, "default")

    def _ensure_service_account(self, namespace: str, name: str) -> JSON:
        self._ensure_namespace(namespace)
        key = _key(namespace, name)
        if key not in self._service_accounts:
            self._rv += 1
            self._service_accounts[key] = {
                "kind": "ServiceAccount", "apiVersion": "v1",
                "metadata": {"name": name, "namespace": namespace, "uid": str(uuid.uuid4()),
                             "resourceVersion": str(self._rv),
                             "creationTimestamp": rfc3339()}}
        return self._service_accounts[key]

    def add_namespace(self, name: str) -> None:
        with self._cond:
            self._ensure_namespace(name)

    def add_service_account(self, namespace: str, name: str) -> JSON:
        """Create a service account (and its namespace) if new; returns it."""
        with self._cond:
            return copy.deepcopy(self._ensure_service_account(namespace, name))

    def delete_service_account(self, namespace: str, name: str) -> None:
        """Delete it: tokens of the account stop passing review (pods stay)."""
        with self._cond:
            if self._service_accounts.pop(_key(namespace, name), None) is None:
                raise KeyError(f"no service account {namespace}/{name}")
            self._rv += 1

    def add_pod(self, namespace: str, name: str, ip: str | None, *,
                labels: dict[str, str] | None = None, phase: str = "Running",
                service_account: str = "default", uid: str | None = None,
                node: str | None = None) -> JSON:
        """Create a pod (and its service account if new); ``ip`` None: none assigned yet.
        Returns the pod as the API serves it."""
        if phase not in PHASES:
            raise ValueError(f"phase must be one of {PHASES}")
        with self._cond:
            key = _key(namespace, name)
            if key in self._pods:
                raise ValueError(f"pod {key} already exists")
            self._ensure_service_account(namespace, service_account)
            self._rv += 1
            now = rfc3339()
            meta: JSON = {"name": name, "namespace": namespace,
                          "uid": uid or str(uuid.uuid4()),
                          "resourceVersion": str(self._rv), "creationTimestamp": now}
            if labels:
                meta["labels"] = dict(labels)
            pod: JSON = {
                "kind": "Pod", "apiVersion": "v1", "metadata": meta,
                "spec": {"containers": [{"name": "main", "image": "registry.k8s.io/pause:3.10",
                                         "resources": {}, "imagePullPolicy": "IfNotPresent"}],
                         "restartPolicy": "Always", "dnsPolicy": "ClusterFirst",
                         "serviceAccountName": service_account,
                         "serviceAccount": service_account,
                         "nodeName": node or self.node_name,
                         "schedulerName": "default-scheduler"},
                "status": {"phase": phase, "hostIP": NODE_IP, "hostIPs": [{"ip": NODE_IP}],
                           "startTime": now, "qosClass": "BestEffort"},
            }
            _set_status(pod, phase, ip)
            return self._write("ADDED", key, pod, None)

    def update_pod(self, namespace: str, name: str, **changes: Any) -> JSON:
        """Change a pod's ``phase``, ``ip`` (None: none) or ``labels`` (replaced whole);
        one write, one new resourceVersion. Returns the pod as served."""
        unknown = set(changes) - {"phase", "ip", "labels"}
        if unknown:
            raise TypeError(f"update_pod cannot change {sorted(unknown)}")
        with self._cond:
            key = _key(namespace, name)
            prev = self._pods.get(key)
            if prev is None:
                raise KeyError(f"no pod {key}")
            phase = changes.get("phase", prev["status"]["phase"])
            if phase not in PHASES:
                raise ValueError(f"phase must be one of {PHASES}")
            pod = copy.deepcopy(prev)
            self._rv += 1
            pod["metadata"]["resourceVersion"] = str(self._rv)
            if "labels" in changes:
                pod["metadata"].pop("labels", None)
                if changes["labels"]:
                    pod["metadata"]["labels"] = dict(changes["labels"])
            _set_status(pod, phase, changes.get("ip", pod["status"].get("podIP")))
            return self._write("MODIFIED", key, pod, prev)

    def delete_pod(self, namespace: str, name: str) -> JSON:
        """Delete a pod at once (as ``--grace-period=0 --force``); tokens bound to it
        stop passing review. Returns its last state (at the deletion's rv)."""
        with self._cond:
            key = _key(namespace, name)
            prev = self._pods.get(key)
            if prev is None:
                raise KeyError(f"no pod {key}")
            self._rv += 1
            return self._write("DELETED", key, _at_rv(prev, self._rv), prev)

    def compact(self, resource_version: int | None = None) -> None:
        """Forget the history up to ``resource_version`` (default: now), as etcd's
        compaction: a watch, continue token or exact list from before it gets 410."""
        with self._cond:
            horizon = self._rv if resource_version is None else resource_version
            self._compacted = max(self._compacted, min(horizon, self._rv))
            self._history = [c for c in self._history if c.rv > self._compacted]

    def cut_watches(self, timeout: float = 5.0) -> int:
        """Drop every open watch stream abruptly (no final chunk); returns how many, once
        they have all ended."""
        with self._cond:
            cut = list(self._watchers)
            for watcher in cut:
                watcher.cut = True
            self._cond.notify_all()
            self._cond.wait_for(lambda: not any(w in self._watchers for w in cut), timeout)
        return len(cut)

    # -- reads (the handlers') -----------------------------------------------------------

    def _state_at(self, rv: int) -> dict[str, JSON]:
        """The pods as they were at ``rv`` (under the lock): the current ones with the
        changes after ``rv`` undone."""
        if rv < self._compacted:
            raise ApiError(410, "Expired", f"too old resource version: {rv} "
                                           f"({self._compacted})")
        if rv > self._rv:
            raise ApiError(504, "Timeout", f"Too large resource version: {rv}, "
                                           f"current: {self._rv}")
        state = dict(self._pods)
        for change in reversed(self._history):
            if change.rv <= rv:
                break
            if change.prev is None:
                state.pop(change.key, None)
            else:
                state[change.key] = change.prev
        return state

    def list_pods(self, namespace: str | None, labels: Selector, fields: Selector, *,
                  resource_version: str = "", match: str = "", limit: int = 0,
                  continue_: str = "") -> tuple[list[JSON], int, str, int | None]:
        """(pods, the list's resourceVersion, continue token or "", remaining count)."""
        start = ""
        with self._cond:
            if continue_:
                at, start = _decode_continue(continue_)
            elif match == "Exact":
                at = _parse_rv(resource_version)
            elif match not in ("", "NotOlderThan"):
                raise ApiError(422, "Invalid", f'resourceVersionMatch: Unsupported value: '
                                               f'"{match}"')
            else:
                wanted = _parse_rv(resource_version) if resource_version else 0
                if wanted > self._rv:
                    raise ApiError(504, "Timeout", f"Too large resource version: {wanted}, "
                                                   f"current: {self._rv}")
                at = self._rv
            if continue_ and at < self._compacted:
                raise ApiError(410, "Expired", "The provided continue parameter is too old "
                               "to display a consistent list result. You can start a new "
                               "list without the continue parameter.")
            state = self._state_at(at) if at != self._rv else self._pods
        watcher = _Watcher(namespace, labels, fields, at)
        prefix = "" if namespace is None else namespace + "/"
        selected = []
        for key in sorted(state):
            if not key.startswith(prefix) or key[len(prefix):] < start:
                continue
            if watcher.matches(state[key]):
                selected.append((key[len(prefix):], state[key]))
        token, remaining = "", None
        if limit and len(selected) > limit:
            token = _encode_continue(at, selected[limit - 1][0] + "\x00")
            if not labels.requirements and not fields.requirements:
                remaining = len(selected) - limit
            selected = selected[:limit]
        return [pod for _, pod in selected], at, token, remaining

    def _open_watch(self, namespace: str | None, labels: Selector, fields: Selector,
                    resource_version: str, initial: bool) -> tuple[_Watcher, list[JSON]]:
        """Register a watch and return it with the events it starts with: the current
        pods for a watch from "" / "0" or with ``sendInitialEvents``, else the history
        after ``resource_version`` (410 when it is compacted)."""
        with self._cond:
            if self._stopping:
                raise ApiError(503, "ServiceUnavailable", "apiserver is shutting down")
            if initial or resource_version in ("", "0"):
                watcher = _Watcher(namespace, labels, fields, self._rv)
                events = [{"type": "ADDED", "object": pod}
                          for _, pod in sorted(self._pods.items()) if watcher.matches(pod)]
            else:
                rv = _parse_rv(resource_version)
                if rv < self._compacted:
                    raise ApiError(410, "Expired", f"too old resource version: {rv} "
                                                   f"({self._compacted})")
                watcher = _Watcher(namespace, labels, fields, rv)
                events = [e for c in self._history if c.rv > rv
                          if (e := watcher.event(c)) is not None]
            self._watchers.add(watcher)
            self._cond.notify_all()
            return watcher, events

    def _next_changes(self, watcher: _Watcher, until: float) -> tuple[list[_Change], int]:
        """Wait (at most until ``until``, monotonic) for changes for a watcher; returns
        them and the resourceVersion they bring it to (all changes up to it included)."""
        with self._cond:
            while not watcher.pending and not watcher.cut and not self._stopping:
                left = until - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            changes = list(watcher.pending)
            watcher.pending.clear()
            return changes, max(self._rv, watcher.start_rv)

    def _close_watch(self, watcher: _Watcher) -> None:
        with self._cond:
            self._watchers.discard(watcher)
            self._cond.notify_all()

    def get_service_account(self, namespace: str, name: str) -> JSON | None:
        with self._cond:
            sa = self._service_accounts.get(_key(namespace, name))
        return copy.deepcopy(sa) if sa is not None else None

    def _objects(self, kind: str, namespace: str | None) -> tuple[list[JSON], int]:
        """The namespaces or service accounts (in one namespace or all), and the rv."""
        with self._cond:
            if kind == "Namespace":
                return [self._namespaces[k] for k in sorted(self._namespaces)], self._rv
            return [sa for key, sa in sorted(self._service_accounts.items())
                    if namespace is None or key.startswith(namespace + "/")], self._rv

    # -- tokens --------------------------------------------------------------------------

    def issue_token(self, namespace: str, pod_name: str, *, audience: str = "sandbox-gateway",
                    expires_in: int = 3600) -> str:
        """A projected service-account token for a pod (as the kubelet mounts one):
        bound to the pod and its service account, for ``audience``; ``expires_in`` may
        be negative (an expired token)."""
        with self._cond:
            pod = self._pods.get(_key(namespace, pod_name))
            if pod is None:
                raise KeyError(f"no pod {namespace}/{pod_name}")
            sa_name = pod["spec"]["serviceAccountName"]
            sa = self._service_accounts.get(_key(namespace, sa_name))
            if sa is None:  # deleted with delete_service_account: the kubelet gets none
                raise KeyError(f"no service account {namespace}/{sa_name}")
            return self._mint(sa, pod, [audience], expires_in)

    def _mint(self, sa: JSON, pod: JSON | None, audiences: list[str],
              expires_in: int) -> str:
        now = int(time.time())
        ns, name = sa["metadata"]["namespace"], sa["metadata"]["name"]
        claim: JSON = {"namespace": ns}
        if pod is not None:
            node = pod["spec"].get("nodeName")
            if node:
                claim["node"] = {"name": node, "uid": str(uuid.uuid5(uuid.NAMESPACE_DNS,
                                                                     f"node.{node}"))}
            claim["pod"] = {"name": pod["metadata"]["name"], "uid": pod["metadata"]["uid"]}
        claim["serviceaccount"] = {"name": name, "uid": sa["metadata"]["uid"]}
        claims = {"aud": audiences, "exp": now + expires_in, "iat": now, "iss": self.issuer,
                  "jti": str(uuid.uuid4()), "kubernetes.io": claim, "nbf": now,
                  "sub": f"system:serviceaccount:{ns}:{name}"}
        return jwt.encode(claims, self._key, algorithm="RS256",
                          headers={"kid": self.kid, "typ": None})

    def request_token(self, namespace: str, sa_name: str, spec: JSON) -> JSON:
        """The TokenRequest subresource: a token for a service account, bound to a pod
        when ``spec.boundObjectRef`` names one (its uid and service account checked)."""
        expires_in = spec.get("expirationSeconds") or 3600
        if not isinstance(expires_in, int) or expires_in < 600:
            raise ApiError(422, "Invalid", "spec.expirationSeconds: Invalid value: "
                           f"{expires_in}: may not specify a duration less than 10 minutes")
        audiences = spec.get("audiences") or self.audiences
        with self._cond:
            sa = self._service_accounts.get(_key(namespace, sa_name))
            if sa is None:
                raise not_found("serviceaccounts", sa_name)
            pod = None
            ref = spec.get("boundObjectRef")
            if ref:
                if ref.get("kind") != "Pod":
                    raise bad_request(f"cannot bind token to a {ref.get('kind')} "
                                      "(the fake binds to pods only)")
                pod = self._pods.get(_key(namespace, ref.get("name", "")))
                if pod is None:
                    raise not_found("pods", ref.get("name", ""))
                if ref.get("uid") and ref["uid"] != pod["metadata"]["uid"]:
                    raise ApiError(409, "Conflict", f"the UID in the bound object reference "
                                   f"({ref['uid']}) does not match the UID in record. The "
                                   "object might have been deleted and then recreated")
                if pod["spec"]["serviceAccountName"] != sa_name:
                    raise bad_request(f'cannot bind token for serviceaccount "{sa_name}" to '
                                      "pod running with different serviceaccount name.")
            token = self._mint(sa, pod, list(audiences), expires_in)
        return {"token": token, "expirationTimestamp": rfc3339(time.time() + expires_in)}

    def review(self, token: str, audiences: list[str] | None = None) -> JSON:
        """A TokenReview's status for a token, as the service-account authenticator
        decides: {authenticated, user, audiences} or {user: {}, error}."""
        targets = list(audiences) if audiences else self.audiences
        try:
            return self._review(token, targets)
        except _Refused as refused:
            return {"user": {}, "error": f"[invalid bearer token, {refused}]"}

    def _review(self, token: str, targets: list[str]) -> JSON:
        try:
            unverified = jwt.decode(token, options={"verify_signature": False})
        except jwt.InvalidTokenError as e:
            raise _Refused("token is not a JWT") from e
        if unverified.get("iss") != self.issuer:
            raise _Refused("token issuer is not recognized")
        try:
            claims: JSON = jwt.decode(token, self._key.public_key(), algorithms=["RS256"],
                                      options={"verify_aud": False, "verify_exp": False,
                                               "verify_nbf": False, "verify_iat": False})
        except jwt.InvalidTokenError as e:
            raise _Refused("go-jose/go-jose: error in cryptographic primitive") from e
        now = time.time()
        if not isinstance(claims.get("exp"), int) or claims["exp"] < now:
            raise _Refused("service account token has expired")
        if isinstance(claims.get("nbf"), int) and claims["nbf"] > now:
            raise _Refused("service account token is not valid yet")
        token_aud = claims.get("aud")
        token_aud = [token_aud] if isinstance(token_aud, str) else list(token_aud or [])
        valid_for = [a for a in targets if a in token_aud]
        if not valid_for:
            raise _Refused(f"token audiences {json.dumps(token_aud)} is invalid for the "
                           f"target audiences {json.dumps(targets)}")
        k8s = claims.get("kubernetes.io") or {}
        ns, sa_ref, pod_ref = k8s.get("namespace"), k8s.get("serviceaccount"), k8s.get("pod")
        if not ns or not sa_ref:
            raise _Refused("service account token claims are incomplete")
        extra: dict[str, list[str]] = {
            "authentication.kubernetes.io/credential-id": [f"JTI={claims.get('jti')}"]}
        with self._cond:
            sa = self._service_accounts.get(_key(ns, sa_ref["name"]))
            if sa is None:
                raise _Refused(f'serviceaccounts "{sa_ref["name"]}" not found')
            if sa["metadata"]["uid"] != sa_ref["uid"]:
                raise _Refused(f"service account UID ({sa['metadata']['uid']}) does not "
                               f"match claim ({sa_ref['uid']})")
            if pod_ref:
                pod = self._pods.get(_key(ns, pod_ref["name"]))
                if pod is None:
                    raise _Refused("service account token has been invalidated")
                if pod["metadata"]["uid"] != pod_ref["uid"]:
                    raise _Refused(f"pod UID ({pod['metadata']['uid']}) does not match "
                                   f"claim ({pod_ref['uid']})")
                extra["authentication.kubernetes.io/pod-name"] = [pod_ref["name"]]
                extra["authentication.kubernetes.io/pod-uid"] = [pod_ref["uid"]]
        node = k8s.get("node")
        if node:
            extra["authentication.kubernetes.io/node-name"] = [node["name"]]
            extra["authentication.kubernetes.io/node-uid"] = [node["uid"]]
        user = {"username": f"system:serviceaccount:{ns}:{sa_ref['name']}",
                "uid": sa_ref["uid"],
                "groups": ["system:serviceaccounts", f"system:serviceaccounts:{ns}",
                           "system:authenticated"],
                "extra": dict(sorted(extra.items()))}
        return {"authenticated": True, "user": user, "audiences": valid_for}

    def authenticate(self, authorization: str | None) -> JSON | None:
        """The user a request's Authorization header authenticates, or None."""
        scheme, _, token = (authorization or "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            return None
        if token == self.admin_token:
            return ADMIN_USER
        result = self.review(token)
        return result["user"] if result.get("authenticated") else None

    def openid_configuration(self) -> JSON:
        return {"issuer": self.issuer, "jwks_uri": f"{self.url}/openid/v1/jwks",
                "response_types_supported": ["id_token"],
                "subject_types_supported": ["public"],
                "id_token_signing_alg_values_supported": ["RS256"]}

    def jwks(self) -> JSON:
        key = RSAAlgorithm.to_jwk(self._key.public_key(), as_dict=True)
        assert isinstance(key, dict)
        return {"keys": [{"use": "sig", "kty": "RSA", "kid": self.kid, "alg": "RS256",
                          "n": key["n"], "e": key["e"]}]}


class _Refused(Exception):
    """Why a token does not authenticate (the text of the review's error)."""


def _set_status(pod: JSON, phase: str, ip: str | None) -> None:
    status = pod["status"]
    status["phase"] = phase
    status.pop("podIP", None)
    status.pop("podIPs", None)
    if ip:
        status["podIP"] = ip
        status["podIPs"] = [{"ip": ip}]
    running = phase == "Running"
    state: JSON = ({"running": {"startedAt": status["startTime"]}} if running
                   else {"waiting": {"reason": "ContainerCreating"}} if phase == "Pending"
                   else {"terminated": {"exitCode": 0 if phase == "Succeeded" else 1,
                                        "reason": "Completed" if phase == "Succeeded"
                                        else "Error"}})
    status["containerStatuses"] = [{"name": "main", "ready": running, "restartCount": 0,
                                    "started": running, "state": state,
                                    "image": "registry.k8s.io/pause:3.10", "imageID": ""}]


def _parse_rv(value: str) -> int:
    try:
        rv = int(value)
    except ValueError:
        rv = -1
    if rv < 0:
        raise bad_request(f'resourceVersion: Invalid value: "{value}": '
                          "must be a non-negative integer")
    return rv


def _encode_continue(rv: int, start: str) -> str:
    """A continue token in the API server's shape (base64 of {v, rv, start})."""
    raw = dumps({"v": "meta.k8s.io/v1", "rv": rv, "start": start})
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _decode_continue(token: str) -> tuple[int, str]:
    try:
        data = json.loads(base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)))
        return int(data["rv"]), str(data["start"])
    except (ValueError, KeyError, TypeError, binascii.Error) as e:
        raise bad_request("continue key is not valid: incorrect encoded start "
                          "resourceVersion (version meta.k8s.io/v1)") from e


# -- protobuf (only what a TokenRequest needs) ------------------------------------------

PROTOBUF = "application/vnd.kubernetes.protobuf"


def _varint(data: bytes, i: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if i >= len(data):
            raise bad_request("truncated protobuf")
        byte = data[i]
        i += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value, i


def protobuf_fields(data: bytes) -> list[tuple[int, int | bytes]]:
    """A protobuf message's (field number, value) pairs: varints and length-delimited
    fields (the only wire types Kubernetes objects use)."""
    out: list[tuple[int, int | bytes]] = []
    i = 0
    while i < len(data):
        key, i = _varint(data, i)
        if key & 7 == 0:
            value, i = _varint(data, i)
            out.append((key >> 3, value))
        elif key & 7 == 2:
            size, i = _varint(data, i)
            out.append((key >> 3, data[i:i + size]))
            i += size
        else:
            raise bad_request(f"unsupported protobuf wire type {key & 7}")
    return out


def _strings(message: bytes) -> dict[int, list[str]]:
    out: dict[int, list[str]] = {}
    for number, value in protobuf_fields(message):
        if isinstance(value, bytes):
            out.setdefault(number, []).append(value.decode())
    return out


def token_request_from_protobuf(body: bytes) -> JSON:
    """A TokenRequest in Kubernetes' protobuf envelope (``k8s\\0`` + runtime.Unknown
    {1: typeMeta, 2: raw}) as JSON: spec {1: audiences, 3: boundObjectRef {1: kind,
    2: apiVersion, 3: name, 4: uid}, 4: expirationSeconds}."""
    if not body.startswith(b"k8s\x00"):
        raise bad_request("the body of the request is not a Kubernetes protobuf envelope")
    raw = next((v for n, v in protobuf_fields(body[4:]) if n == 2 and isinstance(v, bytes)),
               b"")
    spec_bytes = next((v for n, v in protobuf_fields(raw) if n == 2 and isinstance(v, bytes)),
                      b"")
    spec: JSON = {}
    for number, value in protobuf_fields(spec_bytes):
        if number == 1 and isinstance(value, bytes):
            spec.setdefault("audiences", []).append(value.decode())
        elif number == 4 and isinstance(value, int):
            spec["expirationSeconds"] = value
        elif number == 3 and isinstance(value, bytes):
            ref = _strings(value)
            spec["boundObjectRef"] = {name: ref[n][0] for n, name in
                                      ((1, "kind"), (2, "apiVersion"), (3, "name"), (4, "uid"))
                                      if ref.get(n) and ref[n][0]}
    return {"kind": "TokenRequest", "apiVersion": "authentication.k8s.io/v1", "spec": spec}


# -- tables (kubectl's human output) ---------------------------------------------------

def _column(name: str, description: str, priority: int = 0, fmt: str = "") -> JSON:
    return {"name": name, "type": "string", "format": fmt, "description": description,
            "priority": priority}


POD_COLUMNS = [
    _column("Name", "Name must be unique within a namespace.", fmt="name"),
    _column("Ready", "The aggregate readiness state of this pod for accepting traffic."),
    _column("Status", "The aggregate status of the containers in this pod."),
    _column("Restarts", "The number of times the containers in this pod have been "
                        "restarted and when the last container in this pod has restarted."),
    _column("Age", "CreationTimestamp is a timestamp representing the server time when "
                   "this object was created."),
    _column("IP", "IP address allocated to the pod. Routable at least within the cluster. "
                  "Empty if not yet allocated.", priority=1),
    _column("Node", "NodeName is a request to schedule this pod onto a specific node.",
            priority=1),
    _column("Nominated Node", "nominatedNodeName is set only when this pod preempts other "
                              "pods on the node.", priority=1),
    _column("Readiness Gates", "If specified, all readiness gates will be evaluated for "
                               "pod readiness.", priority=1),
]
SA_COLUMNS = [
    _column("Name", "Name must be unique within a namespace.", fmt="name"),
    _column("Secrets", "Secrets is a list of the secrets in the same namespace that pods "
                       "running using this ServiceAccount are allowed to use."),
    _column("Age", "CreationTimestamp is a timestamp representing the server time when "
                   "this object was created."),
]

NAMESPACE_COLUMNS = [
    _column("Name", "Name must be unique within a namespace.", fmt="name"),
    _column("Status", "The status of the namespace"),
    _column("Age", "CreationTimestamp is a timestamp representing the server time when "
                   "this object was created."),
]
TABLE_TYPE = "application/json;as=Table;v=v1;g=meta.k8s.io"
COLUMNS = {"Pod": POD_COLUMNS, "ServiceAccount": SA_COLUMNS, "Namespace": NAMESPACE_COLUMNS}


def _age(obj: JSON) -> str:
    created = datetime.strptime(obj["metadata"]["creationTimestamp"], "%Y-%m-%dT%H:%M:%SZ")
    return human_duration(time.time() - created.replace(tzinfo=UTC).timestamp())


def _cells(obj: JSON) -> list[Any]:
    if obj["kind"] == "ServiceAccount":
        return [obj["metadata"]["name"], 0, _age(obj)]
    if obj["kind"] == "Namespace":
        return [obj["metadata"]["name"], obj["status"]["phase"], _age(obj)]
    statuses = obj["status"].get("containerStatuses", [])
    ready = sum(1 for s in statuses if s.get("ready"))
    return [obj["metadata"]["name"], f"{ready}/{len(obj['spec']['containers'])}",
            obj["status"]["phase"], "0", _age(obj), obj["status"].get("podIP") or "<none>",
            obj["spec"].get("nodeName") or "<none>", "<none>", "<none>"]


def as_table(objs: list[JSON], kind: str, rv: int | None, include: str,
             headers: bool = True, continue_: str = "") -> JSON:
    """A ``meta.k8s.io/v1`` Table of pods, service accounts or namespaces; rows carry the object's
    metadata (``includeObject=Metadata``, the default), the object, or nothing."""
    rows = []
    for obj in objs:
        row: JSON = {"cells": _cells({"kind": kind, **obj})}
        if include == "Object":
            row["object"] = {"kind": kind, "apiVersion": "v1", **obj}
        elif include != "None":
            row["object"] = {"kind": "PartialObjectMetadata", "apiVersion": "meta.k8s.io/v1",
                             "metadata": obj["metadata"]}
        rows.append(row)
    meta: JSON = {} if rv is None else {"resourceVersion": str(rv)}
    if continue_:
        meta["continue"] = continue_
    columns = COLUMNS[kind] if headers else None
    return {"kind": "Table", "apiVersion": "meta.k8s.io/v1", "metadata": meta,
            "columnDefinitions": columns, "rows": rows}


def _list_item(obj: JSON) -> JSON:
    """An object as a list's item (the API server leaves out kind and apiVersion)."""
    return {k: v for k, v in obj.items() if k not in ("kind", "apiVersion")}


# -- discovery -------------------------------------------------------------------------

CORE_RESOURCES = [
    {"name": "namespaces", "singularName": "namespace", "namespaced": False,
     "kind": "Namespace", "verbs": ["get", "list"], "shortNames": ["ns"]},
    {"name": "pods", "singularName": "pod", "namespaced": True, "kind": "Pod",
     "verbs": ["get", "list", "watch"], "shortNames": ["po"], "categories": ["all"]},
    {"name": "serviceaccounts", "singularName": "serviceaccount", "namespaced": True,
     "kind": "ServiceAccount", "verbs": ["get", "list"], "shortNames": ["sa"]},
    {"name": "serviceaccounts/token", "singularName": "", "namespaced": True,
     "group": "authentication.k8s.io", "version": "v1", "kind": "TokenRequest",
     "verbs": ["create"]},
]
AUTHN_RESOURCES = [
    {"name": "selfsubjectreviews", "singularName": "selfsubjectreview", "namespaced": False,
     "kind": "SelfSubjectReview", "verbs": ["create"]},
    {"name": "tokenreviews", "singularName": "tokenreview", "namespaced": False,
     "kind": "TokenReview", "verbs": ["create"]},
]
AUTHN_GROUP = {"name": "authentication.k8s.io",
               "versions": [{"groupVersion": "authentication.k8s.io/v1", "version": "v1"}],
               "preferredVersion": {"groupVersion": "authentication.k8s.io/v1",
                                    "version": "v1"}}

# -- HTTP ------------------------------------------------------------------------------

_ROUTES: list[tuple[re.Pattern[str], dict[str, str]]] = [
    (re.compile(p), h) for p, h in [
        (r"/(healthz|livez|readyz)", {"GET": "_health"}),
        (r"/version", {"GET": "_version"}),
        (r"/\.well-known/openid-configuration", {"GET": "_oidc"}),
        (r"/openid/v1/jwks", {"GET": "_jwks"}),
        (r"/api", {"GET": "_api"}),
        (r"/api/v1", {"GET": "_api_v1"}),
        (r"/apis", {"GET": "_apis"}),
        (r"/apis/authentication\.k8s\.io", {"GET": "_authn_group"}),
        (r"/apis/authentication\.k8s\.io/v1", {"GET": "_authn_v1"}),
        (r"/apis/authentication\.k8s\.io/v1/tokenreviews", {"POST": "_token_review"}),
        (r"/apis/authentication\.k8s\.io/v1/selfsubjectreviews", {"POST": "_self_review"}),
        (r"/api/v1/pods", {"GET": "_pods"}),
        (r"/api/v1/namespaces/([^/]+)/pods", {"GET": "_pods"}),
        (r"/api/v1/namespaces/([^/]+)/pods/([^/]+)", {"GET": "_pod"}),
        (r"/api/v1/namespaces", {"GET": "_namespaces"}),
        (r"/api/v1/namespaces/([^/]+)", {"GET": "_namespace"}),
        (r"/api/v1/serviceaccounts", {"GET": "_service_accounts"}),
        (r"/api/v1/namespaces/([^/]+)/serviceaccounts", {"GET": "_service_accounts"}),
        (r"/api/v1/namespaces/([^/]+)/serviceaccounts/([^/]+)", {"GET": "_service_account"}),
        (r"/api/v1/namespaces/([^/]+)/serviceaccounts/([^/]+)/token",
         {"POST": "_token_request"}),
    ]]


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        """A client that went away mid-request is no error worth printing; a bug is."""
        if not isinstance(sys.exc_info()[1], OSError):
            super().handle_error(request, client_address)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    fake: FakeKubeAPI
    seen: Recorded
    user: JSON | None

    def log_message(self, format: str, *args: Any) -> None:
        pass

    def setup(self) -> None:
        conn = self.request
        assert isinstance(conn, ssl.SSLSocket)
        self.fake._wait_thawed()  # (frozen: the connection is accepted, never answered)
        conn.settimeout(10)
        conn.do_handshake()
        conn.settimeout(None)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with self.fake._cond:
            self.fake._connections.add(conn)
        super().setup()

    def finish(self) -> None:
        with self.fake._cond:
            self.fake._connections.discard(self.request)
        with contextlib.suppress(OSError):
            super().finish()

    def do_GET(self) -> None:
        self._serve()

    def do_POST(self) -> None:
        self._serve()

    def do_PUT(self) -> None:
        self._serve()

    def do_PATCH(self) -> None:
        self._serve()

    def do_DELETE(self) -> None:
        self._serve()

    # -- plumbing ------------------------------------------------------------------------

    def _body(self) -> bytes:
        return read_body(self.headers, self.rfile)

    def _param(self, name: str, default: str = "") -> str:
        values = self.seen.query.get(name)
        return values[-1] if values else default

    def _send(self, status: int, payload: Any, content_type: str = "application/json") -> None:
        body = (payload if isinstance(payload, bytes)
                else dumps(payload))
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-cache, private")
        self.seen.status = status  # before the client can read the answer
        self.end_headers()
        self.wfile.write(body)

    def _serve(self) -> None:
        self.fake._wait_thawed()
        url = urlsplit(self.path)
        body = self._body() if self.command in ("POST", "PUT", "PATCH") else b""
        headers = {k.lower(): v for k, v in self.headers.items()}
        self.seen = Recorded(self.command, url.path, parse_qs(url.query, keep_blank_values=True),
                             headers, body)
        with self.fake._cond:
            self.fake.requests.append(self.seen)
        try:
            self._dispatch(url.path.rstrip("/") or "/")
        except ApiError as e:
            self._send(e.code, e.status())

    def _dispatch(self, path: str) -> None:
        self.user = None
        for pattern, methods in _ROUTES:
            m = pattern.fullmatch(path)
            if not m:
                continue
            if path not in PUBLIC_PATHS:
                self.user = self.fake.authenticate(self.headers.get("Authorization"))
                if self.user is None:
                    raise ApiError(401, "Unauthorized", "Unauthorized")
                self.seen.user = self.user["username"]
            if self.command not in methods:
                raise ApiError(405, "MethodNotAllowed", "the server does not allow this "
                               "method on the requested resource")
            getattr(self, methods[self.command])(*m.groups())
            return
        if self.fake.authenticate(self.headers.get("Authorization")) is None:
            raise ApiError(401, "Unauthorized", "Unauthorized")
        raise ApiError(404, "NotFound", "the server could not find the requested resource",
                       {})

    def _table_wanted(self) -> bool:
        return any("as=Table" in part.replace(" ", "")
                   for part in self.headers.get("Accept", "").split(","))

    def _json_body(self, kind: str) -> JSON:
        """The request's object: JSON, or (TokenRequest only, which typed Go clients
        such as ``kubectl create token`` send so) Kubernetes protobuf."""
        content_type = self.headers.get("Content-Type", "application/json")
        if content_type.startswith(PROTOBUF) and kind == "TokenRequest":
            return token_request_from_protobuf(self.seen.body)
        if not content_type.startswith("application/json"):
            raise ApiError(415, "UnsupportedMediaType",
                           f'the body of the request was in an unknown format - accepted '
                           f'media types include: application/json (not "{content_type}")')
        try:
            data = json.loads(self.seen.body)
        except ValueError as e:
            raise bad_request(f"the body of the request was in an unknown format: {e}") from e
        if not isinstance(data, dict) or data.get("kind", kind) != kind:
            raise bad_request(f"the body of the request is not a {kind}")
        return data

    # -- public --------------------------------------------------------------------------

    def _health(self, _which: str) -> None:
        self._send(200, b"ok", "text/plain; charset=utf-8")

    def _version(self) -> None:
        self._send(200, SERVER_VERSION)

    def _oidc(self) -> None:
        self._send(200, self.fake.openid_configuration())

    def _jwks(self) -> None:
        self._send(200, self.fake.jwks(), "application/jwk-set+json")

    # -- discovery -----------------------------------------------------------------------

    def _api(self) -> None:
        self._send(200, {"kind": "APIVersions", "versions": ["v1"],
                         "serverAddressByClientCIDRs": [
                             {"clientCIDR": "0.0.0.0/0",
                              "serverAddress": f"127.0.0.1:{self.fake.port}"}]})

    def _api_v1(self) -> None:
        self._send(200, {"kind": "APIResourceList", "groupVersion": "v1",
                         "resources": CORE_RESOURCES})

    def _apis(self) -> None:
        self._send(200, {"kind": "APIGroupList", "apiVersion": "v1", "groups": [AUTHN_GROUP]})

    def _authn_group(self) -> None:
        self._send(200, {"kind": "APIGroup", "apiVersion": "v1", **AUTHN_GROUP})

    def _authn_v1(self) -> None:
        self._send(200, {"kind": "APIResourceList", "apiVersion": "v1",
                         "groupVersion": "authentication.k8s.io/v1",
                         "resources": AUTHN_RESOURCES})

    # -- authentication.k8s.io -----------------------------------------------------------

    def _token_review(self) -> None:
        review = self._json_body("TokenReview")
        spec = review.get("spec") or {}
        if not spec.get("token"):
            raise bad_request("token is required for TokenReview in authentication")
        self._send(201, {"kind": "TokenReview", "apiVersion": "authentication.k8s.io/v1",
                         "metadata": {"creationTimestamp": None}, "spec": spec,
                         "status": self.fake.review(spec["token"], spec.get("audiences"))})

    def _self_review(self) -> None:
        assert self.user is not None
        self._send(201, {"kind": "SelfSubjectReview",
                         "apiVersion": "authentication.k8s.io/v1",
                         "metadata": {"creationTimestamp": rfc3339()},
                         "status": {"userInfo": self.user}})

    def _token_request(self, namespace: str, name: str) -> None:
        request = self._json_body("TokenRequest")
        spec = request.get("spec") or {}
        status = self.fake.request_token(namespace, name, spec)
        self._send(201, {"kind": "TokenRequest", "apiVersion": "authentication.k8s.io/v1",
                         "metadata": {"name": name, "namespace": namespace,
                                      "creationTimestamp": rfc3339()},
                         "spec": {**spec, "expirationSeconds": spec.get("expirationSeconds")
                                  or 3600},
                         "status": status})

    # -- namespaces and service accounts ------------------------------------------------

    def _serve_list(self, kind: str, namespace: str | None = None) -> None:
        """A list of namespaces or service accounts, selectors applied (neither holds
        labels the fake sets, apart from ``kubernetes.io/metadata.name``)."""
        labels = parse_label_selector(self._param("labelSelector"))
        allowed = (META_FIELDS if kind == "ServiceAccount"
                   else {"metadata.name": META_FIELDS["metadata.name"],
                         "status.phase": lambda o: o["status"]["phase"]})
        fields = parse_field_selector(self._param("fieldSelector"), allowed)
        objs, rv = self.fake._objects(kind, namespace)
        items = [_list_item(o) for o in objs
                 if labels.matches(o["metadata"].get("labels") or {})
                 and fields.matches({k: f(o) for k, f in allowed.items()})]
        if self._table_wanted():
            self._send(200, as_table(items, kind, rv, self._param("includeObject", "Metadata")),
                       TABLE_TYPE)
            return
        self._send(200, {"kind": f"{kind}List", "apiVersion": "v1",
                         "metadata": {"resourceVersion": str(rv)}, "items": items})

    def _serve_one(self, kind: str, obj: JSON) -> None:
        if self._table_wanted():
            self._send(200, as_table([_list_item(obj)], kind, None,
                                     self._param("includeObject", "Metadata")), TABLE_TYPE)
            return
        self._send(200, obj)

    def _namespaces(self) -> None:
        self._serve_list("Namespace")

    def _namespace(self, name: str) -> None:
        objs, _ = self.fake._objects("Namespace", None)
        found = [o for o in objs if o["metadata"]["name"] == name]
        if not found:
            raise not_found("namespaces", name)
        self._serve_one("Namespace", found[0])

    def _service_accounts(self, namespace: str | None = None) -> None:
        self._serve_list("ServiceAccount", namespace)

    def _service_account(self, namespace: str, name: str) -> None:
        sa = self.fake.get_service_account(namespace, name)
        if sa is None:
            raise not_found("serviceaccounts", name)
        self._serve_one("ServiceAccount", sa)

    # -- pods ----------------------------------------------------------------------------

    def _pod(self, namespace: str, name: str) -> None:
        with self.fake._cond:
            rv = self._param("resourceVersion")
            exact = rv not in ("", "0") and self._param("resourceVersionMatch") == "Exact"
            state = self.fake._state_at(_parse_rv(rv)) if exact else self.fake._pods
            pod = state.get(_key(namespace, name))
        if pod is None:
            raise not_found("pods", name)
        self._serve_one("Pod", pod)

    def _pods(self, namespace: str | None = None) -> None:
        labels = parse_label_selector(self._param("labelSelector"))
        fields = parse_field_selector(self._param("fieldSelector"), POD_FIELDS)
        if parse_bool(self._param("watch")):
            self._watch(namespace, labels, fields)
            return
        try:
            limit = int(self._param("limit") or 0)
        except ValueError as e:
            raise bad_request(f"invalid limit {self._param('limit')!r}") from e
        pods, rv, token, remaining = self.fake.list_pods(
            namespace, labels, fields, resource_version=self._param("resourceVersion"),
            match=self._param("resourceVersionMatch"), limit=max(limit, 0),
            continue_=self._param("continue"))
        items = [_list_item(p) for p in pods]
        if self._table_wanted():
            self._send(200, as_table(items, "Pod", rv, self._param("includeObject", "Metadata"),
                                     continue_=token), TABLE_TYPE)
            return
        meta: JSON = {"resourceVersion": str(rv)}
        if token:
            meta["continue"] = token
        if remaining is not None:
            meta["remainingItemCount"] = remaining
        self._send(200, {"kind": "PodList", "apiVersion": "v1", "metadata": meta,
                         "items": items})

    # -- watch ---------------------------------------------------------------------------

    def _write_chunk(self, data: bytes) -> None:
        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.wfile.flush()

    def _client_gone(self) -> bool:
        """Whether the watching client hung up (its end closed: readable, then EOF)."""
        conn = self.connection
        try:
            readable, _, _ = select.select([conn], [], [], 0)
            if not readable:
                return False
            conn.settimeout(0.05)
            try:
                return bool(conn.recv(1) == b"")
            finally:
                conn.settimeout(None)
        except (TimeoutError, ssl.SSLWantReadError):
            return False
        except OSError:
            return True

    def _watch(self, namespace: str | None, labels: Selector, fields: Selector) -> None:
        fake = self.fake
        rv = self._param("resourceVersion")
        bookmarks = parse_bool(self._param("allowWatchBookmarks"))
        initial = parse_bool(self._param("sendInitialEvents"))
        if initial and (self._param("resourceVersionMatch") != "NotOlderThan"
                        or not bookmarks):
            raise ApiError(422, "Invalid", "sendInitialEvents requires "
                           "resourceVersionMatch=NotOlderThan and allowWatchBookmarks=true")
        timeout = self._param("timeoutSeconds")
        try:
            seconds = float(timeout or 0)
        except ValueError as e:
            raise bad_request(f"invalid timeoutSeconds {timeout!r}") from e
        seconds = seconds if seconds > 0 else float("inf")  # 0: the server's default
        table = self._table_wanted()
        include = self._param("includeObject", "Metadata")
        self.send_response(200)
        self.send_header("Content-Type", TABLE_TYPE if table else "application/json")
        self.send_header("Transfer-Encoding", "chunked")
        self.send_header("Cache-Control", "no-cache, private")
        self.seen.status = 200
        try:
            watcher, events = fake._open_watch(namespace, labels, fields, rv, initial)
        except ApiError as e:  # too old: one ERROR event, then the end (the real server's)
            self.end_headers()
            self._write_chunk(dumps({"type": "ERROR", "object": e.status()}) + b"\n")
            self._write_chunk(b"")
            return
        self.end_headers()
        headers_sent = False

        def send(event: JSON) -> None:
            nonlocal headers_sent
            if table and event["type"] in ("ADDED", "MODIFIED", "DELETED"):
                obj = event["object"]
                event = {"type": event["type"], "object": as_table(
                    [_list_item(obj)], "Pod", int(obj["metadata"]["resourceVersion"]),
                    include, headers=not headers_sent)}
                headers_sent = True
            self._write_chunk(dumps(event) + b"\n")

        def bookmark(at: int, end_of_initial: bool = False) -> None:
            meta: JSON = {"resourceVersion": str(at)}
            if end_of_initial:
                meta["annotations"] = {"k8s.io/initial-events-end": "true"}
            send({"type": "BOOKMARK", "object": {"kind": "Pod", "apiVersion": "v1",
                                                 "metadata": meta}})

        now = time.monotonic()
        deadline = now + seconds
        next_bookmark = now + fake.bookmark_interval if bookmarks else float("inf")
        try:
            for event in events:
                send(event)
            if initial:
                bookmark(watcher.start_rv, end_of_initial=True)
            while True:
                until = min(deadline, next_bookmark, time.monotonic() + LIVENESS)
                changes, at = fake._next_changes(watcher, until)
                fake._wait_thawed()  # (frozen: silent, what came sent after the thaw)
                if watcher.cut:  # abruptly: no final chunk, no TLS close_notify
                    self.close_connection = True
                    socket.socket.shutdown(self.connection, socket.SHUT_RDWR)
                    return
                for change in changes:
                    converted = watcher.event(change)
                    if converted is not None:
                        send(converted)
                now = time.monotonic()
                if fake._stopping or now >= deadline:
                    self._write_chunk(b"")
                    self.close_connection = fake._stopping
                    return
                if now >= next_bookmark:
                    bookmark(at)
                    next_bookmark = now + fake.bookmark_interval
                if not changes and self._client_gone():
                    self.close_connection = True
                    return
        except OSError:  # the client went away mid-write
            self.close_connection = True
        finally:
            fake._close_watch(watcher)
