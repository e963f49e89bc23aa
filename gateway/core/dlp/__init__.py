"""Outbound credential detection (issue 43), pure: no I/O, no engine.

`Scanner` finds credentials in a request (line, query, headers, body decoded as the
receiver reads it) with the `Detector`s built from detect-secrets plugins by
`gateway/services/dlp/library.py`; `StreamScanner` does the same chunk by chunk for a body
larger than the hold limit; `redact_body` rewrites a body without the values; `Dlp` is a
policy's `dlp:` section. Results name the detector, the location and a salted fingerprint,
never the value. See docs/dlp.md.

Called from one place (the engines' body stage, when wired)::

    scanner = Scanner(library.build(DETECTORS), salt, limit=hold_limit)   # once, at start
    dlp = resolve(policy.dlp, rule.dlp)                                   # per request
    if dlp is not None:
        result = scanner.only(dlp.detectors or DEFAULT).scan_request(
            method, target, headers_without_the_credential_carrier, body)
        found = [f for f in result.findings if dlp.applies(f, host)]
        # result.unreadable: refuse (fail closed); found: refuse / redact_body / report
        # by dlp.effective_action. A body past the hold limit, a WebSocket message's
        # fragments: StreamScanner(scanner.only(...), content_encoding).feed(chunk).
"""

from gateway.core.dlp.catalogue import DEFAULT, DETECTORS, OPT_IN
from gateway.core.dlp.decoding import Unreadable
from gateway.core.dlp.detector import Detector, Rule
from gateway.core.dlp.findings import Finding, Location, ScanResult, fingerprint
from gateway.core.dlp.policy import ACTIONS, Dlp, DlpAllow, resolve
from gateway.core.dlp.redact import REDACTED, Redaction, redact_body, redact_text
from gateway.core.dlp.scanner import Scanner
from gateway.core.dlp.stream import StreamScanner

__all__ = ["ACTIONS", "DEFAULT", "DETECTORS", "OPT_IN", "REDACTED", "Detector", "Dlp",
           "DlpAllow", "Finding", "Location", "Redaction", "Rule", "ScanResult", "Scanner",
           "StreamScanner", "Unreadable", "fingerprint", "redact_body", "redact_text",
           "resolve"]
