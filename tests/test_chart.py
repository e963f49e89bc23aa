"""Helm chart tests: a real helm 3.19 (scripts/fetch-helm.sh) and kubernetes-validate --strict.

No cluster is needed: everything is `helm lint` / `helm template`. If helm cannot be fetched the
tests FAIL (CI must have helm), they do not skip.
"""

from __future__ import annotations

import asyncio
import base64
import copy
import hashlib
import json
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519

from gateway.api.probes import PATHS as PROBE_PATHS
from gateway.config import load_config
from gateway.net.ca import mitmproxy_confdir
from gateway.services.identity.signing_keys import SigningKeys
from gateway.services.policy.loader import load_policy_texts
from gateway.services.secrets.factory import build_store
from gateway.tools.config_check import listen_warnings

REPO = Path(__file__).resolve().parent.parent
CHART = REPO / "charts" / "sandbox-gateway"
FETCH_HELM = REPO / "scripts" / "fetch-helm.sh"
K8S_VERSION = "1.30.0"  # kubernetes-validate ships offline schemas for it
RELEASE = "gw"
NAMESPACE = "egress"
CRD_KINDS = {
    "ServiceMonitor"
}  # CRDs have no schema in kubernetes-validate: skipped, and only those

Docs = list[dict[str, Any]]

# Every optional feature switched on at once.
ALL_ON: dict[str, Any] = {
    "replicaCount": 3,
    "image": {"digest": "sha256:" + "a" * 64},
    "transparent": {"enabled": True, "port": 8081},
    "gitSync": {
        "enabled": True,
        "repo": "https://git.example.test/platform/policies.git",
        "ref": "main",
        "path": "gateway/policies",
        "period": "15s",
        "credentialsSecret": "git-creds",
    },
    "hpa": {"enabled": True, "minReplicas": 2, "maxReplicas": 6},
    "serviceMonitor": {"enabled": True, "labels": {"release": "prometheus"}},
    "workloadIdentity": {
        "enabled": True,
        "clientId": "00000000-0000-0000-0000-000000000001",
        "tenantId": "00000000-0000-0000-0000-000000000002",
    },
    "secretStore": {
        "store": "azure-keyvault",
        "vaultUrl": "https://kv-agents.vault.azure.net",
        "cache": {"ttl": "5m", "stale_for": "1h"},
    },
    "state": {
        "store": "redis",
        "redis": {"existingSecret": "redis-url", "existingSecretKey": "url"},
    },
    "ca": {"existingSecret": "gateway-ca"},
    "signing": {"existingSecret": "gateway-signing", "kids": ["k2", "k1"]},
    "adminToken": {"existingSecret": "gateway-admin", "existingSecretKey": "admin-token"},
    "networkPolicy": {
        "sandboxNamespaces": ["sandboxes-a", "sandboxes-b"],
        "sandboxPodSelector": {"matchLabels": {"role": "sandbox"}},
        "metrics": {
            "namespace": "monitoring",
            "podSelector": {"matchLabels": {"app": "prometheus"}},
        },
        "adminFrom": [
            {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "orch"}}}
        ],
        "gateway": {
            "egressTo": {"redis": [
                {
                    "to": [
                        {
                            "namespaceSelector": {
                                "matchLabels": {"kubernetes.io/metadata.name": "redis"}
                            }
                        }
                    ],
                    "ports": [{"port": 6379, "protocol": "TCP"}],
                }
            ]},
            "extraEgress": [{"to": [{"ipBlock": {"cidr": "10.30.0.0/16"}}]}],
        },
    },
    "config": {"tokens": {"retired_kids": ["k1"]}, "network": {"allow_cidrs": ["10.20.0.0/16"]}},
    "test": {"policy": "coding-agent"},
    "podAnnotations": {"example.com/team": "platform"},
    "priorityClassName": "system-cluster-critical",
}

# Existing secrets everywhere: renders are deterministic (no generated key material).
DETERMINISTIC: dict[str, Any] = {
    "ca": {"existingSecret": "gateway-ca"},
    "signing": {"existingSecret": "gateway-signing"},
    "adminToken": {"existingSecret": "gateway-admin"},
}


# --------------------------------------------------------------------------- fixtures / helpers


@pytest.fixture(scope="session")
def helm() -> str:
    proc = subprocess.run(
        ["bash", str(FETCH_HELM)], capture_output=True, text=True, timeout=300, check=False
    )
    assert proc.returncode == 0, f"scripts/fetch-helm.sh failed (CI needs helm):\n{proc.stderr}"
    path = proc.stdout.strip().splitlines()[-1]
    assert Path(path).is_file(), path
    assert not Path(path).resolve().is_relative_to(REPO), "helm must be cached outside the repo"
    version = subprocess.run(
        [path, "version", "--short"], capture_output=True, text=True, check=True
    )
    assert version.stdout.startswith("v3.19.0"), version.stdout
    return path


def run_helm(helm: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([helm, *args], capture_output=True, text=True, timeout=60, check=False)
    if check:
        assert proc.returncode == 0, f"helm {' '.join(args)} failed:\n{proc.stdout}\n{proc.stderr}"
    return proc


Render = Callable[..., Docs]


# The repository chart's documents by the values and arguments they were rendered with:
# many tests render the same values (the defaults, ALL_ON), and each `helm template` is a
# process (0.3-0.5 s on a loaded machine). A test gets a copy (it may change what it reads).
_RENDERED: dict[str, Docs] = {}


@pytest.fixture
def render(helm: str, tmp_path: Path) -> Render:
    """helm template with values (dicts, later ones win) and extra args; returns the
    documents (the repository's chart rendered once per values and arguments:
    `_RENDERED`)."""
    counter = iter(range(1000))

    def _render(*values: dict[str, Any], args: tuple[str, ...] = (), chart: Path = CHART) -> Docs:
        # (the values files' text and the arguments; none kept for a chart a test made,
        # or for arguments that name a file, whose text the key would not hold)
        key = json.dumps([[yaml.safe_dump(v) for v in values], args])
        keep = chart == CHART and not any(Path(a).exists() for a in args)
        if keep and key in _RENDERED:
            return copy.deepcopy(_RENDERED[key])
        docs = _render_now(*values, args=args, chart=chart)
        if keep:
            _RENDERED[key] = copy.deepcopy(docs)
        return docs

    def _render_now(*values: dict[str, Any], args: tuple[str, ...], chart: Path) -> Docs:
        cmd = [
            "template",
            RELEASE,
            str(chart),
            "--namespace",
            NAMESPACE,
            "--kube-version",
            K8S_VERSION,
        ]
        for v in values:
            f = tmp_path / f"values-{next(counter)}.yaml"
            f.write_text(yaml.safe_dump(v))
            cmd += ["-f", str(f)]
        out = run_helm(helm, *cmd, *args).stdout
        return [d for d in yaml.safe_load_all(out) if d]

    return _render


def render_fails(helm: str, tmp_path: Path, values: dict[str, Any]) -> str:
    f = tmp_path / "bad-values.yaml"
    f.write_text(yaml.safe_dump(values))
    proc = run_helm(helm, "template", RELEASE, str(CHART), "-f", str(f), check=False)
    assert proc.returncode != 0, f"helm accepted bad values {values}:\n{proc.stdout[:500]}"
    return proc.stderr


def only(docs: Docs, kind: str, name_suffix: str = "") -> dict[str, Any]:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(name_suffix)]
    assert len(found) == 1, (
        f"want one {kind} *{name_suffix}, got {[d['metadata']['name'] for d in found]}"
    )
    return found[0]


def kinds(docs: Docs) -> list[str]:
    return sorted(d["kind"] for d in docs)


def pod_spec(docs: Docs) -> dict[str, Any]:
    spec: dict[str, Any] = only(docs, "Deployment")["spec"]["template"]["spec"]
    return spec


def container(docs: Docs, name: str = "gateway") -> dict[str, Any]:
    spec = pod_spec(docs)
    for c in spec["containers"] + spec.get("initContainers", []):
        if c["name"] == name:
            return c  # type: ignore[no-any-return]
    raise AssertionError(f"no container {name}")


def pod_annotations(docs: Docs) -> dict[str, str]:
    ann: dict[str, str] = only(docs, "Deployment")["spec"]["template"]["metadata"]["annotations"]
    return ann


def gateway_config(docs: Docs) -> dict[str, Any]:
    cfg: dict[str, Any] = yaml.safe_load(only(docs, "ConfigMap", "-config")["data"]["gateway.yaml"])
    return cfg


