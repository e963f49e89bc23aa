"""The detector library: exactly the catalogue's names, every detect-secrets plugin used
or deliberately left out, each pattern taken from the plugin (not copied), and the
prefilter's anchors losing nothing against a full regular-expression pass."""

from __future__ import annotations

import importlib
import inspect
import json
import pkgutil
from dataclasses import replace

import detect_secrets.plugins
import pytest
from detect_secrets.plugins.base import BasePlugin, RegexBasedDetector
from helpers.dlp_corpus import CORPUS, Fake

from gateway.core.dlp import DEFAULT, DETECTORS, OPT_IN, Detector, Location, Scanner
from gateway.services.dlp import plugins as ours
from gateway.services.dlp.library import PLUGINS, build, cases

LEFT_OUT = {"IPPublicDetector"}  # a public IP address is not a credential


def _shipped() -> set[type[BasePlugin]]:
    found = set()
    for info in pkgutil.iter_modules(detect_secrets.plugins.__path__):
        module = importlib.import_module(f"detect_secrets.plugins.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if issubclass(cls, BasePlugin) and not inspect.isabstract(cls) \
                    and cls.__module__ == module.__name__:
                found.add(cls)
    return found


def test_the_library_builds_the_catalogue() -> None:
    assert set(PLUGINS) == set(DETECTORS)
    assert [d.name for d in build(DETECTORS)] == list(DETECTORS)
    assert set(DEFAULT) | OPT_IN == set(DETECTORS) and not set(DEFAULT) & OPT_IN
    with pytest.raises(KeyError):
        build(["nope"])


def test_every_shipped_plugin_is_used_or_left_out_on_purpose() -> None:
    used = {cls for entries in PLUGINS.values() for cls, _ in entries}
    shipped = _shipped()
    assert {c.__name__ for c in shipped - used} == LEFT_OUT
    assert {c for c in used if c.__module__ == ours.__name__} == {
        c for _, c in inspect.getmembers(ours, inspect.isclass)
        if issubclass(c, RegexBasedDetector) and c is not RegexBasedDetector}


def test_patterns_are_the_plugins_own() -> None:
    for detector in build(DETECTORS):
        patterns = [r.pattern for r in detector.rules if r.pattern is not None]
        plugin_patterns = [p for cls, _ in PLUGINS[detector.name]
                           if issubclass(cls, RegexBasedDetector) for p in cls.denylist]
        assert patterns == plugin_patterns  # the same compiled objects


def test_case_variants() -> None:
    assert set(cases("aws")) == {"aws", "awS", "aWs", "aWS", "Aws", "AwS", "AWs", "AWS"}
    assert cases("a-1") == ("a-1", "A-1")


def _unanchored(detectors: tuple[Detector, ...]) -> tuple[Detector, ...]:
    return tuple(Detector(d.name, tuple(replace(r, anchors=()) for r in d.rules))
                 for d in detectors)


@pytest.mark.parametrize("fake", CORPUS, ids=lambda f: f.detector)
def test_the_prefilter_loses_nothing_against_a_full_pass(fake: Fake) -> None:
    """Every anchored rule run over the whole text (no prefilter) finds what the
    prefiltered scan finds, in the fake's text and in text around it."""
    detectors = build(DETECTORS)
    fast = Scanner(detectors, b"s")
    full = Scanner(_unanchored(detectors), b"s")
    for text in (fake.text, f"prefix {fake.text} suffix", f'{{"k": "{fake.text}"}}'):
        where = Location("body", offset=0)
        got = {(f.detector, f.fingerprint) for f in fast.scan_text(text, where)}
        want = {(f.detector, f.fingerprint) for f in full.scan_text(text, where)}
        assert got == want, (text[:40], got ^ want)


@pytest.mark.parametrize("fake", CORPUS, ids=lambda f: f.detector)
def test_the_fallback_prefilter_finds_the_same(fake: Fake) -> None:
    """The automaton (where there is no Hyperscan wheel) finds what Hyperscan finds."""
    detectors = build(DETECTORS)
    fast, slow = Scanner(detectors, b"s"), Scanner(detectors, b"s", fast=False)
    for text in (fake.text, f"prefix {fake.text} suffix", f'{{"k": "{fake.text}"}}'):
        body = text.encode()
        assert slow.scan_body(body) == fast.scan_body(body)
        assert slow.scan_body(body, "application/json") == fast.scan_body(body,
                                                                          "application/json")


def _pem_body() -> str:
    return "\n".join(["MIIEvQIBADANBgkqhkiG9w0BAQEFAASCBKcwggSjAgEAAoIBAQC7" + "a" * 12] * 4)


@pytest.mark.parametrize(("text", "found"), [
    (f"-----BEGIN RSA PRIVATE KEY-----\n{_pem_body()}\n-----END RSA PRIVATE KEY-----", True),
    (f"-----BEGIN OPENSSH PRIVATE KEY-----\n{_pem_body()}\n", True),  # cut short, no END
    ("-----BEGIN RSA PRIVATE KEY-----\nProc-Type: 4,ENCRYPTED\nDEK-Info: AES-128-CBC,00FF\n\n"
     f"{_pem_body()}\n-----END RSA PRIVATE KEY-----", True),
    ("PuTTY-User-Key-File-2: ssh-rsa\nEncryption: none\nComment: k\nPublic-Lines: 4\n"
     f"{_pem_body()}\nPrivate-Lines: 4\n{_pem_body()}\nPrivate-MAC: 0a1b2c", True),
    # code that reads keys holds the header, not a key
    ('if line.startswith("-----BEGIN RSA PRIVATE KEY-----"):\n    return parse_pem(line)\n'
     'elif line.startswith("-----END RSA PRIVATE KEY-----"):\n    done = True', False),
    ('HEADERS = ("BEGIN PRIVATE KEY", "BEGIN EC PRIVATE KEY", "BEGIN DSA PRIVATE KEY")', False),
    ("-----BEGIN PRIVATE KEY-----\n...\n-----END PRIVATE KEY-----", False),
])
def test_a_private_key_needs_key_material(text: str, found: bool) -> None:
    scanner = Scanner(build(["private-key"]), b"s")
    for carrier in (text, json.dumps({"k": text})):
        hits = scanner.scan_text(carrier, Location("body", offset=0))
        assert bool(hits) is found, carrier[:60]
