"""The answer to one DNS query, as a pure function of the query, who asked, their policy
and what the gateway's resolver found (no I/O: table-tested in tests/engines/test_dns_answer.py).

Call `answer(query, sandbox, policy, None, ttl)`. When the name is allowed and the type
is A or AAAA the outcome carries `need` (a name and port to resolve) and no response:
resolve it with `DestinationGuard.check_all` (the gateway's own resolver, overrides and
destination checks), then call again with the `Lookup`. A name is never resolved before
the policy allowed it: resolving an attacker's name is itself the leak.

Choices (docs/transparent-mode.md, "DNS"):
- unknown source (not a registered sandbox or a watched pod), or its policy is gone -> REFUSED;
- any type but A/AAAA (TXT, NULL, ANY, CNAME, MX, SRV, HTTPS, ...) -> REFUSED, before the
  name is even looked at; a class other than IN -> REFUSED; an opcode other than QUERY ->
  NOTIMP; not exactly one question -> FORMERR;
- a name no rule of the policy matches (on any port) -> NXDOMAIN: to the application
  the name does not exist, it fails at once and asks no other server;
- an allowed name resolving only to forbidden addresses (private, metadata, ...) ->
  REFUSED, never the address; otherwise only the allowed addresses of the asked family
  (none of that family: NOERROR with no records), with a short TTL;
- an allowed name the gateway cannot resolve -> SERVFAIL.
"""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from typing import Literal

import dns.exception
import dns.flags
import dns.message
import dns.opcode
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset

from gateway.core.evaluate import Grants, name_allowed
from gateway.core.names import DestinationError, normalize_host
from gateway.core.policy import Policy
from gateway.services.state.base import SandboxAddress

__all__ = [
    "ANSWERED_TYPES",
    "Lookup",
    "Need",
    "Outcome",
    "answer",
    "failure",
    "formerr",
    "parse",
]

ANSWERED_TYPES = frozenset((dns.rdatatype.A, dns.rdatatype.AAAA))

Result = Literal["allow", "deny", "report"]


@dataclass(frozen=True, slots=True)
class Need:
    """Resolve `host` (checked for `port`) and call `answer` again with the Lookup."""

    host: str
    port: int


@dataclass(frozen=True, slots=True)
class Lookup:
    """What the gateway's resolver found for an allowed name: the allowed addresses
    (both families), or the refusal code and reason (`forbidden_destination`,
    `unresolvable`, `bad_destination`)."""

    addresses: tuple[str, ...] = ()
    error: str | None = None
    reason: str | None = None


@dataclass(frozen=True, slots=True)
class Outcome:
    """The response (None while `need` is set) and what the audit line says about it."""

    response: dns.message.Message | None
    decision: Result
    rcode: str
    reason: str
    error: str | None = None  # refusal code, None when answered
    host: str | None = None
    qtype: str | None = None
    rule: str | None = None
    answer: tuple[str, ...] = ()
    need: Need | None = None


def parse(wire: bytes) -> dns.message.Message | None:
    """The query in `wire` (header and question only: nothing else of an untrusted
    message is parsed), or None when it is not a DNS query."""
    try:
        message = dns.message.from_wire(wire, question_only=True)
    except (dns.exception.DNSException, ValueError, IndexError, UnicodeError):
        return None
    if message.flags & dns.flags.QR:
        return None  # a response, not a query: never answered (no reflection loops)
    return message


def formerr(wire: bytes) -> bytes | None:
    """A FORMERR reply to unparsable bytes that at least carry a query header; None
    when there is nothing to reply to (too short, or a response)."""
    if len(wire) < 12 or wire[2] & 0x80:
        return None
    flags = 0x80 | (wire[2] & 0x79)  # QR, the opcode and RD as asked
    return wire[:2] + bytes((flags, dns.rcode.FORMERR)) + bytes(8)


def failure(query: dns.message.Message, rcode: dns.rcode.Rcode, reason: str, error: str) -> Outcome:
    """`rcode` (REFUSED, SERVFAIL, ...) for `query`, with the audit reason and code: for
    refusals decided outside `answer` (the rate limit, an internal error)."""
    return _fail(query, rcode, reason, error)


