"""The credentials reader: ``credentials:`` as a policy file writes them, read into
``Credential`` objects: presets, stored secrets and their injection, and minted types
(`policy/minted.py`) with their fields. Which rules may use them is checked across files
(``build.py``)."""

from __future__ import annotations

import re
from urllib.parse import urlsplit

from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from gateway.core.durations import parse_duration
from gateway.core.policy.hosts import HostPatternError, compile_host_pattern
from gateway.core.policy.injection import Injection
from gateway.core.policy.minted import (
    MINTED_PREFIX,
    TYPES,
    Field,
    MintSpec,
    Option,
    aws_hosts,
    cache_key,
)
from gateway.core.policy.model import Credential
from gateway.core.policy.presets import PRESETS
from gateway.services.policy.nodes import Nodes
from gateway.services.policy.problems import SHOWN, clipped, printable, quoted, shown, suggest
from gateway.services.policy.raw import NAME, CredentialDef

_CREDENTIAL_KEYS = ("preset", "secret", "hosts", "inject", "description", "type",
                    "placeholder")
_PLACEHOLDER = re.compile(r"[A-Za-z0-9_-]{1,32}")
_SECRET_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,126}")
_AWS_NAME = re.compile(r"[a-z0-9][a-z0-9-]{0,62}")
_GITHUB_LEVELS = ("read", "write", "admin")
_INJECT_KEYS = ("header", "bearer", "query", "basic")
_HEADER = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}")
_FIELD_HINTS = {"text": "value", "secret": "secret name", "url": "https URL",
                "id": "number", "texts": "list", "mapping": "mapping", "flag": "true|false",
                "path": "file path", "duration": "duration", "choice": "choice"}


def _value_of(node: Node, key: str) -> Node | None:
    """The value node of ``key`` in a mapping node, if present."""
    if isinstance(node, MappingNode):
        for key_node, value_node in node.value:
            if isinstance(key_node, ScalarNode) and key_node.value == key:
                found: Node = value_node
                return found
    return None


def _pairs(value: Option | None) -> list[tuple[str, str]]:
    return [p for p in value if isinstance(p, tuple)] if isinstance(value, tuple) else []



def read_credentials(nodes: Nodes, node: Node, policy: str,
                     defined: dict[str, CredentialDef]) -> None:
    """Add the credentials of ``policy`` (its name, ``""`` if it has none) to ``defined``,
    the load's: names are global across files."""
    if isinstance(node, ScalarNode) and nodes.scalar(node) is None:
        return
    if not isinstance(node, MappingNode):
        nodes.err(node, "credentials must be a mapping of name: {preset: ..., secret: ...}")
        return
    seen_here: set[str] = set()
    for key_node, value_node in node.value:
        name = nodes.scalar(key_node) if isinstance(key_node, ScalarNode) else None
        if not isinstance(name, str) or not NAME.fullmatch(name):
            nodes.err(key_node,
                      f"invalid credential name {quoted(name)}; use letters, digits, '.', '_', '-'")
            continue
        where = nodes.where(key_node)
        if name in defined or name in seen_here:
            first = defined[name].where if name in defined else nodes.file
            nodes.err(key_node,
                      f'duplicate credential "{name}" (first defined at {first}); credential names '
                      "are global across all policy files")
            continue
        seen_here.add(name)
        credential = read_credential(nodes, name, value_node, policy, where)
        if credential is not None:
            defined[name] = CredentialDef(credential, where)