def validate_all(docs: Docs) -> list[str]:
    """Validate every manifest with kubernetes-validate (strict); return the CRD kinds skipped."""
    skipped = []
    for d in docs:
        if d["kind"] in CRD_KINDS:
            skipped.append(d["kind"])
            continue
        try:
            kubernetes_validate.validate(d, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:  # pragma: no cover - failure path
            pytest.fail(f"{d['kind']}/{d['metadata']['name']}: {e.message} at {list(e.path)}")
    return skipped


def labels_match(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# --------------------------------------------------------------------------- lint and validity


def test_fetch_helm_is_idempotent_and_cached_outside_the_repo(helm: str) -> None:
    again = subprocess.run(["bash", str(FETCH_HELM)], capture_output=True, text=True, check=True)
    assert again.stdout.strip() == helm
    assert "downloading" not in again.stderr  # served from the cache


def test_lint_strict_defaults(helm: str) -> None:
    out = run_helm(helm, "lint", "--strict", str(CHART)).stdout
    assert "0 chart(s) failed" in out
    assert "[WARNING]" not in out and "[ERROR]" not in out


def test_lint_strict_all_features(helm: str, tmp_path: Path) -> None:
    f = tmp_path / "all-on.yaml"
    f.write_text(yaml.safe_dump(ALL_ON))
    out = run_helm(helm, "lint", "--strict", str(CHART), "-f", str(f)).stdout
    assert "0 chart(s) failed" in out
    assert "[WARNING]" not in out and "[ERROR]" not in out


def test_default_render_is_valid(render: Render) -> None:
    docs = render()
    assert kinds(docs) == sorted(
        [
            "ConfigMap",
            "ConfigMap",
            "Deployment",
            "NetworkPolicy",
            "PersistentVolumeClaim",
            "Pod",
            "Secret",
            "Secret",
            "Secret",
            "Service",
            "ServiceAccount",
        ]
    )  # one replica by default (state.store: sqlite, on a PVC): no PodDisruptionBudget
    assert validate_all(docs) == []
    assert all(d["metadata"].get("namespace") == NAMESPACE for d in docs)


def test_all_features_render_is_valid(render: Render) -> None:
    docs = render(ALL_ON, args=("--api-versions", "monitoring.coreos.com/v1"))
    # ServiceMonitor is a CRD (no offline schema): the only kind skipped by the validator.
    assert validate_all(docs) == ["ServiceMonitor"]
    ks = kinds(docs)
    for kind in ("HorizontalPodAutoscaler", "ServiceMonitor", "PodDisruptionBudget"):
        assert kind in ks
    assert ks.count("NetworkPolicy") == 3  # gateway + one per sandbox namespace
    assert "Secret" not in ks  # every secret is an existing one
    assert not [d for d in docs if d["metadata"]["name"].endswith("-policies")]  # git-sync instead


def test_kubernetes_validate_cli_strict(render: Render, tmp_path: Path) -> None:
    """The same check through the CLI (`kubernetes-validate --strict`), all features on."""
    docs = [d for d in render(ALL_ON) if d["kind"] not in CRD_KINDS]
    f = tmp_path / "all.yaml"
    f.write_text(yaml.safe_dump_all(docs))
    exe = (
        shutil.which("kubernetes-validate", path=str(Path(sys.executable).parent))
        or "kubernetes-validate"
    )
    proc = subprocess.run(
        [exe, "--strict", "-k", K8S_VERSION, "--quiet", str(f)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


# --------------------------------------------------------------------------- pod hardening


HARDENED = {
    "runAsNonRoot": True,
    "readOnlyRootFilesystem": True,
    "allowPrivilegeEscalation": False,
}


def assert_hardened(c: dict[str, Any], pod_sc: dict[str, Any]) -> None:
    sc = c["securityContext"]
    for k, v in HARDENED.items():
        assert sc.get(k) == v, f"{c['name']}: securityContext.{k} should be {v}"
    assert sc["capabilities"]["drop"] == ["ALL"], c["name"]
    assert not sc["capabilities"].get("add"), c["name"]
    assert sc.get("privileged", False) is False
    seccomp = sc.get("seccompProfile") or pod_sc.get("seccompProfile")
    assert seccomp == {"type": "RuntimeDefault"}, c["name"]
    uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
    assert isinstance(uid, int) and uid > 0, c["name"]


def test_gateway_pod_is_hardened_with_probes(render: Render) -> None:
    docs = render(ALL_ON)
    spec = pod_spec(docs)
    pod_sc = spec["securityContext"]
    assert pod_sc["runAsNonRoot"] is True and pod_sc["runAsUser"] == 10001
    assert pod_sc["seccompProfile"] == {"type": "RuntimeDefault"}
    assert spec["automountServiceAccountToken"] is False
    names = [c["name"] for c in spec["containers"] + spec["initContainers"]]
    assert names == ["gateway", "git-sync", "git-sync-init"]
    for c in spec["containers"] + spec["initContainers"]:
        assert_hardened(c, pod_sc)
        assert c["resources"].get("limits", {}).get("memory"), c["name"]

    gw = container(docs)
    assert gw["securityContext"]["runAsUser"] == 10001
    assert gw["args"] == ["run", "--config", "/etc/sandbox-gateway/gateway.yaml"]
    assert gw["startupProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    assert gw["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "admin"}
    assert gw["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "admin"}
    # Read-only root: the only writable mounts are the scratch emptyDirs (Redis: no state volume).
    volumes = {v["name"]: v for v in spec["volumes"]}
    writable = {m["mountPath"] for m in gw["volumeMounts"] if not m.get("readOnly")}
    assert writable == {"/tmp", "/run/sandbox-gateway"}
    assert all(
        "emptyDir" in volumes[m["name"]] for m in gw["volumeMounts"] if not m.get("readOnly")
    )

    strategy = only(docs, "Deployment")["spec"]["strategy"]
    assert strategy["rollingUpdate"]["maxUnavailable"] == 0


@pytest.mark.parametrize("admin_port", [8090, 9191])
def test_probes_reach_the_admin_listener_the_gateway_serves(render: Render,
                                                            admin_port: int) -> None:
    """Issue 46, item 4: the kubelet's probes go to the port the gateway's config puts the
    admin listener on (`listen.admin`), on the paths it answers past the listener's
    connection cap (gateway/api/probes.py), so a full admin listener never fails them."""
    docs = render({"ports": {"admin": admin_port}})
    gw = container(docs)
    ports = {p["name"]: p["containerPort"] for p in gw["ports"]}
    listen = gateway_config(docs)["listen"]["admin"]
    assert listen == f"0.0.0.0:{admin_port}" and ports["admin"] == admin_port
    probes = {kind: gw[kind]["httpGet"] for kind in
              ("startupProbe", "readinessProbe", "livenessProbe")}
    assert {p["port"] for p in probes.values()} == {"admin"}
    assert probes["startupProbe"]["path"] == probes["readinessProbe"]["path"] == "/readyz"
    assert probes["livenessProbe"]["path"] == "/healthz"
    assert {p["path"] for p in probes.values()} <= set(PROBE_PATHS)


def test_certs_are_projected_with_mode_0440(render: Render) -> None:
    docs = render(ALL_ON)
    certs = next(v for v in pod_spec(docs)["volumes"] if v["name"] == "certs")["projected"]
    assert certs["defaultMode"] == 0o440
    ca, signing = certs["sources"]
    assert ca["secret"] == {
        "name": "gateway-ca",
        "items": [{"key": "tls.crt", "path": "ca.crt"}, {"key": "tls.key", "path": "ca.key"}],
    }
    assert signing["secret"] == {
        "name": "gateway-signing",
        "items": [
            {"key": "k2.pem", "path": "signing/k2.pem"},
            {"key": "k1.pem", "path": "signing/k1.pem"},
        ],
    }
    mount = next(m for m in container(docs)["volumeMounts"] if m["name"] == "certs")
    assert mount == {"name": "certs", "mountPath": "/etc/sandbox-gateway/certs", "readOnly": True}


def test_test_pod_is_a_hardened_helm_test_hook(render: Render) -> None:
    docs = render()
    pod = only(docs, "Pod")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    assert_hardened(pod["spec"]["containers"][0], pod["spec"]["securityContext"])
    c = pod["spec"]["containers"][0]
    env = {e["name"]: e for e in c["env"]}
    assert env["ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": f"{RELEASE}-sandbox-gateway-admin",
        "key": "token",
    }
    assert env["TEST_POLICY"]["value"] == "default"  # first policy file by default
    assert env["PROXY_HOSTPORT"]["value"] == f"{RELEASE}-sandbox-gateway.{NAMESPACE}.svc:8080"
    script = c["args"][0]
    for needle in ("/readyz", "407", "/v1/tokens", "403", "x-sandbox-gateway-error"):
        assert needle in script
    # Existing admin secret: the test reads the token from there.
    pod = only(render(ALL_ON), "Pod")
    env = {e["name"]: e for e in pod["spec"]["containers"][0]["env"]}
    assert env["ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "gateway-admin",
        "key": "admin-token",
    }
    assert env["TEST_POLICY"]["value"] == "coding-agent"


# --------------------------------------------------------------------------- network policies


def test_network_policies_match_pods_and_ports(render: Render) -> None:
    docs = render(ALL_ON)
    pod_labels = only(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    svc = only(docs, "Service")
    gw = container(docs)
    container_ports = {p["name"]: p["containerPort"] for p in gw["ports"]}
    assert {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]} == {
        "proxy": "proxy",
        "admin": "admin",
        "transparent": "transparent",
        "dns": "dns",
        "dns-tcp": "dns-tcp",
    }
    assert labels_match(svc["spec"]["selector"], pod_labels)

    nps = [d for d in docs if d["kind"] == "NetworkPolicy"]
    gw_np = next(n for n in nps if n["metadata"]["namespace"] == NAMESPACE)
    assert labels_match(gw_np["spec"]["podSelector"]["matchLabels"], pod_labels)
    assert gw_np["spec"]["podSelector"]["matchLabels"] == svc["spec"]["selector"]
    proxy_rule, admin_rule = gw_np["spec"]["ingress"]
    assert {(p["port"], p["protocol"]) for p in proxy_rule["ports"]} == {
        (container_ports["proxy"], "TCP"),
        (container_ports["transparent"], "TCP"),
        (container_ports["dns"], "UDP"),
        (container_ports["dns-tcp"], "TCP"),
    }
    assert {p["port"] for p in admin_rule["ports"]} == {container_ports["admin"]}
    sandbox_nss = {
        peer["namespaceSelector"]["matchLabels"]["kubernetes.io/metadata.name"]
        for peer in proxy_rule["from"]
        if "namespaceSelector" in peer
    }
    assert sandbox_nss == {"sandboxes-a", "sandboxes-b"}
    assert all(
        peer["podSelector"] == {"matchLabels": {"role": "sandbox"}}
        for peer in proxy_rule["from"]
        if "namespaceSelector" in peer
    )
    # No rule may be open to everyone (an empty `from` means every source).
    assert all(rule.get("from") for rule in gw_np["spec"]["ingress"])
    # The helm test pod is one of the allowed peers of both rules.
    test_labels = only(docs, "Pod")["metadata"]["labels"]
    for rule in (proxy_rule, admin_rule):
        assert any(
            set(peer) == {"podSelector"}
            and labels_match(peer["podSelector"]["matchLabels"], test_labels)
            for peer in rule["from"]
        )
    assert not labels_match(
        next(p for p in proxy_rule["from"] if set(p) == {"podSelector"})["podSelector"][
            "matchLabels"
        ],
        pod_labels,
    )

    sandbox_nps = [n for n in nps if n["metadata"]["namespace"] != NAMESPACE]
    assert {n["metadata"]["namespace"] for n in sandbox_nps} == {"sandboxes-a", "sandboxes-b"}
    for n in sandbox_nps:
        assert n["spec"]["policyTypes"] == ["Egress"]
        assert n["spec"]["podSelector"] == {"matchLabels": {"role": "sandbox"}}
        # Transparent mode: the gateway only, DNS included (its resolver); no cluster DNS.
        (to_gateway,) = n["spec"]["egress"]
        (peer,) = to_gateway["to"]
        assert peer["namespaceSelector"]["matchLabels"] == {
            "kubernetes.io/metadata.name": NAMESPACE
        }
        assert labels_match(peer["podSelector"]["matchLabels"], pod_labels)
        assert {(p["port"], p["protocol"]) for p in to_gateway["ports"]} == {
            (container_ports["proxy"], "TCP"),
            (container_ports["transparent"], "TCP"),
            (container_ports["dns"], "UDP"),
            (container_ports["dns-tcp"], "TCP"),
        }


def test_network_policy_can_be_disabled(render: Render) -> None:
    docs = render({"networkPolicy": {"enabled": False, "sandboxNamespaces": ["x"]}})
    assert "NetworkPolicy" not in kinds(docs)


# --------------------------------------------------------------------------- checksums / reload


def test_checksums_track_what_is_mounted(render: Render) -> None:
    docs = render()
    ann = pod_annotations(docs)
    config_text = only(docs, "ConfigMap", "-config")["data"]["gateway.yaml"]
    assert ann["checksum/config"] == hashlib.sha256(config_text.rstrip("\n").encode()).hexdigest()

    # Generated secrets are computed once per render: the checksum is of what the Secrets hold.
    def data(suffix: str) -> str:
        d = only(docs, "Secret", suffix)["data"]
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    expected = json.dumps([data("-ca"), data("-signing"), data("-admin")], separators=(",", ":"))
    assert ann["checksum/secrets"] == hashlib.sha256(expected.encode()).hexdigest()
    assert "checksum/policies" not in ann


def test_config_change_rolls_pods(render: Render) -> None:
    a = pod_annotations(render(DETERMINISTIC))
    b = pod_annotations(render(DETERMINISTIC, {"config": {"tokens": {"max_ttl": "1h"}}}))
    assert a["checksum/config"] != b["checksum/config"]
    assert a["checksum/secrets"] == b["checksum/secrets"]


def test_key_material_change_rolls_pods(render: Render) -> None:
    a = pod_annotations(render(DETERMINISTIC))
    b = pod_annotations(render(DETERMINISTIC, {"ca": {"existingSecret": "gateway-ca-2"}}))
    c = pod_annotations(render(DETERMINISTIC, {"signing": {"kids": ["k1", "k2"]}}))
    assert len({a["checksum/secrets"], b["checksum/secrets"], c["checksum/secrets"]}) == 3
    assert a["checksum/config"] == b["checksum/config"]


def test_policy_change_is_hot_reloaded_by_default(render: Render) -> None:
    base = render(DETERMINISTIC)
    changed = render(
        DETERMINISTIC, {"policies": {"default.yaml": "version: v1\nname: default\negress: []\n"}}
    )
    assert (
        only(base, "ConfigMap", "-policies")["data"]
        != only(changed, "ConfigMap", "-policies")["data"]
    )
    # The Deployment does not change at all: nothing rolls, the gateway reloads the volume.
    assert only(base, "Deployment") == only(changed, "Deployment")


def test_policy_change_rolls_pods_with_roll_on_change(render: Render) -> None:
    roll = {"policies": {"rollOnChange": True}}
    a = pod_annotations(render(DETERMINISTIC, roll))
    b = pod_annotations(
        render(DETERMINISTIC, roll, {"policies": {"extra.yaml": "version: v1\nname: extra\n"}})
    )
    assert a["checksum/policies"] != b["checksum/policies"]
    assert a["checksum/config"] == b["checksum/config"]


def test_set_file_adds_a_policy(helm: str, tmp_path: Path) -> None:
    policy = tmp_path / "coding-agent.yaml"
    policy.write_text("version: v1\nname: coding-agent\negress:\n  - host: api.github.com\n")
    out = run_helm(
        helm,
        "template",
        RELEASE,
        str(CHART),
        "-n",
        NAMESPACE,
        "--set-file",
        f"policies.coding-agent\\.yaml={policy}",
    ).stdout
    cm = only([d for d in yaml.safe_load_all(out) if d], "ConfigMap", "-policies")
    assert set(cm["data"]) == {"default.yaml", "coding-agent.yaml"}
    assert yaml.safe_load(cm["data"]["coding-agent.yaml"])["name"] == "coding-agent"
    assert "rollOnChange" not in cm["data"]


# --------------------------------------------------------------------------- gateway.yaml


def test_gateway_config_defaults(render: Render) -> None:
    cfg = gateway_config(render())
    assert cfg["listen"] == {"proxy": "0.0.0.0:8080", "admin": "0.0.0.0:8090", "transparent": None,
                             "dns": None, "reachable_from": (
                                 f"NetworkPolicy {RELEASE}-sandbox-gateway: the proxy port from "
                                 "the pods of no namespace yet (networkPolicy.sandboxNamespaces) "
                                 "only")}
    off = gateway_config(render({"networkPolicy": {"enabled": False}}))["listen"]
    assert "reachable_from" not in off  # (then the gateway warns: nothing said limits it)
    assert "dns" not in cfg
    assert cfg["policies"] == "/etc/sandbox-gateway/policies"
    assert cfg["certs"] == "/etc/sandbox-gateway/certs"
    assert cfg["runtime_dir"] == "/run/sandbox-gateway"  # scratch (emptyDir), not the state volume
    assert cfg["admin_token"] is None  # comes from the Secret via env
    assert cfg["state"] == {"store": "sqlite", "path": "/var/lib/sandbox-gateway/gateway.db"}
    assert cfg["tokens"]["default_ttl"] == "15m"
    assert cfg["audit"] == {"path": None}


def test_gateway_config_all_features(render: Render) -> None:
    docs = render(ALL_ON)
    cfg = gateway_config(docs)
    assert cfg["listen"]["transparent"] == "0.0.0.0:8081"
    assert cfg["policies"] == "/git/current/gateway/policies"
    assert cfg["secrets"] == {
        "store": "azure-keyvault",
        "vault_url": "https://kv-agents.vault.azure.net",
        "credential": "workload",
        "cache": {"ttl": "5m", "stale_for": "1h"},
    }
    assert cfg["state"] == {"store": "redis"}  # the URL comes from the existing Secret
    assert cfg["tokens"]["retired_kids"] == ["k1"]
    assert cfg["network"]["allow_cidrs"] == ["10.20.0.0/16"]
    env = {e["name"]: e for e in container(docs)["env"]}
    assert env["SANDBOX_GATEWAY_STATE__URL"]["valueFrom"]["secretKeyRef"] == {
        "name": "redis-url",
        "key": "url",
    }
    assert env["SANDBOX_GATEWAY_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"] == {
        "name": "gateway-admin",
        "key": "admin-token",
    }
    assert container(docs)["image"] == "ghcr.io/sandbox-gateway/sandbox-gateway@sha256:" + "a" * 64


def test_refusals_are_rendered(render: Render) -> None:
    """`config.refusals` reaches gateway.yaml (it was accepted by the schema and dropped by
    the template until tests/test_config_schema.py checked each modelled section)."""
    assert gateway_config(render())["refusals"] == {"inside_tls": True}
    off = render({"config": {"refusals": {"inside_tls": False}}})
    assert gateway_config(off)["refusals"] == {"inside_tls": False}


def test_redis_url_in_values(render: Render) -> None:
    docs = render({"state": {"store": "redis", "redis": {"url": "redis://redis.redis.svc:6379/0"}}})
    assert gateway_config(docs)["state"] == {
        "store": "redis",
        "url": "redis://redis.redis.svc:6379/0",
    }
    assert "SANDBOX_GATEWAY_STATE__URL" not in {e["name"] for e in container(docs)["env"]}


def test_git_sync(render: Render) -> None:
    docs = render(ALL_ON)
    spec = pod_spec(docs)
    init = container(docs, "git-sync-init")
    side = container(docs, "git-sync")
    for c in (init, side):
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["GITSYNC_REPO"] == ALL_ON["gitSync"]["repo"]
        assert env["GITSYNC_ROOT"] == "/git" and env["GITSYNC_LINK"] == "current"
        assert c["image"].startswith("registry.k8s.io/git-sync/git-sync:v4.")
        assert c["envFrom"] == [{"secretRef": {"name": "git-creds"}}]
    assert {e["name"]: e.get("value") for e in init["env"]}["GITSYNC_ONE_TIME"] == "true"
    assert {e["name"]: e.get("value") for e in side["env"]}["GITSYNC_PERIOD"] == "15s"
    gw_git = next(m for m in container(docs)["volumeMounts"] if m["name"] == "git")
    assert gw_git == {"name": "git", "mountPath": "/git", "readOnly": True}
    assert "policies" not in {v["name"] for v in spec["volumes"]}


def test_transparent_port(render: Render) -> None:
    docs = render({"transparent": {"enabled": True, "port": 9081}})
    assert {"name": "transparent", "containerPort": 9081, "protocol": "TCP"} in container(docs)[
        "ports"
    ]
    assert any(
        p["name"] == "transparent" and p["port"] == 9081
        for p in only(docs, "Service")["spec"]["ports"]
    )
    assert gateway_config(docs)["listen"]["transparent"] == "0.0.0.0:9081"
    assert "transparent" not in {p["name"] for p in container(render())["ports"]}


# --------------------------------------------------------------------------- generated key material


def test_generated_key_material(render: Render) -> None:
    docs = render({"signing": {"kids": ["k1", "k2"]}})
    ca = only(docs, "Secret", "-ca")
    assert ca["type"] == "kubernetes.io/tls"
    assert ca["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"
    cert = x509.load_pem_x509_certificate(base64.b64decode(ca["data"]["tls.crt"]))
    key = serialization.load_pem_private_key(base64.b64decode(ca["data"]["tls.key"]), None)
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert isinstance(key, ec.EllipticCurvePrivateKey) and key.curve.name == "secp256r1"
    assert cert.public_key() == key.public_key()

    signing = only(docs, "Secret", "-signing")["data"]
    assert set(signing) == {"k1.pem", "k2.pem"}
    for pem_b64 in signing.values():
        pem = base64.b64decode(pem_b64)
        assert pem.startswith(b"-----BEGIN PRIVATE KEY-----")  # PKCS#8
        assert isinstance(serialization.load_pem_private_key(pem, None), ed25519.Ed25519PrivateKey)
    assert signing["k1.pem"] != signing["k2.pem"]

    token = base64.b64decode(only(docs, "Secret", "-admin")["data"]["token"])
    assert len(token) >= 32


def test_generated_key_material_loads_in_the_gateway(render: Render, tmp_path: Path) -> None:
    """What the chart generates is what the gateway reads from the projected certs volume."""
    docs = render({"signing": {"kids": ["k1", "k2"]}})
    certs = tmp_path / "certs"
    (certs / "signing").mkdir(parents=True)
    ca = only(docs, "Secret", "-ca")["data"]
    (certs / "ca.crt").write_bytes(base64.b64decode(ca["tls.crt"]))
    (certs / "ca.key").write_bytes(base64.b64decode(ca["tls.key"]))
    for entry, pem in only(docs, "Secret", "-signing")["data"].items():
        (certs / "signing" / entry).write_bytes(base64.b64decode(pem))
    confdir = mitmproxy_confdir(certs / "ca.crt", certs / "ca.key", tmp_path / "runtime")
    assert (confdir / "mitmproxy-ca.pem").is_file()
    keys = SigningKeys.load(certs / "signing", retired=["k1"], create=False)
    assert keys.signing_kid == "k2" and set(keys.private) == {"k1", "k2"}


def test_rendered_config_loads_in_the_gateway(
    render: Render, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gateway.yaml from the chart passes the gateway's own config and secret-store validation."""
    f = tmp_path / "gateway.yaml"
    f.write_text(only(render(), "ConfigMap", "-config")["data"]["gateway.yaml"])
    cfg = load_config(f, env={"SANDBOX_GATEWAY_ADMIN_TOKEN": "x" * 32})
    assert str(cfg.listen.admin) == "0.0.0.0:8090" and cfg.listen.transparent is None
    assert cfg.listen.dns is None
    assert cfg.policies == Path("/etc/sandbox-gateway/policies")
    assert cfg.signing_dir == Path("/etc/sandbox-gateway/certs/signing")
    assert cfg.runtime_dir == Path("/run/sandbox-gateway")
    assert cfg.state == {"store": "sqlite", "path": "/var/lib/sandbox-gateway/gateway.db"}
    assert cfg.admin_token == "x" * 32
    asyncio.run(build_store(cfg.secrets).close())

    f.write_text(only(render(ALL_ON), "ConfigMap", "-config")["data"]["gateway.yaml"])
    url = "redis://redis-master.redis.svc:6379/0"
    cfg = load_config(f, env={"SANDBOX_GATEWAY_STATE__URL": url})
    assert cfg.state == {"store": "redis", "url": url}  # the env name the Deployment sets
    assert cfg.listen.reachable_from == (f"NetworkPolicy {RELEASE}-sandbox-gateway: the proxy "
                                         "port from the pods of sandboxes-a, sandboxes-b only")
    assert listen_warnings(cfg) == []  # the chart's NetworkPolicy is the stated limit
    assert str(cfg.listen.transparent) == "0.0.0.0:8081"
    assert str(cfg.listen.dns) == "0.0.0.0:5353"
    assert (cfg.dns.ttl, cfg.dns.rate, cfg.dns.burst) == (10, 20.0, 50)
    assert cfg.tokens.retired_kids == ("k1",)
    token_file = tmp_path / "azure-token"
    token_file.write_text("federated-token")
    monkeypatch.setenv("AZURE_CLIENT_ID", ALL_ON["workloadIdentity"]["clientId"])
    monkeypatch.setenv("AZURE_TENANT_ID", ALL_ON["workloadIdentity"]["tenantId"])
    monkeypatch.setenv("AZURE_FEDERATED_TOKEN_FILE", str(token_file))
    asyncio.run(build_store(cfg.secrets).close())


@pytest.mark.parametrize(("values", "memory", "percent"), [
    ({}, 0, 85.0),  # 85 % of resources.limits.memory (1Gi), shared by the workers
    ({"config": {"limits": {"memory": "600Mi"}}}, 600 * 1024 * 1024, 0.0),
    ({"resources": {"limits": {"memory": None}}}, 0, 0.0),  # no container limit: none
    ({"config": {"limits": {"memory": 0}}}, 0, 0.0),
])
def test_the_memory_ceiling_follows_the_container_limit(
        render: Render, tmp_path: Path, values: dict[str, Any], memory: int,
        percent: float) -> None:
    """Issue 46, item 3: a worker refuses new connections before the pod's memory limit
    has it killed: `limits.memory` is 85 % of the container's limit by default."""
    f = tmp_path / "gateway.yaml"
    f.write_text(only(render(values), "ConfigMap", "-config")["data"]["gateway.yaml"])
    cfg = load_config(f, env={})
    assert (cfg.limits.memory, cfg.limits.memory_percent) == (memory, percent)


def test_console_retain_in_lines_or_a_size(render: Render, tmp_path: Path) -> None:
    f = tmp_path / "gateway.yaml"
    f.write_text(only(render({"config": {"console": {"retain": "50Mi"}}}), "ConfigMap",
                      "-config")["data"]["gateway.yaml"])
    cfg = load_config(f, env={})
    assert (cfg.console.retain, cfg.console.retain_bytes) == (0, 50 * 1024 * 1024)


@pytest.mark.parametrize(("values", "where"), [
    ({}, "/var/lib/sandbox-gateway/audit-spill"),  # the state PVC (sqlite)
    (ALL_ON, "/run/sandbox-gateway/audit-spill"),  # redis: no state volume, the runtime dir
    ({"config": {"audit": {"spill": {"path": "/var/lib/sandbox-gateway/spool", "max": "1g"}}}},
     "/var/lib/sandbox-gateway/spool"),
])
def test_the_audit_spill_journal_is_on_a_writable_volume(
        render: Render, tmp_path: Path, values: dict[str, Any], where: str) -> None:
    """Issue 46, item 5: the gateway's default journal path (audit.spill.path) lands on a
    volume the chart mounts writable (the root file system is read-only)."""
    docs = render(values)
    f = tmp_path / "gateway.yaml"
    f.write_text(only(docs, "ConfigMap", "-config")["data"]["gateway.yaml"])
    cfg = load_config(f, env={"SANDBOX_GATEWAY_STATE__URL": "redis://r:6379/0"})
    assert cfg.audit.spill.path == Path(where) and cfg.audit.spill.max > 0
    writable = [Path(m["mountPath"]) for m in container(docs)["volumeMounts"]
                if not m.get("readOnly")]
    assert any(Path(where).is_relative_to(m) for m in writable), writable


def test_default_policies_load_and_name_the_test_policy(render: Render) -> None:
    """The example policy in values.yaml is valid; `helm test` mints for a policy that exists."""
    docs = render()
    policies = load_policy_texts(only(docs, "ConfigMap", "-policies")["data"])
    env = {e["name"]: e.get("value") for e in only(docs, "Pod")["spec"]["containers"][0]["env"]}
    assert policies.get(env["TEST_POLICY"]) is not None


def test_existing_secrets_are_used_not_generated(render: Render) -> None:
    docs = render(DETERMINISTIC)
    assert "Secret" not in kinds(docs)
    sources = next(v for v in pod_spec(docs)["volumes"] if v["name"] == "certs")["projected"][
        "sources"
    ]
    assert [s["secret"]["name"] for s in sources] == ["gateway-ca", "gateway-signing"]


# --------------------------------------------------------------------------- optional resources


def test_workload_identity(render: Render) -> None:
    on = render(ALL_ON)
    assert (
        only(on, "Deployment")["spec"]["template"]["metadata"]["labels"][
            "azure.workload.identity/use"
        ]
        == "true"
    )
    sa_ann = only(on, "ServiceAccount")["metadata"]["annotations"]
    assert sa_ann["azure.workload.identity/client-id"] == ALL_ON["workloadIdentity"]["clientId"]
    assert sa_ann["azure.workload.identity/tenant-id"] == ALL_ON["workloadIdentity"]["tenantId"]
    assert pod_spec(on)["serviceAccountName"] == only(on, "ServiceAccount")["metadata"]["name"]

    off = render()
    assert (
        "azure.workload.identity/use"
        not in only(off, "Deployment")["spec"]["template"]["metadata"]["labels"]
    )
    assert not any(
        k.startswith("azure.workload.identity/")
        for k in (only(off, "ServiceAccount")["metadata"].get("annotations") or {})
    )


def test_service_monitor_only_when_api_present(render: Render) -> None:
    values = {"serviceMonitor": {"enabled": True}}
    assert "ServiceMonitor" not in kinds(render(values))
    assert "ServiceMonitor" not in kinds(
        render(args=("--api-versions", "monitoring.coreos.com/v1"))
    )
    docs = render(values, args=("--api-versions", "monitoring.coreos.com/v1"))
    sm = only(docs, "ServiceMonitor")
    assert sm["spec"]["endpoints"][0]["port"] == "admin"
    assert sm["spec"]["endpoints"][0]["path"] == "/metrics"
    assert labels_match(
        sm["spec"]["selector"]["matchLabels"], only(docs, "Service")["metadata"]["labels"]
    )


REDIS: dict[str, Any] = {"state": {"store": "redis", "redis": {"url": "redis://redis:6379/0"}}}


def test_hpa_replaces_replicas(render: Render) -> None:
    docs = render(REDIS, {"hpa": {"enabled": True, "minReplicas": 3, "maxReplicas": 9}})
    assert "replicas" not in only(docs, "Deployment")["spec"]
    hpa = only(docs, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == only(docs, "Deployment")["metadata"]["name"]
    assert (hpa["spec"]["minReplicas"], hpa["spec"]["maxReplicas"]) == (3, 9)
    assert only(render(), "Deployment")["spec"]["replicas"] == 1


def test_pdb_only_with_more_than_one_replica(render: Render) -> None:
    docs = render(REDIS, {"replicaCount": 2})
    pdb = only(docs, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1
    assert labels_match(
        pdb["spec"]["selector"]["matchLabels"],
        only(docs, "Deployment")["spec"]["template"]["metadata"]["labels"],
    )
    assert "PodDisruptionBudget" not in kinds(render())


SQLITE_PER_POD = ("the state.store: sqlite file is per pod (on a volume one pod mounts: two pods "
                  "must never open it), so every replica would keep its own revocations, "
                  "registered sandboxes and budgets")


@pytest.mark.parametrize(
    ("values", "what", "why"),
    [
        ({"replicaCount": 2}, "replicaCount: 2", SQLITE_PER_POD),
        ({"hpa": {"enabled": True}}, "hpa.maxReplicas: 10", SQLITE_PER_POD),
        (
            {"replicaCount": 2, "persistence": {"enabled": False}},
            "replicaCount: 2",
            SQLITE_PER_POD,
        ),
        (
            {"replicaCount": 3, "state": {"store": "memory"}},
            "replicaCount: 3",
            "with state.store: memory every replica keeps its own revocations",
        ),
    ],
)
def test_more_than_one_replica_needs_redis(helm: str, tmp_path: Path, render: Render,
                                           values: dict[str, Any], what: str, why: str) -> None:
    err = render_fails(helm, tmp_path, values)
    assert (f"{what} needs state.store: redis (with state.redis.url or "
            "state.redis.existingSecret)") in err
    assert why in err
    assert "a revoked token keeps working on the other replicas" in err
    assert "Set replicaCount: 1, or use Redis" in err
    # The same values with Redis render (no state volume, rolling updates), and one replica
    # needs nothing shared.
    docs = render(values, REDIS)
    assert validate_all(docs) == []
    assert gateway_config(docs)["state"]["store"] == "redis"
    assert "PersistentVolumeClaim" not in kinds(docs)
    assert only(docs, "Deployment")["spec"]["strategy"]["type"] == "RollingUpdate"
    assert only(render({"replicaCount": 1}), "Deployment")["spec"]["replicas"] == 1


# --------------------------------------------------------------------------- state volume (sqlite)

STATE_DIR = "/var/lib/sandbox-gateway"  # the image's declared VOLUME
STATE_CLAIM = f"{RELEASE}-sandbox-gateway-state"


def state_volume(docs: Docs) -> dict[str, Any] | None:
    return next((v for v in pod_spec(docs)["volumes"] if v["name"] == "state"), None)


def state_mount(docs: Docs) -> dict[str, Any] | None:
    return next((m for m in container(docs)["volumeMounts"] if m["name"] == "state"), None)


def test_default_state_is_on_a_kept_pvc_with_recreate(render: Render, tmp_path: Path) -> None:
    docs = render()
    assert validate_all(docs) == []
    pvc = only(docs, "PersistentVolumeClaim")
    assert pvc["metadata"]["name"] == STATE_CLAIM
    assert pvc["metadata"]["namespace"] == NAMESPACE
    # `helm uninstall` leaves the claim (and the state) in place.
    assert pvc["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
    # No storageClassName: the cluster's default class.
    assert pvc["spec"] == {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": "1Gi"}},
    }
    deployment = only(docs, "Deployment")
    assert deployment["spec"]["replicas"] == 1
    # Two pods must never open the file: no rolling update, no surge.
    assert deployment["spec"]["strategy"] == {"type": "Recreate"}
    assert state_volume(docs) == {
        "name": "state",
        "persistentVolumeClaim": {"claimName": STATE_CLAIM},
    }
    assert state_mount(docs) == {"name": "state", "mountPath": STATE_DIR}
    cfg = gateway_config(docs)
    assert cfg["state"] == {"store": "sqlite", "path": f"{STATE_DIR}/gateway.db"}
    assert Path(cfg["state"]["path"]).parent == Path(STATE_DIR)
    # Scratch files stay off the state volume.
    assert not Path(cfg["runtime_dir"]).is_relative_to(STATE_DIR)
    # A fresh volume is writable by the non-root user (its group), and the kubelet re-owns
    # it only on the first mount (the 0600 file is not made group-readable on every start).
    pod_sc = pod_spec(docs)["securityContext"]
    assert pod_sc["fsGroup"] == pod_sc["runAsGroup"] == 10001
    assert pod_sc["fsGroupChangePolicy"] == "OnRootMismatch"
    # The gateway reads the path as rendered (absolute: not relative to the config's directory).
    f = tmp_path / "gateway.yaml"
    f.write_text(only(docs, "ConfigMap", "-config")["data"]["gateway.yaml"])
    assert load_config(f, env={}).state == cfg["state"]


@pytest.mark.parametrize(
    ("storage_class", "expected"),
    [
        ("", None),  # the cluster's default class
        ("fast", "fast"),
        ("-", ""),  # explicitly no class (helm convention)
    ],
)
def test_state_storage_class(render: Render, storage_class: str, expected: str | None) -> None:
    docs = render({"persistence": {"storageClass": storage_class}})
    assert validate_all(docs) == []
    spec = only(docs, "PersistentVolumeClaim")["spec"]
    if expected is None:
        assert "storageClassName" not in spec
    else:
        assert spec["storageClassName"] == expected


def test_state_claim_settings(render: Render) -> None:
    docs = render({"persistence": {"size": "5Gi", "accessModes": ["ReadWriteOncePod"],
                                   "annotations": {"example.com/owner": "platform"}}})
    assert validate_all(docs) == []
    pvc = only(docs, "PersistentVolumeClaim")
    assert pvc["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep",
                                              "example.com/owner": "platform"}
    assert pvc["spec"]["accessModes"] == ["ReadWriteOncePod"]
    assert pvc["spec"]["resources"]["requests"]["storage"] == "5Gi"


def test_state_on_an_existing_claim(render: Render) -> None:
    docs = render({"persistence": {"existingClaim": "gateway-state"}})
    assert validate_all(docs) == []
    assert "PersistentVolumeClaim" not in kinds(docs)
    assert state_volume(docs) == {
        "name": "state",
        "persistentVolumeClaim": {"claimName": "gateway-state"},
    }
    assert state_mount(docs) == {"name": "state", "mountPath": STATE_DIR}
    assert only(docs, "Deployment")["spec"]["strategy"] == {"type": "Recreate"}


def test_state_without_persistence_is_an_empty_dir(render: Render, notes_chart: Path) -> None:
    values = {"persistence": {"enabled": False, "existingClaim": "ignored"}}
    docs = render(values)
    assert validate_all(docs) == []
    assert "PersistentVolumeClaim" not in kinds(docs)
    assert state_volume(docs) == {"name": "state", "emptyDir": {"sizeLimit": "1Gi"}}
    assert state_mount(docs) == {"name": "state", "mountPath": STATE_DIR}
    assert gateway_config(docs)["state"]["path"] == f"{STATE_DIR}/gateway.db"
    assert only(docs, "Deployment")["spec"]["strategy"] == {"type": "Recreate"}
    notes = only(render(values, chart=notes_chart), "ConfigMap", "notes-probe")["data"]["notes"]
    assert "WARNING: persistence.enabled=false" in notes and "lost whenever the pod" in notes


def test_state_mount_path(render: Render) -> None:
    docs = render({"persistence": {"mountPath": "/data/"}})
    assert state_mount(docs) == {"name": "state", "mountPath": "/data"}
    assert gateway_config(docs)["state"]["path"] == "/data/gateway.db"


@pytest.mark.parametrize(
    ("mount_path", "overlaps"),
    [
        ("/tmp", "/tmp"),
        ("/run/sandbox-gateway", "/run/sandbox-gateway"),
        ("/run", "/run/sandbox-gateway"),
        ("/etc/sandbox-gateway/state", "/etc/sandbox-gateway"),
        ("/git/state", "/git"),
    ],
)
def test_state_mount_path_must_not_overlap_the_charts_mounts(
    helm: str, tmp_path: Path, mount_path: str, overlaps: str
) -> None:
    err = render_fails(helm, tmp_path, {"persistence": {"mountPath": mount_path}})
    assert f"persistence.mountPath ({mount_path}) overlaps {overlaps}" in err


@pytest.mark.parametrize(
    ("values", "store"),
    [
        (REDIS, {"store": "redis", "url": "redis://redis:6379/0"}),
        ({"state": {"store": "memory"}}, {"store": "memory"}),
    ],
)
def test_no_state_volume_without_sqlite(
    render: Render, values: dict[str, Any], store: dict[str, Any]
) -> None:
    docs = render(values, {"persistence": {"enabled": True}})
    assert validate_all(docs) == []
    assert "PersistentVolumeClaim" not in kinds(docs)
    assert state_volume(docs) is None and state_mount(docs) is None
    assert gateway_config(docs)["state"] == store
    # updateStrategy is used as given.
    assert only(docs, "Deployment")["spec"]["strategy"] == {
        "type": "RollingUpdate",
        "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0},
    }


def test_topology_spread_uses_release_labels(render: Render) -> None:
    docs = render()
    pod_labels = only(docs, "Deployment")["spec"]["template"]["metadata"]["labels"]
    tsc = pod_spec(docs)["topologySpreadConstraints"]
    assert {t["topologyKey"] for t in tsc} == {
        "topology.kubernetes.io/zone",
        "kubernetes.io/hostname",
    }
    for t in tsc:
        assert t["labelSelector"]["matchLabels"]["app.kubernetes.io/instance"] == RELEASE
        assert labels_match(t["labelSelector"]["matchLabels"], pod_labels)


# --------------------------------------------------------------------------- schema


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"replicaCount": "two"}, "replicaCount"),
        ({"replicaCunt": 2}, "replicaCunt"),
        ({"ports": {"proxy": 70000, "admin": 8090}}, "proxy"),
        ({"image": {"pullPolicy": "Sometimes"}}, "pullPolicy"),
        ({"policies": {"coding-agent.json": "{}"}}, "coding-agent.json"),
        ({"policies": {"rollOnChange": "yes"}}, "rollOnChange"),
        ({"networkPolicy": {"sandboxNamespaces": "sandboxes"}}, "sandboxNamespaces"),
        ({"secretStore": {"store": "azure-keyvault"}}, "vaultUrl"),
        ({"secretStore": {"store": "vault"}}, "store"),
        ({"workloadIdentity": {"enabled": True}}, "clientId"),
        ({"hpa": {"enabled": "true"}}, "enabled"),
        ({"signing": {"kids": []}}, "kids"),
        ({"config": {"tokens": {"max_ttl": "one day"}}}, "max_ttl"),
        ({"networkPolicy": {"sandboxDNS": "yes"}}, "sandboxDNS"),
        ({"transparent": {"dns": {"containerPort": 53}}}, "containerPort"),
        ({"transparent": {"dns": {"rate": 0}}}, "rate"),
        ({"transparent": {"dns": {"ttl": "soon"}}}, "ttl"),
        ({"transparent": {"dns": {"recurse": True}}}, "recurse"),
        ({"service": {"clusterIP": "gateway"}}, "clusterIP"),
        ({"state": {"store": "sqlite3"}}, "store"),
        ({"persistence": {"enabled": "yes"}}, "enabled"),
        ({"persistence": {"size": "lots"}}, "size"),
        ({"persistence": {"accessModes": ["ReadWriteMany"]}}, "accessModes"),
        ({"persistence": {"mountPath": "state"}}, "mountPath"),
        ({"persistence": {"storageclass": "fast"}}, "storageclass"),
        ({"config": {"limits": {"memory": "lots"}}}, "memory"),
        ({"config": {"limits": {"cpu": 2}}}, "cpu"),
        ({"config": {"console": {"retain": "many"}}}, "retain"),
    ],
)
def test_schema_rejects_bad_values(
    helm: str, tmp_path: Path, values: dict[str, Any], message: str
) -> None:
    err = render_fails(helm, tmp_path, values)
    assert "schema" in err and message in err, err


@pytest.mark.parametrize(
    ("values", "message"),
    [
        ({"gitSync": {"enabled": True}}, "gitSync.repo is required"),
        (
            {"state": {"store": "redis"}},
            "state.redis.url or state.redis.existingSecret is required",
        ),
        ({"secretStore": {"store": "file"}}, "secretStore.fileSecret.name is required"),
    ],
)
def test_template_rejects_incomplete_features(
    helm: str, tmp_path: Path, values: dict[str, Any], message: str
) -> None:
    assert message in render_fails(helm, tmp_path, values)


# --------------------------------------------------------------------------- NOTES.txt


@pytest.fixture
def notes_chart(tmp_path: Path) -> Iterator[Path]:
    """A copy of the chart with a probe template that renders NOTES.txt into a ConfigMap
    (`helm template` drops NOTES, and `helm install --dry-run` needs a cluster)."""
    chart = tmp_path / "chart"
    shutil.copytree(CHART, chart)
    shutil.copy(chart / "templates" / "NOTES.txt", chart / "notes-src.txt")
    (chart / ".helmignore").write_text("")
    (chart / "templates" / "zz-notes-probe.yaml").write_text(
        "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: notes-probe\n"
        'data:\n  notes: {{ tpl (.Files.Get "notes-src.txt") . | toJson }}\n'
    )
    yield chart


def test_notes(render: Render, notes_chart: Path) -> None:
    notes = only(render(chart=notes_chart), "ConfigMap", "notes-probe")["data"]["notes"]
    # No DNS for sandboxes by default: the proxy address is the Service's IP.
    assert (
        f"GATEWAY_IP=$(kubectl -n {NAMESPACE} get svc {RELEASE}-sandbox-gateway "
        "-o jsonpath='{.spec.clusterIP}')" in notes
    )
    assert "HTTPS_PROXY=http://<sandbox-id>:<TOKEN>@$GATEWAY_IP:8080" in notes
    assert "Sandboxes get no DNS" in notes and "dnsPolicy: None" in notes
    assert "WARNING: networkPolicy.sandboxDNS" not in notes
    assert "policy-aware DNS resolver" not in notes  # no transparent mode
    assert f"get secret {RELEASE}-sandbox-gateway-ca -o jsonpath='{{.data.tls\\.crt}}'" in notes
    assert "sandbox-gateway token mint" in notes and "/v1/tokens" in notes
    assert "sandboxNamespaces is empty" in notes
    assert (f"kept in /var/lib/sandbox-gateway/gateway.db on the\nPersistentVolumeClaim "
            f"{RELEASE}-sandbox-gateway-state (kept by `helm uninstall`)") in notes
    assert "WARNING: persistence.enabled" not in notes and "state.store=memory" not in notes
    notes = only(render(ALL_ON, chart=notes_chart), "ConfigMap", "notes-probe")["data"]["notes"]
    assert "get secret gateway-ca" in notes and "sandboxNamespaces is empty" not in notes
    assert "PersistentVolumeClaim" not in notes  # Redis
    assert "jsonpath='{.data.admin-token}'" in notes
    notes = only(render({"state": {"store": "memory"}}, chart=notes_chart),
                 "ConfigMap", "notes-probe")["data"]["notes"]
    assert "WARNING: state.store=memory" in notes


def test_workers_default_to_one_per_pod_and_are_configurable(render: Render) -> None:
    """A pod without a CPU limit sees every node core: the chart runs one worker per pod
    unless told otherwise (scale with replicas/HPA)."""
    assert gateway_config(render())["workers"] == 1
    assert gateway_config(render({"config": {"workers": 4}}))["workers"] == 4


# --------------------------------------------------------------------------- DNS


def sandbox_policies(docs: Docs) -> list[dict[str, Any]]:
    return [d for d in docs
            if d["kind"] == "NetworkPolicy" and d["metadata"]["namespace"] != NAMESPACE]


def egress_ports(policy: dict[str, Any]) -> set[tuple[int, str]]:
    return {(p["port"], p["protocol"]) for rule in policy["spec"]["egress"]
            for p in rule.get("ports", [])}


def peers(policy: dict[str, Any]) -> list[dict[str, Any]]:
    return [peer for rule in policy["spec"]["egress"] for peer in rule.get("to", [])]


def test_default_sandboxes_get_no_dns(render: Render) -> None:
    """Proxy mode (the default): sandboxes reach the proxy port of the gateway pods and
    nothing else; no port 53, no path to kube-dns."""
    docs = render({"networkPolicy": {"sandboxNamespaces": ["sandboxes"]}})
    assert validate_all(docs) == []
    (np,) = sandbox_policies(docs)
    assert egress_ports(np) == {(8080, "TCP")}
    (peer,) = peers(np)
    assert peer["namespaceSelector"]["matchLabels"] == {"kubernetes.io/metadata.name": NAMESPACE}
    assert labels_match(peer["podSelector"]["matchLabels"],
                        only(docs, "Deployment")["spec"]["template"]["metadata"]["labels"])
    assert not any("kube-system" in json.dumps(p) for p in peers(np))
    # The gateway itself still resolves names (its egress to the cluster DNS stays).
    gw_np = next(d for d in docs if d["kind"] == "NetworkPolicy"
                 and d["metadata"]["namespace"] == NAMESPACE)
    assert (53, "UDP") in egress_ports(gw_np)
    # No resolver in the gateway without transparent mode.
    assert gateway_config(docs)["listen"]["dns"] is None
    assert not {"dns", "dns-tcp"} & {p["name"] for p in only(docs, "Service")["spec"]["ports"]}


def test_sandbox_dns_is_an_explicit_opt_in(render: Render, notes_chart: Path) -> None:
    values = {"networkPolicy": {"sandboxNamespaces": ["sandboxes"], "sandboxDNS": True}}
    (np,) = sandbox_policies(render(values))
    assert egress_ports(np) == {(8080, "TCP"), (53, "UDP"), (53, "TCP")}
    assert {"kubernetes.io/metadata.name": "kube-system"} in [
        p.get("namespaceSelector", {}).get("matchLabels") for p in peers(np)]
    notes = only(render(values, chart=notes_chart), "ConfigMap", "notes-probe")["data"]["notes"]
    assert "WARNING: networkPolicy.sandboxDNS=true" in notes and "base32" in notes
    assert (f"HTTPS_PROXY=http://<sandbox-id>:<TOKEN>@{RELEASE}-sandbox-gateway.{NAMESPACE}"
            ".svc:8080") in notes  # with DNS, the Service name works


def test_transparent_mode_gets_the_gateways_resolver(render: Render, notes_chart: Path,
                                                      tmp_path: Path) -> None:
    values = {"networkPolicy": {"sandboxNamespaces": ["sandboxes"]},
              "transparent": {"enabled": True, "dns": {"port": 53, "containerPort": 10053,
                                                        "ttl": "5s", "rate": 8, "burst": 16}},
              "service": {"clusterIP": "10.96.0.53"}}
    docs = render(values)
    assert validate_all(docs) == []
    ports = {(p["name"], p["containerPort"], p["protocol"]) for p in container(docs)["ports"]}
    assert {("dns", 10053, "UDP"), ("dns-tcp", 10053, "TCP")} <= ports
    svc = only(docs, "Service")["spec"]
    assert svc["clusterIP"] == "10.96.0.53"
    assert {(p["name"], p["port"], p["targetPort"], p["protocol"]) for p in svc["ports"]} >= {
        ("dns", 53, "dns", "UDP"), ("dns-tcp", 53, "dns-tcp", "TCP")}
    # Sandboxes: DNS only to the gateway pods (their port, after the Service's translation).
    (np,) = sandbox_policies(docs)
    (rule,) = np["spec"]["egress"]
    assert egress_ports(np) == {(8080, "TCP"), (8081, "TCP"), (10053, "UDP"), (10053, "TCP")}
    assert [p["namespaceSelector"]["matchLabels"] for p in rule["to"]] == [
        {"kubernetes.io/metadata.name": NAMESPACE}]
    assert all(port != 53 for port, _ in egress_ports(np))
    # The gateway lets them in.
    gw_np = next(d for d in docs if d["kind"] == "NetworkPolicy"
                 and d["metadata"]["namespace"] == NAMESPACE)
    assert {(10053, "UDP"), (10053, "TCP")} <= {(p["port"], p["protocol"])
                                               for p in gw_np["spec"]["ingress"][0]["ports"]}
    # The gateway's config, as the gateway reads it.
    f = tmp_path / "gateway.yaml"
    f.write_text(only(docs, "ConfigMap", "-config")["data"]["gateway.yaml"])
    cfg = load_config(f, env={})
    assert str(cfg.listen.dns) == "0.0.0.0:10053"
    assert (cfg.dns.ttl, cfg.dns.rate, cfg.dns.burst) == (5, 8.0, 16)
    notes = only(render(values, chart=notes_chart), "ConfigMap", "notes-probe")["data"]["notes"]
    assert "policy-aware DNS resolver" in notes and 'nameservers: ["10.96.0.53"]' in notes
    assert "GATEWAY_IP=10.96.0.53" in notes


def test_transparent_mode_without_the_resolver(render: Render) -> None:
    docs = render({"networkPolicy": {"sandboxNamespaces": ["sandboxes"]},
                   "transparent": {"enabled": True, "dns": {"enabled": False}}})
    (np,) = sandbox_policies(docs)
    assert egress_ports(np) == {(8080, "TCP"), (8081, "TCP")}
    assert gateway_config(docs)["listen"]["dns"] is None
    assert not {"dns", "dns-tcp"} & {p["name"] for p in container(docs)["ports"]}


def test_graceful_shutdown_wiring(render: Render, helm: str, tmp_path: Path) -> None:
    """A rollout must not cut streams: preStop sleep, then the gateway drains for
    shutdown.drainSeconds, all inside terminationGracePeriodSeconds."""
    docs = render()
    gw = container(docs)
    assert gw["lifecycle"]["preStop"]["exec"]["command"] == ["/bin/sh", "-c", "sleep 5"]
    assert pod_spec(docs)["terminationGracePeriodSeconds"] == 60
    config = yaml.safe_load(only(docs, "ConfigMap", "-config")["data"]["gateway.yaml"])
    assert config["shutdown"] == {"drain": "30s"}
    custom = render({"shutdown": {"drainSeconds": 120, "preStopSleep": 10},
                     "terminationGracePeriodSeconds": 140})
    config = yaml.safe_load(only(custom, "ConfigMap", "-config")["data"]["gateway.yaml"])
    assert config["shutdown"] == {"drain": "120s"}
    err = render_fails(helm, tmp_path, {"shutdown": {"drainSeconds": 60, "preStopSleep": 5},
                                        "terminationGracePeriodSeconds": 60})
    assert "must exceed shutdown.preStopSleep + shutdown.drainSeconds" in err


# ------------------------------------------------------------------------ Kubernetes pod identity

FULLNAME = f"{RELEASE}-sandbox-gateway"
RBAC_KINDS = {"Role", "RoleBinding", "ClusterRole", "ClusterRoleBinding"}
POD_RULES = [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
TOKENREVIEW_RULES = [
    {"apiGroups": ["authentication.k8s.io"], "resources": ["tokenreviews"], "verbs": ["create"]}
]
DISCOVERY_ROLE = "system:service-account-issuer-discovery"


def identity(exchange: dict[str, Any] | None = None, **kube: Any) -> dict[str, Any]:
    """Values turning pod identity on for two sandbox namespaces (keyword arguments override)."""
    values: dict[str, Any] = {
        "enabled": True,
        "namespaces": ["sandboxes-a", "sandboxes-b"],
        **kube,
    }
    if exchange is not None:
        values["exchange"] = exchange
    return {"identity": {"kubernetes": values}}


def rbac(docs: Docs, kind: str | None = None) -> Docs:
    return [d for d in docs if d["kind"] in RBAC_KINDS and kind in (None, d["kind"])]


def assert_bound_to_gateway(binding: dict[str, Any], docs: Docs) -> None:
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": pod_spec(docs)["serviceAccountName"],
         "namespace": NAMESPACE}
    ]
    assert binding["roleRef"]["apiGroup"] == "rbac.authorization.k8s.io"


def assert_chart_labels(doc: dict[str, Any]) -> None:
    labels = doc["metadata"]["labels"]
    assert labels["app.kubernetes.io/instance"] == RELEASE
    assert labels["app.kubernetes.io/managed-by"] == "Helm"
    assert labels["helm.sh/chart"].startswith("sandbox-gateway-")


@pytest.mark.parametrize(
    "values",
    [
        {},
        ALL_ON,
        # The values alone, identity off: nothing.
        {"identity": {"kubernetes": {"enabled": False, "namespaces": ["sandboxes"]}}},
    ],
    ids=["defaults", "all-on", "off-with-namespaces"],
)
def test_identity_off_renders_no_rbac_and_no_token(render: Render, values: dict[str, Any]) -> None:
    docs = render(values)
    assert rbac(docs) == []
    assert "identity" not in gateway_config(docs)
    assert pod_spec(docs)["automountServiceAccountToken"] is False
    assert only(docs, "ServiceAccount")["automountServiceAccountToken"] is False


@pytest.mark.parametrize(
    ("service_account", "subject"),
    [
        ({}, FULLNAME),
        ({"name": "sandbox-gateway-sa"}, "sandbox-gateway-sa"),
        ({"create": False, "name": "preexisting"}, "preexisting"),
    ],
)
def test_identity_watches_pods_in_each_sandbox_namespace_only(
    render: Render, service_account: dict[str, Any], subject: str
) -> None:
    docs = render(DETERMINISTIC, identity(), {"serviceAccount": service_account})
    assert pod_spec(docs)["serviceAccountName"] == subject
    roles, bindings = rbac(docs, "Role"), rbac(docs, "RoleBinding")
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["sandboxes-a", "sandboxes-b"]
    assert sorted(b["metadata"]["namespace"] for b in bindings) == ["sandboxes-a", "sandboxes-b"]
    for role in roles:
        assert role["metadata"]["name"] == f"{FULLNAME}-pod-identity"
        assert role["rules"] == POD_RULES  # get, list, watch on pods: nothing more
        assert_chart_labels(role)
    for binding in bindings:
        assert binding["metadata"]["name"] == f"{FULLNAME}-pod-identity"
        assert binding["roleRef"] == {
            "apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
            "name": f"{FULLNAME}-pod-identity"}
        assert_bound_to_gateway(binding, docs)
        assert binding["subjects"][0]["name"] == subject
        assert_chart_labels(binding)
    # The gateway pod mounts its token; the ServiceAccount does not hand it to anyone else.
    assert pod_spec(docs)["automountServiceAccountToken"] is True
    if service_account.get("create", True):
        assert only(docs, "ServiceAccount")["automountServiceAccountToken"] is False
    else:
        assert "ServiceAccount" not in kinds(docs)


@pytest.mark.parametrize(
    ("exchange", "cluster_roles", "cluster_bindings"),
    [
        ({}, {f"{FULLNAME}-{NAMESPACE}-tokenreview": TOKENREVIEW_RULES},
         {f"{FULLNAME}-{NAMESPACE}-tokenreview": ("ClusterRole",
                                                  f"{FULLNAME}-{NAMESPACE}-tokenreview")}),
        ({"verify": "tokenreview"}, {f"{FULLNAME}-{NAMESPACE}-tokenreview": TOKENREVIEW_RULES},
         {f"{FULLNAME}-{NAMESPACE}-tokenreview": ("ClusterRole",
                                                  f"{FULLNAME}-{NAMESPACE}-tokenreview")}),
        ({"verify": "oidc", "issuer": "https://oidc.example.test/cluster"}, {},
         {f"{FULLNAME}-{NAMESPACE}-issuer-discovery": ("ClusterRole", DISCOVERY_ROLE)}),
        ({"enabled": False}, {}, {}),
        ({"enabled": False, "verify": "oidc"}, {}, {}),
    ],
    ids=["default-tokenreview", "tokenreview", "oidc", "exchange-off", "exchange-off-oidc"],
)
def test_identity_cluster_rbac_follows_the_exchange_mode(
    render: Render,
    exchange: dict[str, Any],
    cluster_roles: dict[str, Any],
    cluster_bindings: dict[str, tuple[str, str]],
) -> None:
    docs = render(DETERMINISTIC, identity(exchange=exchange))
    assert validate_all(docs) == []
    roles = rbac(docs, "ClusterRole")
    assert {r["metadata"]["name"]: r["rules"] for r in roles} == cluster_roles
    bindings = rbac(docs, "ClusterRoleBinding")
    assert {
        b["metadata"]["name"]: (b["roleRef"]["kind"], b["roleRef"]["name"]) for b in bindings
    } == cluster_bindings
    for doc in roles + bindings:
        assert "namespace" not in doc["metadata"]  # cluster-scoped
        assert_chart_labels(doc)
    for binding in bindings:
        assert_bound_to_gateway(binding, docs)
    # Never more than the pods of the sandbox namespaces, whatever the mode.
    assert len(rbac(docs, "Role")) == len(rbac(docs, "RoleBinding")) == 2


def test_identity_config_is_rendered_as_the_gateway_reads_it(render: Render) -> None:
    values = identity(
        namespaces=["sandboxes", "batch"],
        policy_label="example.com/egress-policy",
        default_policies={"sandboxes": "default", "batch": "coding-agent"},
        pod_selector="role=sandbox",
        stale_after="45s",
        kubeconfig="/etc/kube/config",
        exchange={"audience": "gw.example.test", "verify": "oidc",
                  "issuer": "https://oidc.example.test/cluster", "ttl": "30m"},
    )
    assert gateway_config(render(DETERMINISTIC, values))["identity"] == {
        "kubernetes": {
            "enabled": True,
            "kubeconfig": "/etc/kube/config",
            "namespaces": ["sandboxes", "batch"],
            "policy_label": "example.com/egress-policy",
            "default_policies": {"sandboxes": "default", "batch": "coding-agent"},
            "pod_selector": "role=sandbox",
            "stale_after": "45s",
            "exchange": {
                "enabled": True,
                "audience": "gw.example.test",
                "verify": "oidc",
                "issuer": "https://oidc.example.test/cluster",
                "ttl": "30m",
            },
        }
    }
    # The defaults: in-cluster config, the API server's own issuer.
    assert gateway_config(render(DETERMINISTIC, identity(namespaces=["sandboxes"])))[
        "identity"
    ] == {
        "kubernetes": {
            "enabled": True,
            "kubeconfig": None,
            "namespaces": ["sandboxes"],
            "policy_label": "sandbox-gateway.io/policy",
            "default_policies": {},
            "pod_selector": "",
            "stale_after": "30s",
            "exchange": {
                "enabled": True,
                "audience": "sandbox-gateway",
                "verify": "tokenreview",
                "issuer": None,
                "ttl": "1h",
            },
        }
    }


def test_identity_config_loads_in_the_gateway(render: Render, tmp_path: Path) -> None:
    """The rendered gateway.yaml, read by the gateway's own loader (every key known)."""
    docs = render(DETERMINISTIC, identity(namespaces=["sandboxes", "batch"],
                                          default_policies={"batch": "coding-agent"},
                                          exchange={"verify": "oidc", "ttl": "30m"}))
    f = tmp_path / "gateway.yaml"
    f.write_text(only(docs, "ConfigMap", "-config")["data"]["gateway.yaml"])
    k8s = load_config(f, env={}).identity.kubernetes
    assert (k8s.enabled, k8s.namespaces, k8s.kubeconfig) == (True, ("sandboxes", "batch"), None)
    assert dict(k8s.default_policies) == {"batch": "coding-agent"}
    assert (k8s.exchange.verify, k8s.exchange.ttl, k8s.exchange.issuer) == ("oidc", 1800.0, None)


def test_identity_changes_roll_the_pods(render: Render) -> None:
    before = pod_annotations(render(DETERMINISTIC))["checksum/config"]
    after = pod_annotations(render(DETERMINISTIC, identity()))["checksum/config"]
    assert before != after


def test_identity_leaves_the_network_policies_alone(render: Render) -> None:
    sandboxes = {"networkPolicy": {"sandboxNamespaces": ["sandboxes-a", "sandboxes-b"]}}

    def policies(*values: dict[str, Any]) -> Docs:
        docs = render(DETERMINISTIC, sandboxes, *values)
        return [d for d in docs if d["kind"] == "NetworkPolicy"]

    assert policies(identity()) == policies()
    assert policies(identity(exchange={"verify": "oidc"})) == policies()


@pytest.mark.parametrize(
    ("values", "api_versions"),
    [
        (identity(), ()),
        (identity(exchange={"verify": "oidc"}), ()),
        (identity(exchange={"enabled": False}), ()),
        ({**ALL_ON, **identity()}, ("--api-versions", "monitoring.coreos.com/v1")),
    ],
    ids=["tokenreview", "oidc", "exchange-off", "all-on"],
)
def test_identity_render_is_valid(
    render: Render, values: dict[str, Any], api_versions: tuple[str, ...]
) -> None:
    docs = render(values, args=api_versions)
    assert validate_all(docs) == (["ServiceMonitor"] if api_versions else [])
    assert all(
        d["metadata"].get("namespace") in (NAMESPACE, "sandboxes-a", "sandboxes-b")
        for d in docs if d["kind"] not in ("ClusterRole", "ClusterRoleBinding")
    )


def test_identity_lint_strict(helm: str, tmp_path: Path) -> None:
    f = tmp_path / "identity.yaml"
    f.write_text(yaml.safe_dump({**ALL_ON, **identity(exchange={"verify": "oidc"})}))
    out = run_helm(helm, "lint", "--strict", str(CHART), "-f", str(f)).stdout
    assert "0 chart(s) failed" in out
    assert "[WARNING]" not in out and "[ERROR]" not in out


@pytest.mark.parametrize(
    "kube",
    [
        {"enabled": True},
        {"enabled": True, "namespaces": []},
    ],
    ids=["unset", "empty"],
)
def test_identity_needs_namespaces(helm: str, tmp_path: Path, kube: dict[str, Any]) -> None:
    values = {"identity": {"kubernetes": kube}}
    # The schema refuses it ...
    err = render_fails(helm, tmp_path, values)
    assert "schema" in err and "namespaces" in err, err
    # ... and so does the template, for installs that skip the schema.
    f = tmp_path / "no-namespaces.yaml"
    f.write_text(yaml.safe_dump(values))
    proc = run_helm(helm, "template", RELEASE, str(CHART), "-f", str(f),
                    "--skip-schema-validation", check=False)
    assert proc.returncode != 0
    assert "identity.kubernetes.namespaces is required when identity.kubernetes.enabled" in (
        proc.stderr)


@pytest.mark.parametrize(
    ("kube", "message"),
    [
        ({"enabled": "yes"}, "enabled"),
        ({"namespaces": "sandboxes"}, "namespaces"),
        ({"namespaces": ["Sandboxes"]}, "namespaces"),
        ({"namespaces": ["sandboxes", "sandboxes"]}, "namespaces"),
        ({"policy_label": "not a label"}, "policy_label"),
        ({"default_policies": {"sandboxes": 3}}, "default_policies"),
        ({"stale_after": "soon"}, "stale_after"),
        ({"exchange": {"verify": "jwks"}}, "verify"),
        ({"exchange": {"audience": ""}}, "audience"),
        ({"exchange": {"issuer": "http://kubernetes.default.svc"}}, "issuer"),
        ({"exchange": {"ttl": "a while"}}, "ttl"),
        ({"namespace": ["sandboxes"]}, "namespace"),
        ({"exchange": {"verfy": "oidc"}}, "verfy"),
    ],
)
def test_identity_schema_rejects_bad_values(
    helm: str, tmp_path: Path, kube: dict[str, Any], message: str
) -> None:
    err = render_fails(helm, tmp_path, {"identity": {"kubernetes": kube}})
    assert "schema" in err and message in err, err


def test_identity_notes(render: Render, notes_chart: Path) -> None:
    def notes(*values: dict[str, Any]) -> str:
        rendered = only(render(*values, chart=notes_chart), "ConfigMap", "notes-probe")
        return str(rendered["data"]["notes"])

    assert "pod identity" not in notes()
    text = notes(identity())
    assert "Kubernetes pod identity is on for the pods of sandboxes-a, sandboxes-b" in text
    assert "sandbox-gateway.io/policy=<policy>" in text
    assert "sandbox-gateway token exchange" in text
    assert ("the Kubernetes API (identity.kubernetes): only through the internet rule, if its "
            "endpoint is a public address") in text
    assert "networkPolicy.gateway.egressTo.kubernetesApi" in text
    text = notes(identity(exchange={"enabled": False}), {"networkPolicy": {"enabled": False}})
    assert "pod identity is on" in text
    assert "token exchange" not in text and "egressTo" not in text


# ------------------------------------------------------------------ the gateway's dependencies

SANDBOXES = {"networkPolicy": {"sandboxNamespaces": ["sandboxes"]}}
NOINTERNET = {"networkPolicy": {"gateway": {"allowInternet": False}}}
KV = {"secretStore": {"store": "azure-keyvault", "vaultUrl": "https://kv.vault.azure.net"}}


def _ns(name: str) -> dict[str, Any]:
    return {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": name}},
            "podSelector": {}}


def _ip(cidr: str) -> dict[str, Any]:
    return {"ipBlock": {"cidr": cidr}}


def _redis(url: str) -> dict[str, Any]:
    return {"state": {"store": "redis", "redis": {"url": url}}}


def _proxy(url: str) -> dict[str, Any]:
    return {"config": {"network": {"upstream_proxy": {"url": url}}}}


GIVEN = [{"to": [_ip("10.40.0.9/32")], "ports": [{"port": 6380, "protocol": "TCP"}]}]

# (name, values, the egress rules added for the dependencies, what NOTES says was opened)
DEPENDENCIES: list[tuple[str, dict[str, Any], list[dict[str, Any]], str]] = [
    ("redis as a Service of another namespace",
     _redis("redis://redis-master.data.svc.cluster.local:6380/0"),
     [{"to": [_ns("data")], "ports": [{"port": 6380, "protocol": "TCP"}]}],
     "Redis (state.store: redis): TCP redis-master.data.svc.cluster.local:6380 (the pods of "
     "namespace data), from state.redis.url"),
    ("redis as a Service of the release's namespace", _redis("redis://redis/0"),
     [{"to": [_ns(NAMESPACE)], "ports": [{"port": 6379, "protocol": "TCP"}]}],
     f"Redis (state.store: redis): TCP redis:6379 (the pods of namespace {NAMESPACE})"),
    ("redis at an address", _redis("rediss://10.1.2.3:6380"),
     [{"to": [_ip("10.1.2.3/32")], "ports": [{"port": 6380, "protocol": "TCP"}]}],
     "Redis (state.store: redis): TCP 10.1.2.3:6380, from state.redis.url"),
    ("redis in a Secret, its rules given",
     {"state": {"store": "redis", "redis": {"existingSecret": "redis-url"}},
      "networkPolicy": {"gateway": {"egressTo": {"redis": GIVEN}}}},
     GIVEN, "Redis (state.store: redis): the rules of networkPolicy.gateway.egressTo.redis"),
    ("redis on a public name, through the internet rule", _redis("rediss://cache.example.com"),
     [], "Redis (state.store: redis): cache.example.com only through the internet rule"),
    ("an upstream proxy at an address", _proxy("http://10.9.8.7:3128"),
     [{"to": [_ip("10.9.8.7/32")], "ports": [{"port": 3128, "protocol": "TCP"}]}],
     "the upstream proxy (config.network.upstream_proxy): TCP 10.9.8.7:3128, from its url"),
    ("an upstream proxy as a Service", _proxy("socks5://squid.proxy.svc"),
     [{"to": [_ns("proxy")], "ports": [{"port": 1080, "protocol": "TCP"}]}],
     "the upstream proxy (config.network.upstream_proxy): TCP squid.proxy.svc:1080"),
    ("a Key Vault private endpoint",
     {**KV, "networkPolicy": {"gateway": {"egressTo": {"keyVault": GIVEN}}}}, GIVEN,
     "Key Vault https://kv.vault.azure.net (a private endpoint): the rules of "
     "networkPolicy.gateway.egressTo.keyVault"),
    ("a Key Vault through the internet rule", KV, [],
     "Key Vault https://kv.vault.azure.net and Entra ID sign-in: through the internet rule"),
    ("the Kubernetes API, its endpoints given",
     {**identity(), "networkPolicy": {"gateway": {"egressTo": {"kubernetesApi": GIVEN}}}},
     GIVEN, "the Kubernetes API (identity.kubernetes): the rules of "
            "networkPolicy.gateway.egressTo.kubernetesApi"),
]


def _merged(*values: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for v in values:
        for key, value in v.items():
            if isinstance(value, dict) and isinstance(out.get(key), dict):
                out[key] = _merged(out[key], value)
            else:
                out[key] = value
    return out


@pytest.mark.parametrize(("name", "values", "rules", "said"), DEPENDENCIES,
                         ids=[d[0] for d in DEPENDENCIES])
def test_the_gateway_policy_opens_its_dependencies(
        render: Render, notes_chart: Path, name: str, values: dict[str, Any],
        rules: list[dict[str, Any]], said: str) -> None:
    """Issue 42, item 5: with Redis, an upstream proxy, a Key Vault private endpoint or the
    Kubernetes API, the gateway's NetworkPolicy allows that destination, derived from the
    values (or given in networkPolicy.gateway.egressTo), and NOTES says what was opened.
    The rules come right after the DNS and internet rules, before extraEgress."""
    docs = render(DETERMINISTIC, _merged(SANDBOXES, values))
    validate_all(docs)
    egress = only(docs, "NetworkPolicy", "sandbox-gateway")["spec"]["egress"]
    fixed = 2  # the cluster DNS, the internet
    assert egress[fixed:] == rules, egress
    notes = only(render(DETERMINISTIC, _merged(SANDBOXES, values), chart=notes_chart),
                 "ConfigMap", "notes-probe")["data"]["notes"]
    assert "The gateway's NetworkPolicy lets it reach its own dependencies" in notes
    assert said in " ".join(notes.split()), notes


def test_no_dependency_no_extra_rule(render: Render, notes_chart: Path) -> None:
    egress = only(render(DETERMINISTIC, SANDBOXES), "NetworkPolicy",
                  "sandbox-gateway")["spec"]["egress"]
    assert len(egress) == 2
    notes = only(render(DETERMINISTIC, SANDBOXES, chart=notes_chart), "ConfigMap",
                 "notes-probe")["data"]["notes"]
    assert "its own dependencies" not in notes


# (values, what the refusal must say)
UNREACHABLE: list[tuple[dict[str, Any], str]] = [
    ({"state": {"store": "redis", "redis": {"existingSecret": "redis-url"}}},
     "state.store: redis: the gateway's NetworkPolicy cannot tell where Redis is (the URL is "
     "in state.redis.existingSecret), so the gateway could not reach it. Set "
     "networkPolicy.gateway.egressTo.redis"),
    (_merged(_redis("redis://cache.example.com:6379"), NOINTERNET),
     "(cache.example.com:6379 is not an IPv4 address or a <service>.<namespace>.svc name, and "
     "networkPolicy.gateway.allowInternet is off)"),
    ({"config": {"network": {"upstream_proxy": "env"}}},
     "config.network.upstream_proxy: the gateway's NetworkPolicy cannot tell where the proxy "
     "is (the pod's HTTPS_PROXY (upstream_proxy: env) is not"),
    (_proxy("http://proxy.corp:3128"),
     "(proxy.corp:3128 is not an IPv4 address or a <service>.<namespace>.svc name), and every "
     "upstream dial goes through it. Set networkPolicy.gateway.egressTo.upstreamProxy"),
    (_merged(KV, NOINTERNET), "secretStore.store: azure-keyvault with "
     "networkPolicy.gateway.allowInternet off: the gateway could not reach the Key Vault"),
    (_merged(identity(), NOINTERNET), "identity.kubernetes.enabled with "
     "networkPolicy.gateway.allowInternet off: the gateway could not reach the Kubernetes API"),
]


@pytest.mark.parametrize(("values", "message"), UNREACHABLE,
                         ids=["redis-secret", "redis-name", "proxy-env", "proxy-name",
                              "keyvault", "kubernetes-api"])
def test_a_dependency_the_policy_cannot_open_fails_the_render(
        helm: str, tmp_path: Path, values: dict[str, Any], message: str) -> None:
    assert message in " ".join(render_fails(helm, tmp_path, values).split())
    # (without the chart's NetworkPolicy there is nothing to open)
    f = tmp_path / "off.yaml"
    f.write_text(yaml.safe_dump(_merged(values, {"networkPolicy": {"enabled": False}})))
    run_helm(helm, "template", RELEASE, str(CHART), "-f", str(f))
