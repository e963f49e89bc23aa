"""The fake Kubernetes API server is real-shaped: the real ``kubectl`` lists, gets,
selects and watches pods through it, creates tokens and asks who it is; raw HTTP sees
the watch protocol (history replay, bookmarks, 410 after compaction, cut streams); and
TokenReview and the OIDC discovery documents judge its service-account tokens as a
cluster would."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import jwt
import pytest
from fakes.kube_api import FakeKubeAPI

JSON = dict[str, Any]
needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl")


@pytest.fixture
def kube(tmp_path: Path) -> Iterator[FakeKubeAPI]:
    with FakeKubeAPI(tmp_path / "kube", bookmark_interval=0.2) as fake:
        fake.add_pod("ns", "web", "10.0.0.5", labels={"app": "x", "tier": "front"})
        fake.add_pod("ns", "db", "10.0.0.6", labels={"app": "y"}, phase="Pending",
                     service_account="db")
        fake.add_pod("other", "api", "10.0.1.7", labels={"app": "x"})
        yield fake


@pytest.fixture
def http(kube: FakeKubeAPI) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=kube.url, verify=kube.client_context(), timeout=5,
                      headers={"authorization": f"Bearer {kube.admin_token}"}) as client:
        yield client


class Kubectl:
    """The real kubectl, pointed at the fake (its own HOME and discovery cache)."""

    def __init__(self, kube: FakeKubeAPI, home: Path, token: str | None = None) -> None:
        home.mkdir(exist_ok=True)
        self.config = kube.write_kubeconfig(home / "kubeconfig", token=token)
        self.env = {**os.environ, "HOME": str(home)}
        self.env.pop("KUBECONFIG", None)
        self.base = ["kubectl", "--kubeconfig", str(self.config),
                     "--cache-dir", str(home / "cache")]

    def run(self, *args: str, ok: bool = True) -> subprocess.CompletedProcess[str]:
        done = subprocess.run([*self.base, *args], capture_output=True, text=True,
                              env=self.env, timeout=30)
        if ok:
            assert done.returncode == 0, done.stderr
        return done

    def popen(self, *args: str) -> subprocess.Popen[str]:
        return subprocess.Popen([*self.base, *args], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, env=self.env)


@pytest.fixture
def kubectl(kube: FakeKubeAPI, tmp_path: Path) -> Kubectl:
    return Kubectl(kube, tmp_path / "home")


def json_stream(text: str) -> list[JSON]:
    """The JSON values written one after another (kubectl's watch output)."""
    decoder, i = json.JSONDecoder(), 0
    out: list[JSON] = []
    while True:
        while i < len(text) and text[i].isspace():
            i += 1
        if i >= len(text):
            return out
        try:
            value, i = decoder.raw_decode(text, i)
        except ValueError:  # a value still being written
            return out
        out.append(value)


class Running:
    """A kubectl that keeps running (``--watch``): its stdout read as it comes."""

    def __init__(self, process: subprocess.Popen[str]) -> None:
        self.process, self.text = process, ""
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.process.stdout is not None
        while char := self.process.stdout.read(1):
            self.text += char

    def until(self, done: Callable[[list[JSON]], bool], timeout: float = 10) -> list[JSON]:
        """What it printed (as JSON values) once ``done`` holds for that."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            values = json_stream(self.text)
            if done(values):
                return values
            time.sleep(0.05)
        raise AssertionError(f"kubectl printed only {self.text!r}")

    def stop(self) -> None:
        self.process.kill()
        self.process.wait(timeout=5)
        self.reader.join(timeout=5)  # it reads to the end of the pipe
        for pipe in (self.process.stdout, self.process.stderr):
            if pipe is not None:
                pipe.close()


class Events:
    """A watch stream's events, read as they arrive."""

    def __init__(self, response: httpx.Response) -> None:
        assert response.status_code == 200
        self.lines = response.iter_lines()

    def next(self, count: int) -> list[JSON]:
        """The next ``count`` events (fewer if the stream ends first)."""
        out: list[JSON] = []
        for line in self.lines:
            if line:
                out.append(json.loads(line))
                if len(out) == count:
                    break
        return out

    def rest(self) -> list[JSON]:
        return self.next(-1)


def events(response: httpx.Response, count: int = -1) -> list[JSON]:
    """The next ``count`` events of a watch stream (-1: all, until it ends)."""
    return Events(response).next(count)


def watch(http: httpx.Client, path: str, **params: str) -> Any:
    return http.stream("GET", path, params={"watch": "1", **params})


def review(http: httpx.Client, token: str, audiences: list[str] | None = None) -> JSON:
    spec: JSON = {"token": token}
    if audiences is not None:
        spec["audiences"] = audiences
    response = http.post("/apis/authentication.k8s.io/v1/tokenreviews",
                         json={"apiVersion": "authentication.k8s.io/v1",
                               "kind": "TokenReview", "spec": spec})
    assert response.status_code == 201
    body: JSON = response.json()
    assert body["kind"] == "TokenReview"
    return body["status"]  # type: ignore[no-any-return]


# -- the real kubectl ------------------------------------------------------------------

@needs_kubectl
def test_kubectl_lists_and_gets_pods(kube: FakeKubeAPI, kubectl: Kubectl) -> None:
    listed = json.loads(kubectl.run("get", "pods", "-n", "ns", "-o", "json").stdout)
    pods = {p["metadata"]["name"]: p for p in listed["items"]}
    assert sorted(pods) == ["db", "web"]
    assert pods["web"]["status"]["podIPs"] == [{"ip": "10.0.0.5"}]
    assert pods["db"]["spec"]["serviceAccountName"] == "db"
    assert pods["db"]["status"]["phase"] == "Pending"
    ip = kubectl.run("get", "pod", "web", "-n", "ns", "-o", "jsonpath={.status.podIP}")
    assert ip.stdout == "10.0.0.5"
    missing = kubectl.run("get", "pod", "nope", "-n", "ns", ok=False)
    assert missing.returncode == 1 and 'pods "nope" not found' in missing.stderr
    assert kube.seen("GET", "/api/v1")  # discovery, as kubectl does it
    assert kube.seen("GET", "/api/v1/namespaces/ns/pods/web")[0].user == "kubernetes-admin"


@needs_kubectl
def test_kubectl_tables_all_namespaces_and_selectors(kube: FakeKubeAPI,
                                                     kubectl: Kubectl) -> None:
    table = kubectl.run("get", "pods", "-A", "-o", "wide").stdout.splitlines()
    assert table[0].split()[:6] == ["NAMESPACE", "NAME", "READY", "STATUS", "RESTARTS", "AGE"]
    rows = {tuple(line.split()[:2]): line.split() for line in table[1:]}
    assert set(rows) == {("ns", "db"), ("ns", "web"), ("other", "api")}
    assert rows[("ns", "web")][2:4] == ["1/1", "Running"]
    assert rows[("ns", "db")][2:4] == ["0/1", "Pending"]
    assert "10.0.1.7" in rows[("other", "api")]
    selected = kubectl.run("get", "pods", "-A", "-l", "app=x", "-o", "name").stdout.split()
    assert selected == ["pod/web", "pod/api"]
    assert kubectl.run("get", "pods", "-n", "ns", "-l", "app in (y,z),!tier", "-o",
                       "name").stdout.split() == ["pod/db"]
    by_ip = kubectl.run("get", "pods", "-A", "--field-selector", "status.podIP=10.0.0.6",
                        "-o", "name")
    assert by_ip.stdout.split() == ["pod/db"]
    kube.update_pod("ns", "web", labels={"app": "z"})
    assert kubectl.run("get", "pods", "-A", "-l", "app=x", "-o", "name").stdout.split() == [
        "pod/api"]


@needs_kubectl
def test_kubectl_watch_sees_added_and_deleted(kube: FakeKubeAPI, kubectl: Kubectl) -> None:
    listed_at = kube.resource_version
    running = Running(kubectl.popen("get", "pods", "-n", "ns", "--watch", "-o", "json",
                                    "--output-watch-events"))
    try:
        assert kube.wait_for_watches(1, timeout=10)
        kube.add_pod("ns", "new", "10.0.0.9")
        kube.add_pod("other", "elsewhere", "10.0.1.9")  # another namespace: not seen
        kube.delete_pod("ns", "new")
        printed = running.until(lambda v: any(e["type"] == "DELETED" for e in v))
    finally:
        running.stop()
    seen = [(e["type"], e["object"]["metadata"]["name"]) for e in printed]
    assert seen == [("ADDED", "db"), ("ADDED", "web"), ("ADDED", "new"), ("DELETED", "new")]
    # kubectl listed first, then watched from the list's resourceVersion
    listed, watched = kube.seen("GET", "/api/v1/namespaces/ns/pods")
    assert not listed.watch and watched.watch
    assert watched.param("resourceVersion") == str(listed_at)
    # kubectl is gone: the fake notices and closes the stream
    deadline = time.monotonic() + 3
    while kube.open_watches and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kube.open_watches == 0


@needs_kubectl
def test_kubectl_create_token_and_whoami(kube: FakeKubeAPI, kubectl: Kubectl,
                                         tmp_path: Path) -> None:
    """``kubectl create token`` posts a protobuf TokenRequest; the token it gets is
    bound to the pod. A token for the API audience authenticates kubectl itself."""
    token = kubectl.run("create", "token", "db", "-n", "ns", "--bound-object-kind", "Pod",
                        "--bound-object-name", "db", "--audience", "sandbox-gateway",
                        "--duration", "20m").stdout.strip()
    status = kube.review(token, ["sandbox-gateway"])
    assert status["authenticated"] is True
    assert status["user"]["extra"]["authentication.kubernetes.io/pod-name"] == ["db"]
    assert jwt.decode(token, options={"verify_signature": False})["exp"] - time.time() > 1190
    wrong = kubectl.run("create", "token", "default", "-n", "ns", "--bound-object-kind",
                        "Pod", "--bound-object-name", "db", ok=False)
    assert "different serviceaccount name" in wrong.stderr
    as_pod = Kubectl(kube, tmp_path / "pod-home",
                     token=kube.issue_token("ns", "web", audience=kube.issuer))
    whoami = as_pod.run("auth", "whoami", "-o", "json").stdout
    info = json.loads(whoami)["status"]["userInfo"]
    assert info["username"] == "system:serviceaccount:ns:default"
    assert "system:serviceaccounts:ns" in info["groups"]


# -- raw HTTP: lists and watches -------------------------------------------------------

def test_auth_and_public_paths(kube: FakeKubeAPI, http: httpx.Client) -> None:
    with httpx.Client(base_url=kube.url, verify=kube.client_context()) as anonymous:
        for headers in ({}, {"authorization": "Bearer wrong"}, {"authorization": "Basic x"}):
            response = anonymous.get("/api/v1/pods", headers=headers)
            assert response.status_code == 401
            assert response.json() == {"kind": "Status", "apiVersion": "v1", "metadata": {},
                                       "status": "Failure", "message": "Unauthorized",
                                       "reason": "Unauthorized", "code": 401}
        assert anonymous.get("/healthz").text == "ok"
        assert anonymous.get("/version").json()["minor"] == "32"
        assert anonymous.get("/.well-known/openid-configuration").status_code == 200
    response = http.get("/api/v1/namespaces/ns/pods/nope")
    assert response.status_code == 404
    assert response.json()["reason"] == "NotFound"
    assert http.delete("/api/v1/namespaces/ns/pods/web").status_code == 405
    assert kube.get_pod("ns", "web") is not None


def test_list_selectors_and_pages(kube: FakeKubeAPI, http: httpx.Client) -> None:
    every = http.get("/api/v1/pods").json()
    assert every["kind"] == "PodList"
    assert int(every["metadata"]["resourceVersion"]) == kube.resource_version
    assert [p["metadata"]["name"] for p in every["items"]] == ["db", "web", "api"]
    assert "kind" not in every["items"][0]  # as the API server: items without kind
    selected = http.get("/api/v1/pods", params={"labelSelector": "app=x,tier!=front"}).json()
    assert [p["metadata"]["name"] for p in selected["items"]] == ["api"]
    bad = http.get("/api/v1/pods", params={"fieldSelector": "spec.containers=x"})
    assert bad.status_code == 400 and "field label not supported" in bad.json()["message"]
    # pages are one snapshot: a pod added between them does not show up
    first = http.get("/api/v1/pods", params={"limit": "2"}).json()
    assert len(first["items"]) == 2 and first["metadata"]["remainingItemCount"] == 1
    kube.add_pod("aaa", "early", "10.0.2.1")
    rest = http.get("/api/v1/pods", params={"limit": "2",
                                           "continue": first["metadata"]["continue"]}).json()
    assert [p["metadata"]["name"] for p in rest["items"]] == ["api"]
    assert rest["metadata"]["resourceVersion"] == first["metadata"]["resourceVersion"]
    kube.compact()
    expired = http.get("/api/v1/pods", params={"limit": "2",
                                              "continue": first["metadata"]["continue"]})
    assert expired.status_code == 410 and expired.json()["reason"] == "Expired"


def test_watch_from_list_sees_modified_then_deleted(kube: FakeKubeAPI,
                                                    http: httpx.Client) -> None:
    listed = http.get("/api/v1/namespaces/ns/pods").json()
    rv = listed["metadata"]["resourceVersion"]
    with watch(http, "/api/v1/namespaces/ns/pods", resourceVersion=rv) as response:
        assert response.status_code == 200
        assert response.headers["transfer-encoding"] == "chunked"
        kube.update_pod("other", "api", phase="Failed")  # another namespace
        kube.update_pod("ns", "web", phase="Succeeded", ip=None)
        kube.delete_pod("ns", "web")
        got = events(response, 2)
    assert [e["type"] for e in got] == ["MODIFIED", "DELETED"]
    modified, deleted = (e["object"] for e in got)
    assert modified["kind"] == "Pod" and modified["status"]["phase"] == "Succeeded"
    assert "podIP" not in modified["status"]
    assert int(modified["metadata"]["resourceVersion"]) > int(rv)
    assert int(deleted["metadata"]["resourceVersion"]) > int(
        modified["metadata"]["resourceVersion"])
    assert deleted["metadata"]["resourceVersion"] == str(kube.resource_version)


def test_watch_replays_history_and_follows_selectors(kube: FakeKubeAPI,
                                                     http: httpx.Client) -> None:
    start = kube.resource_version
    kube.update_pod("ns", "web", labels={"app": "y"})  # leaves app=x
    kube.update_pod("ns", "db", labels={"app": "x"})  # joins app=x
    kube.update_pod("ns", "db", phase="Running")
    # (a bookmark after the replay: nothing else was pending)
    with watch(http, "/api/v1/pods", resourceVersion=str(start), labelSelector="app=x",
               allowWatchBookmarks="true") as response:
        got = [(e["type"], e["object"]["metadata"].get("name", ""),
                e["object"]["metadata"]["resourceVersion"]) for e in events(response, 4)]
    assert got == [("DELETED", "web", str(start + 1)), ("ADDED", "db", str(start + 2)),
                   ("MODIFIED", "db", str(start + 3)), ("BOOKMARK", "", str(start + 3))]
    # from "0": the current pods first, as ADDED
    with watch(http, "/api/v1/namespaces/ns/pods", resourceVersion="0",
               allowWatchBookmarks="true") as response:
        assert [(e["type"], e["object"]["metadata"].get("name"))
                for e in events(response, 3)] == [("ADDED", "db"), ("ADDED", "web"),
                                                  ("BOOKMARK", None)]


def test_bookmarks_and_initial_events(kube: FakeKubeAPI, http: httpx.Client) -> None:
    rv = str(kube.resource_version)
    started = time.monotonic()
    with watch(http, "/api/v1/pods", resourceVersion=rv, allowWatchBookmarks="true",
               timeoutSeconds="2") as response:
        stream = Events(response)
        first = stream.next(1)[0]
        kube.update_pod("ns", "web", phase="Failed")
        modified, bookmark = stream.next(2)
    assert 0.1 < time.monotonic() - started < 1.5
    assert first == {"type": "BOOKMARK", "object": {"kind": "Pod", "apiVersion": "v1",
                                                    "metadata": {"resourceVersion": rv}}}
    assert modified["type"] == "MODIFIED"
    assert bookmark["type"] == "BOOKMARK"
    assert bookmark["object"]["metadata"]["resourceVersion"] == str(kube.resource_version)
    with watch(http, "/api/v1/namespaces/ns/pods", sendInitialEvents="true",
               resourceVersionMatch="NotOlderThan", allowWatchBookmarks="true",
               timeoutSeconds="1") as response:
        initial = events(response, 3)
    assert [e["type"] for e in initial] == ["ADDED", "ADDED", "BOOKMARK"]
    assert initial[2]["object"]["metadata"]["annotations"] == {
        "k8s.io/initial-events-end": "true"}


def test_watch_from_before_compaction_gets_410(kube: FakeKubeAPI, http: httpx.Client) -> None:
    old = str(kube.resource_version)
    kube.update_pod("ns", "web", phase="Failed")
    with watch(http, "/api/v1/pods", resourceVersion=old, timeoutSeconds="1") as response:
        assert events(response, 1)[0]["type"] == "MODIFIED"  # history still there
    kube.compact()
    started = time.monotonic()
    with watch(http, "/api/v1/pods", resourceVersion=old) as response:
        assert response.status_code == 200
        got = events(response)  # the stream ends by itself
    assert time.monotonic() - started < 1
    assert len(got) == 1 and got[0]["type"] == "ERROR"
    status = got[0]["object"]
    assert (status["kind"], status["status"], status["reason"], status["code"]) == (
        "Status", "Failure", "Expired", 410)
    assert status["message"].startswith(f"too old resource version: {old}")
    # from the horizon on, watching works again
    with watch(http, "/api/v1/pods", resourceVersion=str(kube.resource_version),
               timeoutSeconds="1") as response:
        kube.delete_pod("ns", "db")
        assert events(response, 1)[0]["type"] == "DELETED"


def test_cut_watches_and_stop_end_streams(kube: FakeKubeAPI, http: httpx.Client) -> None:
    before = {t.ident for t in threading.enumerate()}
    with watch(http, "/api/v1/pods", resourceVersion=str(kube.resource_version)) as response:
        assert kube.open_watches == 1
        assert kube.cut_watches() == 1
        assert kube.open_watches == 0
        with pytest.raises(httpx.RemoteProtocolError):  # no final chunk: cut, not ended
            events(response, 1)
    stream = watch(http, "/api/v1/pods", resourceVersion=str(kube.resource_version))
    with stream as response:
        kube.stop()
        assert events(response, 1) == []  # a clean end
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        left = [t for t in threading.enumerate() if t.ident not in before and t.is_alive()]
        if not left:
            break
        time.sleep(0.05)
    assert not left


def test_freeze_goes_silent_and_thaw_resumes(kube: FakeKubeAPI, http: httpx.Client) -> None:
    got: list[tuple[float, str]] = []  # (when, type) of each event of an open watch

    def read(response: httpx.Response) -> None:
        try:
            for line in response.iter_lines():
                if line:
                    got.append((time.monotonic(), json.loads(line)["type"]))
        except httpx.HTTPError as exc:
            got.append((time.monotonic(), repr(exc)))

    with watch(http, "/api/v1/pods", resourceVersion=str(kube.resource_version),
               allowWatchBookmarks="true", timeoutSeconds="4") as response:
        reader = threading.Thread(target=read, args=(response,), daemon=True)
        reader.start()
        assert _wait(lambda: got)  # a bookmark every 0.2 s
        kube.freeze()
        frozen = time.monotonic()
        kube.update_pod("ns", "web", phase="Failed")
        # A new connection is accepted and never answered.
        with httpx.Client(base_url=kube.url, verify=kube.client_context(), timeout=0.8,
                          headers={"authorization": f"Bearer {kube.admin_token}"}) as fresh, \
                pytest.raises(httpx.TimeoutException):
            fresh.get("/api/v1/pods")
        assert not [t for when, t in got if when > frozen + 0.3]  # silent, bookmarks too
        assert "MODIFIED" not in [t for _, t in got]
        kube.thaw()
        assert _wait(lambda: "MODIFIED" in [t for _, t in got])  # kept, sent after the thaw
        reader.join(6)
    assert [t for _, t in got][-1] == "BOOKMARK", got  # (the stream ended cleanly)
    assert http.get("/api/v1/pods").status_code == 200


def _wait(predicate: Callable[[], Any], timeout: float = 3.0) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


# -- tokens ----------------------------------------------------------------------------

def test_token_review(kube: FakeKubeAPI, http: httpx.Client) -> None:
    pod = kube.get_pod("ns", "web")
    assert pod is not None
    token = kube.issue_token("ns", "web")
    status = review(http, token, ["sandbox-gateway"])
    assert status["authenticated"] is True
    assert status["audiences"] == ["sandbox-gateway"]
    user = status["user"]
    assert user["username"] == "system:serviceaccount:ns:default"
    assert user["uid"] == (kube.get_service_account("ns", "default") or {})["metadata"]["uid"]
    assert user["groups"] == ["system:serviceaccounts", "system:serviceaccounts:ns",
                              "system:authenticated"]
    assert user["extra"]["authentication.kubernetes.io/pod-name"] == ["web"]
    assert user["extra"]["authentication.kubernetes.io/pod-uid"] == [pod["metadata"]["uid"]]
    assert user["extra"]["authentication.kubernetes.io/node-name"] == ["fake-node"]

    def refused(status: JSON, why: str) -> None:
        assert "authenticated" not in status  # omitted when false, as the real server
        assert status["user"] == {}
        assert why in status["error"]

    refused(review(http, token, ["another-service"]), "invalid for the target audiences")
    refused(review(http, token), "invalid for the target audiences")  # API audiences
    api_token = kube.issue_token("ns", "web", audience=kube.issuer)
    assert review(http, api_token)["authenticated"] is True
    refused(review(http, kube.issue_token("ns", "web", expires_in=-5), ["sandbox-gateway"]),
            "service account token has expired")
    refused(review(http, "not-a-token", ["sandbox-gateway"]), "invalid bearer token")
    header, claims, _signature = token.split(".")
    refused(review(http, f"{header}.{claims}.AAAA", ["sandbox-gateway"]),
            "error in cryptographic primitive")
    kube.delete_pod("ns", "web")
    refused(review(http, token, ["sandbox-gateway"]), "has been invalidated")
    kube.add_pod("ns", "web", "10.0.0.5")  # the same name again: another uid
    refused(review(http, token, ["sandbox-gateway"]), "does not match claim")
    assert review(http, kube.issue_token("ns", "web"), ["sandbox-gateway"])[
        "authenticated"] is True
    missing = http.post("/apis/authentication.k8s.io/v1/tokenreviews",
                        json={"kind": "TokenReview", "spec": {}})
    assert missing.status_code == 400


def test_oidc_discovery_verifies_issued_tokens(kube: FakeKubeAPI) -> None:
    with httpx.Client(verify=kube.client_context()) as anonymous:
        config = anonymous.get(f"{kube.url}/.well-known/openid-configuration").json()
    assert config["issuer"] == kube.issuer == kube.url
    assert config["jwks_uri"] == f"{kube.url}/openid/v1/jwks"
    assert config["id_token_signing_alg_values_supported"] == ["RS256"]
    assert config["response_types_supported"] == ["id_token"]
    assert config["subject_types_supported"] == ["public"]
    token = kube.issue_token("ns", "db", audience="sandbox-gateway", expires_in=600)
    keys = jwt.PyJWKClient(config["jwks_uri"], ssl_context=kube.client_context())
    key = keys.get_signing_key_from_jwt(token)
    assert key.key_id == kube.kid and jwt.get_unverified_header(token) == {
        "alg": "RS256", "kid": kube.kid}
    claims = jwt.decode(token, key.key, algorithms=["RS256"], audience="sandbox-gateway",
                        issuer=config["issuer"])
    pod = kube.get_pod("ns", "db")
    sa = kube.get_service_account("ns", "db")
    assert pod is not None and sa is not None
    assert claims["sub"] == "system:serviceaccount:ns:db"
    assert claims["aud"] == ["sandbox-gateway"]
    assert claims["exp"] - claims["iat"] == 600 and claims["nbf"] == claims["iat"]
    assert claims["kubernetes.io"] == {
        "namespace": "ns",
        "node": {"name": "fake-node", "uid": claims["kubernetes.io"]["node"]["uid"]},
        "pod": {"name": "db", "uid": pod["metadata"]["uid"]},
        "serviceaccount": {"name": "db", "uid": sa["metadata"]["uid"]}}
    with pytest.raises(jwt.InvalidAudienceError):
        jwt.decode(token, key.key, algorithms=["RS256"], audience="other",
                   issuer=config["issuer"])
