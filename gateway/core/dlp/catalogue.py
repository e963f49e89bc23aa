"""The detectors' names, what each finds, and which run unless a policy names them.

Names are what policies write (`dlp: {detectors: [aws, github]}`, `allow: [{detector:
pypi, ...}]`): the policy reader checks names against this list without importing the
detector library (`gateway/services/dlp/library.py` builds exactly these; a test holds
the two together).
"""

from __future__ import annotations

__all__ = ["DEFAULT", "DETECTORS", "OPT_IN"]

# name -> what it finds
DETECTORS: dict[str, str] = {
    "aws": "AWS access key IDs, and secret access keys assigned next to an `aws...key` name",
    "azure-storage": "Azure storage account keys (AccountKey=...)",
    "basic-auth": "passwords in URLs (scheme://user:password@host)",
    "github": "GitHub tokens (ghp_, gho_, ghu_, ghs_, ghr_, github_pat_)",
    "gitlab": "GitLab tokens (glpat-, gldt-, glrt-, GR1348941, ...)",
    "slack": "Slack tokens (xox?-) and incoming-webhook URLs",
    "stripe": "Stripe live secret and restricted keys (sk_live_, rk_live_)",
    "twilio": "Twilio account and API key SIDs (AC..., SK...)",
    "private-key": "PEM and OpenSSH private keys, PuTTY key files",
    "jwt": "JSON Web Tokens (three base64url parts, the first two JSON)",
    "openai": "OpenAI API keys (sk-..., sk-proj-..., sk-svcacct-..., sk-admin-...)",
    "anthropic": "Anthropic API keys (sk-ant-...)",
    "huggingface": "Hugging Face access tokens (hf_...)",
    "gcp-service-account": "Google Cloud service-account key files (private_key_id)",
    "gcp-api-key": "Google API keys (AIza...)",
    "npm": "npm registry tokens in .npmrc lines (//host/:_authToken=...)",
    "pypi": "PyPI and TestPyPI upload tokens (pypi-AgE...)",
    "sendgrid": "SendGrid API keys (SG.xxx.yyy)",
    "mailchimp": "Mailchimp API keys (...-usNN)",
    "square": "Square OAuth secrets (sq0csp-...)",
    "artifactory": "JFrog Artifactory API tokens and passwords (AKC..., AP...)",
    # Opt-in: no literal anchor (a full regular-expression pass over every view) or many
    # false positives on ordinary traffic.
    "discord": "Discord bot tokens",
    "telegram": "Telegram bot tokens (digits:35 characters)",
    "cloudant": "IBM Cloudant credentials",
    "ibm-cloud-iam": "IBM Cloud IAM keys assigned to a key/password name",
    "ibm-cos-hmac": "IBM COS HMAC secret keys assigned to a secret-key name",
    "softlayer": "SoftLayer API keys",
    "keyword": "any quoted value assigned to a name like password, secret, api_key",
    "high-entropy": "quoted base64 or hex strings of high Shannon entropy",
}

OPT_IN = frozenset({"discord", "telegram", "cloudant", "ibm-cloud-iam", "ibm-cos-hmac",
                    "softlayer", "keyword", "high-entropy"})
DEFAULT: tuple[str, ...] = tuple(n for n in DETECTORS if n not in OPT_IN)
