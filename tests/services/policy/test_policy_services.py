"""Service presets (`extends: [service/github-read]`): each shipped file loads, and each
allows its service's real protocol shapes and nothing of the writes it leaves out."""

from __future__ import annotations

import pytest

from gateway.core.evaluate import request_for
from gateway.core.policy import decide
from gateway.services.policy import PolicyError, load_policy_text
from gateway.services.policy.agents import known_services


def _decide(preset: str, method: str, url: str) -> str:
    text = f"version: v1\nname: p\nextends: [{preset}]\n"
    policy = load_policy_text("p.yaml", text).policies["p"]
    return decide(policy, request_for(method, url)).result


def test_every_shipped_preset_loads() -> None:
    assert len(known_services()) >= 12
    for name in known_services():
        policy_set = load_policy_text("p.yaml", f"version: v1\nname: p\nextends: [{name}]\n")
        assert policy_set.policies["p"].rules, name
        assert all(r.source.startswith(name + ".yaml:") for r in policy_set.policies["p"].rules)


def test_unknown_service_lists_the_shipped_ones() -> None:
    with pytest.raises(PolicyError) as err:
        load_policy_text("p.yaml", "version: v1\nname: p\nextends: [service/gitub-read]\n")
    assert "the shipped service presets are" in str(err.value)
    assert "service/github-read" in str(err.value)


def test_a_user_policy_cannot_take_a_service_name() -> None:
    with pytest.raises(PolicyError):
        load_policy_text("p.yaml", "version: v1\nname: service/pypi\negress: []\n")


GH = "https://github.com/octo/hello.git"
TABLE = [
    # git smart HTTP: a clone is a GET of info/refs and a POST of git-upload-pack
    ("service/github-read", "GET", f"{GH}/info/refs?service=git-upload-pack", "allow"),
    ("service/github-read", "POST", f"{GH}/git-upload-pack", "allow"),
    ("service/github-read", "POST", f"{GH}/info/lfs/objects/batch", "allow"),
    ("service/github-read", "POST", f"{GH}/git-receive-pack", "deny"),
    ("service/github-read", "POST", f"{GH}/info/lfs/locks/verify", "deny"),
    ("service/github-read", "GET", "https://github.com/octo/hello/releases/download/v1/a.tgz",
     "allow"),
    ("service/github-read", "GET", "https://objects.githubusercontent.com/github-production-"
     "release-asset/1", "allow"),
    ("service/github-read", "GET", "https://codeload.github.com/octo/hello/tar.gz/main",
     "allow"),
    ("service/github-read", "GET", "https://api.github.com/repos/octo/hello", "allow"),
    ("service/github-read", "POST", "https://api.github.com/repos/octo/hello/issues", "deny"),
    ("service/github-read", "GET", "https://github.com/login", "deny"),
    ("service/github-read", "PUT", "https://github-cloud.s3.amazonaws.com/x", "deny"),
    ("service/github-write", "POST", f"{GH}/git-receive-pack", "allow"),
    ("service/github-write", "POST", f"{GH}/git-upload-pack", "allow"),
    ("service/github-write", "POST", "https://api.github.com/repos/octo/hello/issues",
     "allow"),
    ("service/github-write", "PUT", "https://github-cloud.s3.amazonaws.com/x", "allow"),
    ("service/gitlab-read", "GET", "https://gitlab.com/a/b/c.git/info/refs", "allow"),
    ("service/gitlab-read", "POST", "https://gitlab.com/a/b/c.git/git-upload-pack", "allow"),
    ("service/gitlab-read", "POST", "https://gitlab.com/a/b/c.git/git-receive-pack", "deny"),
    ("service/gitlab-read", "DELETE", "https://gitlab.com/api/v4/projects/1", "deny"),
    ("service/gitlab-write", "POST", "https://gitlab.com/a/b/c.git/git-receive-pack",
     "allow"),
    ("service/gitlab-write", "PUT", "https://gitlab.com/a/c.git/gitlab-lfs/objects/ab/12",
     "allow"),
    ("service/pypi", "GET", "https://pypi.org/simple/requests/", "allow"),
    ("service/pypi", "GET", "https://files.pythonhosted.org/packages/a/b/x.whl", "allow"),
    ("service/pypi", "POST", "https://upload.pypi.org/legacy/", "deny"),
    ("service/pypi", "POST", "https://pypi.org/simple/requests/", "deny"),
    ("service/npm", "GET", "https://registry.npmjs.org/@scope%2fname", "allow"),
    ("service/npm", "GET", "https://registry.npmjs.org/left-pad/-/left-pad-1.3.0.tgz",
     "allow"),
    ("service/npm", "POST", "https://registry.npmjs.org/-/npm/v1/security/advisories/bulk",
     "allow"),
    ("service/npm", "PUT", "https://registry.npmjs.org/left-pad", "deny"),
    ("service/crates-io", "GET", "https://index.crates.io/se/rd/serde", "allow"),
    ("service/crates-io", "GET", "https://static.crates.io/crates/serde/serde-1.0.0.crate",
     "allow"),
    ("service/crates-io", "PUT", "https://crates.io/api/v1/crates/new", "deny"),
    ("service/go-proxy", "GET", "https://proxy.golang.org/golang.org/x/text/@v/list",
     "allow"),
    ("service/go-proxy", "GET", "https://sum.golang.org/lookup/golang.org/x/text@v0.3.0",
     "allow"),
    ("service/maven-central", "GET", "https://repo.maven.apache.org/maven2/junit/junit/4.13/"
     "junit-4.13.pom", "allow"),
    ("service/maven-central", "PUT", "https://repo.maven.apache.org/maven2/x", "deny"),
    ("service/rubygems", "GET", "https://index.rubygems.org/info/rails", "allow"),
    ("service/rubygems", "GET", "https://rubygems.org/gems/rails-7.0.0.gem", "allow"),
    ("service/rubygems", "POST", "https://rubygems.org/api/v1/gems", "deny"),
    ("service/docker-hub", "GET", "https://registry-1.docker.io/v2/library/alpine/manifests/"
     "3", "allow"),
    ("service/docker-hub", "GET", "https://auth.docker.io/token?service=registry.docker.io",
     "allow"),
    ("service/docker-hub", "PUT", "https://registry-1.docker.io/v2/library/alpine/manifests/"
     "3", "deny"),
    # anonymous pulls' blobs (Docker's allowlist: Cloudflare R2), read only
    ("service/docker-hub", "GET", "https://docker-images-prod.6aa30f8b08e16409b46e0173d6de2f56"
     ".r2.cloudflarestorage.com/registry-v2/docker/registry/v2/blobs/sha256/ab/ab/data",
     "allow"),
    ("service/docker-hub", "PUT", "https://docker-images-prod.6aa30f8b08e16409b46e0173d6de2f56"
     ".r2.cloudflarestorage.com/registry-v2/x", "deny"),
    ("service/huggingface", "GET", "https://huggingface.co/gpt2/resolve/main/config.json",
     "allow"),
    ("service/huggingface", "GET", "https://huggingface.co/openai/whisper/resolve/main/a.bin",
     "allow"),
    ("service/huggingface", "GET", "https://cas-bridge.xethub.hf.co/xet-bridge-us/1", "allow"),
    ("service/huggingface", "POST", "https://huggingface.co/api/models/a/b/commit/main",
     "deny"),
]


@pytest.mark.parametrize(("preset", "method", "url", "expect"), TABLE,
                         ids=[f"{p} {m} {u}" for p, m, u, _ in TABLE])
def test_protocol_shapes(preset: str, method: str, url: str, expect: str) -> None:
    assert _decide(preset, method, url) == expect
