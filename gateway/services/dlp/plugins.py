"""Detectors detect-secrets does not ship, written as its plugins are (a
`RegexBasedDetector` with a `secret_type` and a `denylist`), so the library builds them
like the shipped ones. Formats as the providers document them:

* OpenAI project, service-account and admin keys (`sk-proj-`, `sk-svcacct-`, `sk-admin-`;
  detect-secrets' OpenAIDetector knows the older `sk-...T3BlbkFJ...` form only);
* Anthropic API and admin keys (`sk-ant-api03-...`, `sk-ant-admin01-...`);
* Hugging Face user access tokens (`hf_` and 34 letters or digits);
* GitHub fine-grained personal access tokens (`github_pat_`, 82 characters);
* Google Cloud service-account key files (the `private_key_id` beside the key) and
  Google API keys (`AIza` and 35 characters).
"""

from __future__ import annotations

import re

from detect_secrets.plugins.base import RegexBasedDetector

__all__ = ["AnthropicDetector", "GcpApiKeyDetector", "GcpServiceAccountDetector",
           "GitHubFineGrainedDetector", "HuggingFaceDetector", "OpenAIProjectKeyDetector"]

_END = r"(?![A-Za-z0-9_\-])"


class OpenAIProjectKeyDetector(RegexBasedDetector):
    secret_type = "OpenAI Project Key"
    denylist = (re.compile(r"sk-(?:proj|svcacct|admin)-[A-Za-z0-9_\-]{40,250}" + _END),)


class AnthropicDetector(RegexBasedDetector):
    secret_type = "Anthropic API Key"
    denylist = (re.compile(r"sk-ant-[a-z]{2,8}\d{2}-[A-Za-z0-9_\-]{32,200}" + _END),)


class HuggingFaceDetector(RegexBasedDetector):
    secret_type = "Hugging Face Token"
    denylist = (re.compile(r"(?<![A-Za-z0-9_])hf_[A-Za-z0-9]{34}(?![A-Za-z0-9])"),)


class GitHubFineGrainedDetector(RegexBasedDetector):
    secret_type = "GitHub Fine-grained Token"
    denylist = (re.compile(r"github_pat_[A-Za-z0-9_]{82}(?![A-Za-z0-9_])"),)


class GcpServiceAccountDetector(RegexBasedDetector):
    secret_type = "GCP Service Account Key"
    denylist = (re.compile(r'"private_key_id"\s*:\s*"([0-9a-f]{40})"'),)


class GcpApiKeyDetector(RegexBasedDetector):
    secret_type = "Google API Key"
    denylist = (re.compile(r"AIza[0-9A-Za-z_\-]{35}" + _END),)