def answer(query: dns.message.Message, sandbox: SandboxAddress | None,
           policy: Policy | None, lookup: Lookup | None, ttl: int,
           grants: Grants | None = None) -> Outcome:
    """The response to `query` from `sandbox` (None: an unknown source) under `policy`;
    `grants`: ask mode's grants to the sandbox, which decide where the proxy lets them
    (`name_allowed`, the proxy's own decision at a CONNECT)."""
    if sandbox is None:
        return _fail(query, dns.rcode.REFUSED,
                     "unknown source: only sandboxes registered with POST /v1/sandboxes "
                     "(or, with identity.kubernetes, running pods of the watched "
                     "namespaces) get answers", "unknown_sandbox")
    if query.opcode() != dns.opcode.QUERY:
        return _fail(query, dns.rcode.NOTIMP, "only standard queries are answered",
                     "not_implemented")
    if len(query.question) != 1:
        return _fail(query, dns.rcode.FORMERR, "a query must ask exactly one question",
                     "malformed")
    question = query.question[0]
    name = question.name.to_text(omit_final_dot=True)
    qtype = dns.rdatatype.to_text(question.rdtype)
    if policy is None:
        return _fail(query, dns.rcode.REFUSED,
                     f"policy {sandbox.policy!r} of the registered sandbox is gone",
                     "unknown_policy", name, qtype)
    if question.rdclass != dns.rdataclass.IN:
        return _fail(query, dns.rcode.REFUSED, "only class IN is answered",
                     "class_refused", name, qtype)
    if question.rdtype not in ANSWERED_TYPES:
        return _fail(query, dns.rcode.REFUSED,
                     f"{qtype} queries are refused: only A and AAAA are answered",
                     "type_refused", name, qtype)
    try:
        host = normalize_host(name)
    except DestinationError as exc:
        return _fail(query, dns.rcode.NXDOMAIN, f"not a host name: {exc}",
                     "bad_name", name, qtype)
    if _is_ip(host):
        return _fail(query, dns.rcode.NXDOMAIN, "an IP address is not a name to resolve",
                     "bad_name", name, qtype)
    decision, port = name_allowed(policy, host, grants)
    rule = decision.rule.source if decision.rule is not None else None
    if not decision.allowed:
        return _fail(query, dns.rcode.NXDOMAIN, decision.reason, "policy_denied",
                     host, qtype, rule)
    if lookup is None:
        return Outcome(None, decision.result, "", decision.reason, host=host, qtype=qtype,
                       rule=rule, need=Need(host, port))
    if lookup.error is not None:
        rcode = dns.rcode.SERVFAIL if lookup.error == "unresolvable" else dns.rcode.REFUSED
        return _fail(query, rcode, lookup.reason or lookup.error, lookup.error,
                     host, qtype, rule)
    version = 4 if question.rdtype == dns.rdatatype.A else 6
    addresses = tuple(a for a in lookup.addresses if ipaddress.ip_address(a).version == version)
    response = _response(query, dns.rcode.NOERROR)
    if addresses:
        response.answer.append(dns.rrset.from_text_list(
            question.name, ttl, dns.rdataclass.IN, question.rdtype, list(addresses)))
    return Outcome(response, decision.result, "NOERROR", decision.reason, host=host,
                   qtype=qtype, rule=rule, answer=addresses)


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True


def _response(query: dns.message.Message, rcode: dns.rcode.Rcode) -> dns.message.Message:
    response = dns.message.make_response(query, recursion_available=True)
    response.set_rcode(rcode)
    return response


def _fail(query: dns.message.Message, rcode: dns.rcode.Rcode, reason: str, error: str,
          host: str | None = None, qtype: str | None = None, rule: str | None = None
          ) -> Outcome:
    """A refusal (decision deny) with `rcode`; the name and type from the question."""
    if host is None and len(query.question) == 1:
        host = query.question[0].name.to_text(omit_final_dot=True)
        qtype = dns.rdatatype.to_text(query.question[0].rdtype)
    return Outcome(_response(query, rcode), "deny", dns.rcode.to_text(rcode), reason,
                   error=error, host=host, qtype=qtype, rule=rule)