def read_credential(nodes: Nodes, name: str, node: Node, policy: str, where: str
                    ) -> Credential | None:
    type_node = _value_of(node, "type")
    if type_node is not None:
        return _minted(nodes, name, node, type_node, policy, where)
    keys = nodes.mapping(node, _CREDENTIAL_KEYS, f'credential "{name}"')
    if keys is None:
        return None
    ok = True
    preset_name: str | None = None
    hosts: tuple[str, ...] | None = None
    injection: Injection | None = None
    secret: str | None = None
    if "preset" in keys:
        preset_node = keys["preset"][1]
        preset_name = nodes.string(preset_node, "preset")
        if preset_name is not None and preset_name not in PRESETS:
            known = tuple(PRESETS)
            nodes.err(preset_node,
                      f"unknown preset {shown(preset_name)}{suggest(preset_name, known)}; "
                      f"presets: {', '.join(known)}")
            preset_name = None
        ok = preset_name is not None
    if "secret" not in keys:
        nodes.err(node, f'credential "{name}" has no secret; add secret: <secret name>')
        ok = False
    else:
        secret = nodes.string(keys["secret"][1], "secret")
        if secret is not None and secret.startswith(MINTED_PREFIX):
            nodes.err(keys["secret"][1], f'secret names starting "{MINTED_PREFIX}" '
                      "are the gateway's own (minted values); rename the secret")
            secret = None
        ok = ok and secret is not None
    if "description" in keys:
        nodes.string(keys["description"][1], "description")
    placeholder: str | None = None
    if "placeholder" in keys:
        node_p = keys["placeholder"][1]
        placeholder = nodes.string(node_p, "placeholder")
        if placeholder is not None and not _PLACEHOLDER.fullmatch(placeholder):
            nodes.err(node_p, f"placeholder {quoted(placeholder)}: a key prefix of 1 to "
                      '32 letters, digits, "_" or "-", e.g. sk-ant-api03-')
            placeholder = None
        ok = ok and placeholder is not None
    if "hosts" in keys:
        hosts = _hosts(nodes, keys["hosts"][1])
        ok = ok and hosts is not None
    if "inject" in keys:
        injection = _inject(nodes, keys["inject"][1])
        ok = ok and injection is not None
    if "preset" not in keys and ("hosts" not in keys or "inject" not in keys):
        nodes.err(node,
                  f'credential "{name}" needs preset: (one of {", ".join(PRESETS)}) '
                  "or both hosts: and inject:")
        ok = False
    if not ok or secret is None:
        return None
    if preset_name is not None:
        preset = PRESETS[preset_name]
        hosts = hosts or preset.hosts
        injection = injection or preset.injection
    assert hosts is not None and injection is not None
    return Credential(
        name=name,
        secret=secret,
        hosts=hosts,
        injection=injection,
        preset=preset_name,
        source=where,
        policy=policy,
        placeholder=placeholder,
        # A Basic carrier: clients such as git send a password only after a 401 challenge.
        challenge=injection.kind == "basic",
    )


def _minted(nodes: Nodes, name: str, node: Node, type_node: Node, policy: str, where: str
            ) -> Credential | None:
    """A credential the gateway mints (``type:``): its fields checked by its type."""
    type_name = nodes.string(type_node, "type")
    if type_name is None:
        return None
    kind = TYPES.get(type_name)
    if kind is None:
        known = tuple(TYPES)
        nodes.err(type_node, f"unknown credential type {shown(type_name)}"
                  f"{suggest(type_name, known)}; types: {', '.join(known)} (or no type: "
                  "and preset:/secret: for a key from the secret store)")
        return None
    allowed = ("type", "hosts", "description", *(f.name for f in kind.fields))
    keys = nodes.mapping(node, allowed, f'credential "{name}" (type {type_name})')
    if keys is None:
        return None
    ok = True
    options: dict[str, Option] = {}
    for spec_field in kind.fields:
        if spec_field.name not in keys:
            if spec_field.required:
                nodes.err(node, f'credential "{name}" (type {type_name}) has no '
                          f"{spec_field.name}; add {spec_field.name}: "
                          f"<{_FIELD_HINTS[spec_field.kind]}>")
                ok = False
            elif spec_field.default is not None:
                options[spec_field.name] = spec_field.default
            continue
        value = _field(nodes, keys[spec_field.name][1], spec_field)
        if value is None:
            ok = False
        else:
            options[spec_field.name] = value
    if "description" in keys:
        nodes.string(keys["description"][1], "description")
    hosts: tuple[str, ...] | None = None
    if "hosts" in keys:
        hosts = _hosts(nodes, keys["hosts"][1])
        ok = ok and hosts is not None
    if not ok:
        return None
    if not _check_minted(nodes, name, node, type_name, options, keys):
        return None
    if hosts is None:
        hosts = kind.hosts
        if type_name == "aws-sigv4":
            hosts = aws_hosts(str(options["service"]), str(options["region"]))
        if not hosts:
            nodes.err(node, f'credential "{name}" (type {type_name}) has no hosts; '
                      "add hosts: [<the API hosts this token may be sent to>]")
            return None
    spec = MintSpec.of(type_name, options)
    return Credential(name=name, secret=cache_key(name, spec), hosts=hosts,
                      injection=kind.carriers, places=kind.places, signs=kind.signs,
                      challenge=kind.challenge, mint=spec, source=where, policy=policy)


