"""The detectors detect-secrets lacks, written as its plugins: real formats found,
near misses not."""

from __future__ import annotations

import pytest

from gateway.services.dlp.plugins import (
    AnthropicDetector,
    GcpApiKeyDetector,
    GcpServiceAccountDetector,
    GitHubFineGrainedDetector,
    HuggingFaceDetector,
    OpenAIProjectKeyDetector,
)

A = "Ab1_" * 30


@pytest.mark.parametrize(("plugin", "text", "found"), [
    (OpenAIProjectKeyDetector, f"sk-proj-{A[:100]}", True),
    (OpenAIProjectKeyDetector, f"sk-svcacct-{A[:60]}", True),
    (OpenAIProjectKeyDetector, f"sk-proj-{A[:20]}", False),  # too short
    (OpenAIProjectKeyDetector, "sk-project-overview", False),
    (AnthropicDetector, f"sk-ant-api03-{A[:95]}", True),
    (AnthropicDetector, f"sk-ant-admin01-{A[:95]}", True),
    (AnthropicDetector, "sk-ant-api03-short", False),
    (HuggingFaceDetector, "hf_" + "aB" * 17, True),
    (HuggingFaceDetector, "hf_" + "aB" * 18, False),  # longer: not this format
    (HuggingFaceDetector, "my_hf_" + "aB" * 17, False),  # inside an identifier
    (GitHubFineGrainedDetector, "github_pat_" + "A1_b" * 20 + "xy", True),
    (GitHubFineGrainedDetector, "github_pat_short", False),
    (GcpServiceAccountDetector, '"private_key_id": "' + "ab12" * 10 + '"', True),
    (GcpServiceAccountDetector, '"private_key_id": "not-hex"', False),
    (GcpApiKeyDetector, "AIza" + "Sy" * 17 + "A", True),
    (GcpApiKeyDetector, "AIza" + "Sy" * 10, False),
])
def test_formats(plugin: type, text: str, found: bool) -> None:
    assert bool(list(plugin().analyze_string(f"x {text} y"))) is found
