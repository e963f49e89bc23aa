"""pyproject.toml allows exactly the dependency versions gateway/engines/patches.py was
checked against: a plain `pip install` must resolve versions the gateway starts with
(patches.check_versions refuses any other at start)."""

from __future__ import annotations

import ast
import tomllib
from importlib.metadata import version
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from gateway.engines import patches

REPO = Path(__file__).resolve().parents[2]


def _requirements() -> dict[str, Requirement]:
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    reqs = [Requirement(r) for r in data["project"]["dependencies"]]
    return {canonicalize_name(r.name): r for r in reqs}


def _range(prefix: str) -> set[str]:
    """`12.2.` -> {">=12.2", "<12.3"}: the versions starting with the prefix."""
    parts = prefix.rstrip(".").split(".")
    upper = [*parts[:-1], str(int(parts[-1]) + 1)]
    return {f">={'.'.join(parts)}", f"<{'.'.join(upper)}"}


@pytest.mark.parametrize("package", sorted(patches.CHECKED))
def test_pyproject_range_is_what_patches_accept(package: str) -> None:
    prefixes = patches.CHECKED[package]
    assert len(prefixes) == 1, "one contiguous range per package (pyproject cannot say more)"
    req = _requirements().get(canonicalize_name(package))
    assert req is not None, f"{package} is patched but not a direct dependency in pyproject"
    assert {str(s) for s in req.specifier} == _range(prefixes[0]), (
        f"pyproject.toml has {package}{req.specifier}; patches.CHECKED accepts "
        f"{prefixes[0]}x: make them equal")


@pytest.mark.parametrize(("package", "accepted", "refused"), [
    ("mitmproxy", ["12.2.0", "12.2.3", "12.2.99"], ["12.1.9", "12.3.0", "12.3.1", "13.0"]),
    ("h11", ["0.16.0", "0.16.5"], ["0.15.0", "0.17.0", "1.0"]),
])
def test_the_range_refuses_what_check_versions_refuses(
        package: str, accepted: list[str], refused: list[str]) -> None:
    spec = _requirements()[package].specifier
    prefixes = patches.CHECKED[package]
    for text in accepted + refused:
        assert spec.contains(Version(text)) == text.startswith(prefixes), (package, text)
    assert all(spec.contains(Version(v)) for v in accepted)


def test_the_installed_versions_start() -> None:
    patches.check_versions()  # raises when the environment holds a refused version
    for package, prefixes in patches.CHECKED.items():
        assert version(package).startswith(prefixes)


# What only patches.py may touch: private modules and internals of h11 and mitmproxy.
PRIVATE = ("h11._", "mitmproxy.proxy.layers.http._", "mitmproxy.proxy.layers.tls",
           "mitmproxy.net.tls", "mitmproxy.platform", "mitmproxy.addons.next_layer",
           "mitmproxy.proxy.mode_servers", "mitmproxy.proxy.server")
PRIVATE_NAMES = ("parse_client_hello", "starts_like_tls_record", "original_addr",
                 "maybe_read_from_IDLE_client", "ReceiveBuffer")


def _private(module: str) -> bool:
    """`module` is private: under a `_`-prefix of PRIVATE, or one of its modules."""
    return any(module.startswith(p) if p.endswith("_") else
               module == p or module.startswith(p + ".") for p in PRIVATE)


def test_private_apis_are_used_in_patches_only() -> None:
    """Every private API of h11 and mitmproxy is reached through patches.py, which checks
    the versions it was written against; `.data.` of a mitmproxy request (its raw,
    internal fields) likewise."""
    found = []
    for path in sorted((REPO / "gateway").rglob("*.py")):
        if path.name == "patches.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            modules: list[str] = []
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                modules = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
                found += [f"{path.name}: {a.name}" for a in node.names
                          if a.name in PRIVATE_NAMES and node.module != "gateway.engines.patches"]
            found += [f"{path.name}: {m}" for m in modules if _private(m)]
            if (isinstance(node, ast.Attribute) and node.attr in ("method", "authority")
                    and isinstance(node.value, ast.Attribute) and node.value.attr == "data"):
                found.append(f"{path.name}: {ast.unparse(node)}")
    assert found == []


@pytest.mark.parametrize(("head", "host"), [
    (b"CONNECT a.test:443 HTTP/1.1\r\nHost: a.test:443\r\n\r\n", b"a.test:443"),
    (b"CONNECT a.test:443 HTTP/1.1\r\n\r\n", b"a.test:443"),  # (read as Host: the target)
    (b"CONNECT a.test:443 HTTP/1.0\r\n\r\n", None),
    (b"GET / HTTP/1.1\r\nHost: b.test\r\n\r\n", b"b.test"),
])
def test_parse_request_head(head: bytes, host: bytes | None) -> None:
    request = patches.parse_request_head(head)
    assert next((v for k, v in request.fields if k.lower() == b"host"), None) == host