def _field(nodes: Nodes, node: Node, spec: Field) -> Option | None:
    """One field of a minted credential, checked by its kind (None: reported)."""
    what = spec.name
    value = nodes.scalar(node) if isinstance(node, ScalarNode) else None
    if spec.kind in ("text", "path"):
        if isinstance(value, int) and not isinstance(value, bool) and spec.kind == "text":
            return str(value)
        return nodes.string(node, what)
    if spec.kind == "secret":
        text = nodes.string(node, what)
        if text is not None and not _SECRET_NAME.fullmatch(text):
            nodes.err(node, f"{what}: {shown(text)} is not a secret name; name the "
                      "secret in the store that holds it (letters, digits, '.', '_', '-')")
            return None
        return text
    if spec.kind == "url":
        text = nodes.string(node, what)
        if text is None:
            return None
        parts = urlsplit(text)
        if parts.scheme != "https" or not parts.hostname or parts.query or \
                parts.fragment or parts.username or parts.password:
            nodes.err(node, f"{what}: {shown(text)} must be an https:// URL without "
                      "query or credentials (the gateway's own calls use TLS only)")
            return None
        return text.rstrip("/")
    if spec.kind == "id":
        if isinstance(value, str) and value.isdigit():
            value = int(value)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            nodes.err(node, f"{what} must be a positive whole number")
            return None
        return value
    if spec.kind == "flag":
        return nodes.boolean(node, what)
    if spec.kind == "choice":
        if value not in spec.choices:
            nodes.err(node, f"invalid {what} {quoted(value)}; use one of "
                      f"{', '.join(spec.choices)}")
            return None
        return str(value)
    if spec.kind == "duration":
        try:
            seconds = parse_duration(value, what)
        except ValueError as exc:
            nodes.err(node, clipped(str(exc)))
            return None
        return int(seconds)
    if spec.kind == "texts":
        items = nodes.string_list(node, what)
        if items is None:
            return None
        if not items or (isinstance(node, SequenceNode) and len(items) != len(node.value)):
            if not items:
                nodes.err(node, f"{what} is empty; list at least one or omit it")
            return None
        return tuple(v for v, _ in items)
    keys = _mapping_of_strings(nodes, node, what)
    return None if keys is None else tuple(sorted(keys.items()))


def _mapping_of_strings(nodes: Nodes, node: Node, what: str) -> dict[str, str] | None:
    if not isinstance(node, MappingNode) or not node.value:
        nodes.err(node, f"{what} must be a non-empty mapping (name: value)")
        return None
    out: dict[str, str] = {}
    for key_node, value_node in node.value:
        key = nodes.scalar(key_node) if isinstance(key_node, ScalarNode) else None
        value = nodes.scalar(value_node) if isinstance(value_node, ScalarNode) else None
        if not isinstance(key, str) or not isinstance(value, str) or not key or not value:
            nodes.err(key_node, f"{what} maps names to strings")
            return None
        out[key] = value
    return out


