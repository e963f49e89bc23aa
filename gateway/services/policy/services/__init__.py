"""Service presets shipped with the gateway: the egress of package registries and code
hosts, used as ``extends: [service/github-read]`` (see ``policy/agents``, which loads them
the same way, and docs/policies.md for the list).

Each preset (``<name>.yaml`` here, rules sourced as ``service/<name>.yaml:<line>``) holds
the service's real protocol shapes, keyless: methods and paths where a client's reads and
writes differ (git smart HTTP: ``git-upload-pack`` to read, ``git-receive-pack`` only in a
``-write`` preset), the hosts its downloads are redirected to. ``github-*`` carry a block
of hosts from GitHub's meta API (``sandbox-gateway presets update`` rewrites it, dated).
"""