@pytest.mark.parametrize("head", [
    b"GET / HTTP/1.1\r\n\r\n",  # Host is only implied for CONNECT
    b"CONNECT a.test:443 HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n",
    b"CONNECT a.test:443 HTTP/1.1\r\nX : y\r\n\r\n",
    b"CONNECT a.test:443 HTTP/1.1\r\n",  # incomplete
])
def test_parse_request_head_refuses(head: bytes) -> None:
    with pytest.raises(ValueError):
        patches.parse_request_head(head)


# -- mitmproxy's internals stay in patches.py (issue 41 item 4) --------------------------

_MITMPROXY_CORE = ("mitmproxy.proxy.layer", "mitmproxy.proxy.layers", "mitmproxy.proxy.commands",
                   "mitmproxy.proxy.events", "mitmproxy.proxy.context",
                   "mitmproxy.proxy.server", "mitmproxy.proxy.tunnel")


def test_only_patches_imports_mitmproxys_proxy_core() -> None:
    """The adapter uses mitmproxy's addon API (flows, hook data); its layers, commands
    and events, which it subclasses or matches, are read in patches.py alone."""
    root = Path(__file__).resolve().parents[2] / "gateway"
    offenders = []
    for module in root.rglob("*.py"):
        if module.name == "patches.py":
            continue
        for node in ast.walk(ast.parse(module.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{module.relative_to(root)}: {n}" for n in names
                          if n.startswith(_MITMPROXY_CORE)]
    assert offenders == []


@pytest.mark.parametrize(("message", "responded", "ended", "side", "kind", "detail"), [
    (patches.TRAILERS_UNSUPPORTED, False, True, "client", "trailers", ""),
    ("Client disconnected.", False, True, "client", "client", ""),
    ("Client disconnected.", True, True, "client", "client", ""),  # (after the head)
    ("stream reset by client (CANCEL)", True, True, "client", "client", ""),
    ("HTTP/1 protocol error: bad chunk size", False, False, "client", "bad_request", ""),
    ("Connection closed by peer", True, True, "server", "answered", ""),
    ("HTTP/1 protocol error: bad chunk size", False, False, None, "bad_request", ""),
    ("HTTP/1 protocol error: bad chunk size", False, True, "server", "connect",
     "HTTP/1 protocol error: bad chunk size"),  # (the request was whole: the upstream's)
    ("MARK the proxy answered 407", False, True, None, "upstream_proxy",
     " the proxy answered 407"),
    ("Connection closed by peer", False, True, "server", "closed", "Connection closed by peer"),
    ("[Errno 111] Connect call failed", False, True, None, "connect",
     "[Errno 111] Connect call failed"),
    ("Connection closed by peer", True, True, None, "answered", ""),
])
def test_a_flows_error_is_read_once_into_a_typed_outcome(
        message: str, responded: bool, ended: bool, side: str | None, kind: str,
        detail: str) -> None:
    found = patches.flow_error(message, responded=responded, request_ended=ended,
                               proxy_mark="MARK", side=side)
    assert (found.kind, found.detail) == (kind, detail)


@pytest.mark.parametrize("package", ["h11", "mitmproxy"])
def test_the_version_check_reads_what_the_distribution_says(package: str) -> None:
    # (check_versions reads these two from the packages, not from importlib.metadata)
    assert patches._installed(package) == version(package)


def test_aiohttp_is_checked_only_where_its_hook_is_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(patches.CHECKED, "aiohttp", ("0.0.",))  # (what is installed is refused)
    patches.check_versions(aiohttp=False)
    with pytest.raises(RuntimeError, match="aiohttp"):
        patches.check_versions()


def test_the_error_side_hooks_wrap_what_mitmproxy_has() -> None:
    """`install_error_sides` wraps two generator methods of mitmproxy's HTTP stream (and
    reads its queue of events held while a hook runs); a version that renamed or changed
    them would leave every client's leaving audited as an upstream failure."""
    import inspect

    patches.load_engine()
    from mitmproxy.proxy.layers.http import HttpStream

    patches.install_error_sides()
    patches.install_error_sides()  # (twice: still wraps mitmproxy's own, once)
    for name, key, params in (("handle_protocol_error", "handle", ["self", "event"]),
                              ("check_killed", "killed", ["self", "emit_error_hook"])):
        original = patches._error_side[key]
        assert inspect.isgeneratorfunction(original), name
        assert list(inspect.signature(original).parameters) == params, name
        assert getattr(HttpStream, name) is not original
    assert "self._paused_event_queue" in inspect.getsource(patches._error_side["killed"])
