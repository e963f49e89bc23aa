"""Which names a rule's ``methods:`` may list.

- The standard methods (RFC 9110 and PATCH, RFC 5789) in any case: ``get`` means GET.
- The other methods of the IANA HTTP Method Registry (WebDAV, DeltaV, CalDAV, QUERY, ...),
  written in uppercase only: methods are case-sensitive on the wire (the gateway refuses
  a lower-case request method), so ``propfind`` would be a different, unknown method.
- Nothing else. A typo (``GTE``) would otherwise make a rule that matches no request;
  the error suggests the closest known method. There is no opt-in for unregistered
  methods: to allow them, omit ``methods`` (the rule then allows every method).
"""

from __future__ import annotations

import difflib

__all__ = ["EXTENSION_METHODS", "STANDARD_METHODS", "check_method"]

STANDARD_METHODS = frozenset((
    "GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH",
))

#: The rest of the IANA HTTP Method Registry (PRI, the HTTP/2 preface, is never a request).
EXTENSION_METHODS = frozenset((
    "ACL", "BASELINE-CONTROL", "BIND", "CHECKIN", "CHECKOUT", "COPY", "LABEL", "LINK",
    "LOCK", "MERGE", "MKACTIVITY", "MKCALENDAR", "MKCOL", "MKREDIRECTREF", "MKWORKSPACE",
    "MOVE", "ORDERPATCH", "PROPFIND", "PROPPATCH", "QUERY", "REBIND", "REPORT", "SEARCH",
    "UNBIND", "UNCHECKOUT", "UNLINK", "UNLOCK", "UPDATE", "UPDATEREDIRECTREF",
    "VERSION-CONTROL",
))

_KNOWN = sorted(STANDARD_METHODS | EXTENSION_METHODS)


def check_method(value: str) -> tuple[str | None, str | None]:
    """(the method as matched, None) or (None, a message saying what to write)."""
    upper = value.upper()
    if upper in STANDARD_METHODS:
        return upper, None
    if value in EXTENSION_METHODS:
        return value, None
    shown = value[:32]
    if upper in EXTENSION_METHODS:
        return None, (f'method "{shown}" must be written in uppercase ({upper}): HTTP '
                      "methods are case-sensitive")
    if value == "*":
        return None, 'invalid method "*"; omit methods to allow every method'
    close = difflib.get_close_matches(upper, _KNOWN, n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}? " if close else ""
    return None, (f'unknown method "{shown}"; {hint}use a standard HTTP method (GET, HEAD, '
                  "POST, PUT, PATCH, DELETE, OPTIONS, ...) or a registered one in uppercase "
                  "(PROPFIND, ...), or omit methods to allow every method")
