"""`env` and `node-preload`: what a sandbox needs to use the gateway."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from gateway.cli.common import config_of, credentials_of
from gateway.cli.token import mint_token
from gateway.config import Config
from gateway.core.policy.compiled import PolicySet
from gateway.services.identity.signing_keys import SigningKeys
from gateway.services.identity.tokens import TokenService
from gateway.services.policy import load_policy_dir
from gateway.services.state.base import MemoryState


def cmd_env(args: argparse.Namespace) -> int:
    from gateway.tools.sandbox_env import InvalidToken, dns_note, render, sandbox_variables

    if args.kubernetes:
        return _pod_env(args)
    if (args.token is None) == (args.policy is None):
        print("sandbox-gateway: env needs --token, or --policy and --sandbox to mint one",
              file=sys.stderr)
        return 2
    if args.policy is not None:
        if not args.sandbox:
            print("sandbox-gateway: env --policy needs --sandbox (the new token's sandbox id)",
                  file=sys.stderr)
            return 2
        minted = mint_token(args)
        args.token = minted.token
        print(f"# minted token {minted.jti} for sandbox {args.sandbox}, policy {args.policy}, "
              f"expiring {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(minted.expires_at))}",
              file=sys.stderr)
    elif args.ttl is not None:
        print("sandbox-gateway: --ttl is for a token env mints (--policy); a given token "
              "keeps its own expiry", file=sys.stderr)
        return 2
    try:
        verified = _check_env_token(args)
    except InvalidToken as exc:
        print(f"sandbox-gateway: --token is not a usable gateway token: {exc}; mint one "
              "with `sandbox-gateway token mint` or POST /v1/tokens", file=sys.stderr)
        return 1
    git_hosts = tuple(args.git_host or ["github.com"])
    try:
        keys = _key_variables(_token_policy(args), git_hosts) if verified \
            else ({}, ())
    except ValueError as exc:  # two placeholders for one variable
        print(f"sandbox-gateway: {exc}", file=sys.stderr)
        return 1
    preload = None if args.node_preload in ("", "none") else args.node_preload
    jvm_agent = None if args.jvm_agent in ("", "none") else args.jvm_agent
    variables = sandbox_variables(args.token, args.proxy, sandbox=args.sandbox,
                                  ca_bundle=args.ca_bundle, node_preload=preload,
                                  git_hosts=git_hosts, placeholders=keys[0],
                                  jvm_agent=jvm_agent, omit=keys[1])
    sys.stdout.write(render(variables, args.format))
    # The env file stays variables only; advice goes to the operator's terminal.
    notes = dns_note(args.proxy) + _omitted_note(keys[1])
    if not verified:
        cfg = config_of(args)
        notes.append(f"# The token's signature was not checked: no gateway signing keys in "
                     f"{cfg.signing_dir} or no policies in {cfg.policies} (the embedded "
                     "defaults); pass --config of the gateway to check it against its keys.")
    if preload:
        notes.append(f"# NODE_OPTIONS loads {preload}: put it there in the image "
                     "(`sandbox-gateway node-preload -o FILE`).")
    if jvm_agent:
        notes.append(f"# JAVA_TOOL_OPTIONS loads {jvm_agent}: put it there in the image "
                     "(`sandbox-gateway jvm-agent -o FILE`), or pass --jvm-agent none.")
    notes.append("# aiohttp reads the proxy variables only with ClientSession(trust_env=True).")
    print("\n".join(notes), file=sys.stderr)
    return 0


def _pod_env(args: argparse.Namespace) -> int:
    """`env --kubernetes`: a pod known by its address (identity.kubernetes) carries no
    token; the key variables hold a placeholder (with --policy and --config: the
    policy's credentials' placeholders before it)."""
    from gateway.tools.sandbox_env import dns_note, render, sandbox_variables

    if args.token is not None or args.ttl is not None or args.sandbox is not None:
        print("sandbox-gateway: env --kubernetes takes no --token, --ttl or --sandbox: the "
              "pod is its own identity (its namespace and name)", file=sys.stderr)
        return 2
    git_hosts = tuple(args.git_host or ["github.com"])
    keys: tuple[dict[str, str], tuple[str, ...]] = ({}, ())
    if args.policy is not None and getattr(args, "config", None) is not None:
        policies = load_policy_dir(config_of(args).policies)
        if policies.get(args.policy) is None:
            print(f"sandbox-gateway: no policy {args.policy!r}", file=sys.stderr)
            return 1
        keys = _key_variables((policies, args.policy), git_hosts)
    preload = None if args.node_preload in ("", "none") else args.node_preload
    jvm_agent = None if args.jvm_agent in ("", "none") else args.jvm_agent
    variables = sandbox_variables(None, args.proxy, ca_bundle=args.ca_bundle,
                                  node_preload=preload, git_hosts=git_hosts,
                                  placeholders=keys[0], jvm_agent=jvm_agent, omit=keys[1])
    sys.stdout.write(render(variables, args.format))
    notes = dns_note(args.proxy) + _omitted_note(keys[1])
    notes.append("# No token: the gateway knows the pod by its address (identity.kubernetes); "
                 "label the pod sandbox-gateway.io/policy=<policy> or set its namespace's "
                 "default policy.")
    print("\n".join(notes), file=sys.stderr)
    return 0


def _gateway_here(cfg: Config) -> bool:
    """The embedded defaults (no --config) name a gateway's files: signing keys and a
    policies directory where they say (./certs/signing, ./policies: `make run`'s)."""
    return cfg.policies.is_dir() and any(cfg.signing_dir.glob("*.pem"))


def _check_env_token(args: argparse.Namespace) -> bool:
    """Refuse a token that is not a live gateway JWT, and check its signature and policy
    against the gateway's keys and policies: those of --config, else of the embedded
    defaults where they are (./certs/signing and ./policies, as `token mint` without
    --config uses them). True when the signature was checked."""
    from gateway.services.identity.tokens import TokenRefused
    from gateway.tools.sandbox_env import InvalidToken, check_token

    check_token(args.token)
    cfg = config_of(args)
    if getattr(args, "config", None) is None and not _gateway_here(cfg):
        return False
    keys = SigningKeys.load(cfg.signing_dir, retired=cfg.tokens.retired_kids, create=False)
    policies = load_policy_dir(cfg.policies)
    service = TokenService(keys, MemoryState(), lambda name: credentials_of(policies, name),
                           issuer=cfg.tokens.issuer, leeway=cfg.tokens.leeway)
    try:
        service.verify(args.token)
    except TokenRefused as exc:
        raise InvalidToken(f"{exc.code}: {exc.reason}") from None
    return True


def _token_policy(args: argparse.Namespace) -> tuple[PolicySet, str]:
    """The gateway's policies (with --config, else the embedded defaults') and the name
    of the token's policy."""
    from gateway.services.identity.claims import unverified_claims

    return (load_policy_dir(config_of(args).policies),
            str(unverified_claims(args.token).get("pol") or ""))


def _key_variables(named: tuple[PolicySet, str], git_hosts: tuple[str, ...]
                   ) -> tuple[dict[str, str], tuple[str, ...]]:
    """From the sandbox's policy: the key variables' prefixes (the `placeholder` of the
    credentials it injects) and the variables left out (`implicit_unbound`: a client
    would send the token where no credential takes its place). An unknown policy: none."""
    from gateway.tools.sandbox_env import implicit_unbound, placeholders_of

    policies, name = named
    policy = policies.get(name)
    if policy is None:
        return {}, ()
    rules = [rule for rule in policy.rules if rule.credential]
    names = {rule.credential for rule in rules}
    placeholders = placeholders_of((c.preset, c.placeholder) for name, c in
                                   sorted(policies.credentials.items()) if name in names)
    return placeholders, implicit_unbound((rule.host_pattern for rule in rules), git_hosts)


def _omitted_note(omitted: tuple[str, ...]) -> list[str]:
    if not omitted:
        return []
    return [f"# Not set: {', '.join(omitted)}. Their clients send them unprompted to their "
            "vendor's hosts, where this policy binds no credential: the gateway would "
            "refuse the token there (exfiltration_blocked)."]


def cmd_node_preload(args: argparse.Namespace) -> int:
    from gateway.tools.sandbox_env import node_preload_source

    source = node_preload_source()
    if args.output in (None, "-"):
        sys.stdout.write(source)
        return 0
    target = Path(args.output)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(source, encoding="utf-8")
    target.chmod(0o644)
    print(f"wrote {target}; load it with NODE_OPTIONS=--import={target} "
          "(`sandbox-gateway env --node-preload PATH` prints that)", file=sys.stderr)
    return 0


def cmd_jvm_agent(args: argparse.Namespace) -> int:
    from gateway.tools.sandbox_env import jvm_agent_bytes

    target = Path(args.output)
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(jvm_agent_bytes())
    target.chmod(0o644)
    print(f"wrote {target}; load it with JAVA_TOOL_OPTIONS=-javaagent:{target} "
          "(`sandbox-gateway env --jvm-agent PATH` prints that)", file=sys.stderr)
    return 0


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser],
             common: argparse.ArgumentParser) -> None:
    """Add the `env` commands to the parser."""
    env = sub.add_parser(
        "env", parents=[common], help="print a sandbox's environment",
        description="Print a sandbox's environment on stdout (dotenv KEY=value lines for "
                    "docker --env-file, shell exports, or a Kubernetes env: list), and on "
                    "stderr how to run the sandbox without a DNS resolver: a sandbox using "
                    "the proxy needs none (the gateway resolves names). The token must be a "
                    "live gateway token; its signature is checked too, against the keys "
                    "of --config (else of the embedded defaults, ./certs/signing, where "
                    "they are).")
    env.add_argument("--token", help="the sandbox's token (or mint one: --policy)")
    env.add_argument("--policy", help="mint the token here, for this policy (with --sandbox; "
                     "signed with the keys of --config, as `token mint` does)")
    env.add_argument("--ttl", help="with --policy: the token's lifetime, e.g. 8h (default: the "
                     "policy's tokens.ttl, else tokens.default_ttl; max tokens.max_ttl)")
    env.add_argument("--proxy", required=True, help="gateway URL, e.g. http://gateway:8080")
    env.add_argument("--sandbox", help="sandbox id (default: the token's sub)")
    env.add_argument("--kubernetes", action="store_true",
                     help="a pod the gateway knows by its address (identity.kubernetes): no "
                          "token in the proxy URL or the key variables")
    env.add_argument("--git-host", action="append", metavar="HOST",
                     help="a host whose git credential helper answers the token "
                          "(repeatable; default github.com; add a GitHub Enterprise host)")
    env.add_argument("--ca-bundle", default="/etc/sandbox-gateway/ca-bundle.pem",
                     help="path of the CA bundle inside the sandbox (the system bundle with "
                          "the gateway CA added)")
    env.add_argument("--node-preload", default="/etc/sandbox-gateway/node-proxy-preload.mjs",
                     metavar="PATH", help="path of the Node preload inside the sandbox, for "
                     "NODE_OPTIONS (write it with `node-preload`; 'none' to leave it out)")
    env.add_argument("--jvm-agent", default="/etc/sandbox-gateway/jvm-proxy-agent.jar",
                     metavar="PATH", help="path of the JVM agent inside the sandbox, for "
                     "JAVA_TOOL_OPTIONS (write it with `jvm-agent`; 'none' to leave it out)")
    env.add_argument("--format", choices=("dotenv", "shell", "k8s"), default="dotenv",
                     help="dotenv (KEY=value, default), shell (export KEY='value') or k8s "
                          "(a container's env: list)")
    env.set_defaults(func=cmd_env)

    preload = sub.add_parser(
        "node-preload", help="write the Node preload that proxies fetch",
        description="Write the Node preload (node-proxy-preload.mjs) that makes Node's fetch "
                    "use HTTPS_PROXY (Node 20 ignores it), for a sandbox image; `env` points "
                    "NODE_OPTIONS at it.")
    preload.add_argument("-o", "--output", metavar="FILE", help="file to write (default: stdout)")
    preload.set_defaults(func=cmd_node_preload)

    agent = sub.add_parser(
        "jvm-agent", help="write the JVM agent that makes Java clients use the gateway",
        description="Write the JVM agent jar (jvm-proxy-agent.jar) for a sandbox image; `env` "
                    "points JAVA_TOOL_OPTIONS at it. It relays the JVM's proxy connections "
                    "with the proxy credentials of HTTPS_PROXY (the JDK sends none of its "
                    "own) and trusts SSL_CERT_FILE's bundle.")
    agent.add_argument("-o", "--output", metavar="FILE", required=True, help="file to write")
    agent.set_defaults(func=cmd_jvm_agent)