def _check_minted(nodes: Nodes, name: str, node: Node, type_name: str,
                  options: dict[str, Option], keys: dict[str, tuple[Node, Node]]) -> bool:
    """Rules across the fields of one type (which combinations make a credential)."""
    where = f'credential "{name}" (type {type_name})'

    def fail(message: str, key: str | None = None) -> bool:
        nodes.err(keys[key][1] if key is not None and key in keys else node,
                  f"{where}: {message}")
        return False

    if type_name == "github-app":
        for perm, level in _pairs(options.get("permissions")):
            if level not in _GITHUB_LEVELS:
                return fail(f"permission {printable(str(perm), SHOWN)}: {quoted(level)} "
                            f"is not one of {', '.join(_GITHUB_LEVELS)}", "permissions")
    elif type_name == "aws-sigv4":
        for key in ("service", "region"):
            if not _AWS_NAME.fullmatch(str(options[key])):
                return fail(f"{key} {quoted(options[key])} is not an AWS {key} name "
                            "(e.g. bedrock, us-east-1)", key)
        pair = [k for k in ("access_key_id", "secret_access_key") if k in options]
        if len(pair) == 1:
            return fail("access_key_id and secret_access_key go together (the names of "
                        "the two secrets holding the key pair)", pair[0])
        web = options.get("web_identity") is True
        if web and pair:
            return fail("web_identity: true takes no access keys: the role is assumed "
                        "with the pod's web identity token", "web_identity")
        if not web and not pair:
            return fail("needs a key pair (access_key_id: and secret_access_key: secret "
                        "names, optionally role_arn:) or web_identity: true with role_arn:")
        role = options.get("role_arn")
        if web and role is None:
            return fail("web_identity: true needs role_arn: (the role to assume)")
        if role is not None and not str(role).startswith("arn:"):
            return fail(f"role_arn {quoted(str(role))} must be an ARN "
                        "(arn:aws:iam::<account>:role/<name>)", "role_arn")
        duration = options.get("duration")
        if isinstance(duration, int) and not 900 <= duration <= 43200:
            return fail("duration must be between 15m and 12h (STS limits)", "duration")
    elif type_name == "gcp-service-account":
        web = options.get("workload_identity") is True
        if web == ("key" in options):
            return fail("needs exactly one of key: (the secret holding the service "
                        "account's JSON key) or workload_identity: true")
    return True


def _hosts(nodes: Nodes, node: Node) -> tuple[str, ...] | None:
    items = nodes.string_list(node, "hosts")
    if items is None:
        return None
    if isinstance(node, SequenceNode) and not node.value:
        nodes.err(node, "hosts is empty; list the hosts this credential may be sent to")
        return None
    ok = isinstance(node, SequenceNode) and len(items) == len(node.value)
    hosts: list[str] = []
    for value, item in items:
        try:
            hosts.append(compile_host_pattern(value).text)
        except HostPatternError as exc:
            nodes.err(item, clipped(str(exc)))
            ok = False
    return tuple(hosts) if ok else None


def _inject(nodes: Nodes, node: Node) -> Injection | None:
    keys = nodes.mapping(node, _INJECT_KEYS, "inject")
    if keys is None:
        return None
    if len(keys) != 1:
        nodes.err(node,
                  "inject needs exactly one of {header: NAME}, {bearer: true}, {query: NAME}, "
                  "{basic: USER}")
        return None
    ((kind, (_, value_node)),) = keys.items()
    if kind == "bearer":
        value = nodes.boolean(value_node, "bearer")
        if value is not True:
            if value is False:
                nodes.err(value_node, "bearer: false injects nothing; use bearer: true")
            return None
        return Injection("bearer")
    text = nodes.string(value_node, kind)
    if text is None:
        return None
    if kind in ("header", "query") and not _HEADER.fullmatch(text):
        nodes.err(value_node, f"invalid {kind} name {shown(text)}")
        return None
    if kind == "header":
        return Injection("header", text)
    if kind == "query":
        return Injection("query", text)
    return Injection("basic", text)
