#!/usr/bin/env bash
# sandbox-netns.sh: a sandbox network namespace whose TCP traffic is redirected
# transparently into the gateway, for local trials of transparent mode. Root only.
#
#   scripts/sandbox-netns.sh up   [NAME] [GATEWAY_NS] [TRANSPARENT_PORT] [DNS_PORT]
#   scripts/sandbox-netns.sh down [NAME] [GATEWAY_NS]
#
# Layout (defaults: NAME=sbx, GATEWAY_NS=sgw, port 8081, no DNS):
#   netns NAME        veth NAME-s 198.18.0.2/30, default route via 198.18.0.1
#   netns GATEWAY_NS  veth NAME-h 198.18.0.1/30; iptables REDIRECTs every TCP
#                     connection arriving from the sandbox to TRANSPARENT_PORT.
#                     With DNS_PORT, UDP and TCP to 198.18.0.1:DNS_PORT reach the
#                     gateway's DNS resolver (`listen.dns: "0.0.0.0:DNS_PORT"`;
#                     use 53 and `nameserver 198.18.0.1` in the sandbox's
#                     /etc/netns/NAME/resolv.conf); all other UDP is dropped.
# Run the gateway inside GATEWAY_NS with `listen.transparent: "0.0.0.0:PORT"`
# (`ip netns exec GATEWAY_NS sandbox-gateway run --config ...`), register the
# sandbox (POST /v1/sandboxes {"id": "...", "ip": "198.18.0.2", "policy": "..."}),
# then try `ip netns exec NAME curl https://...`. 198.18.0.0/15 is the benchmarking
# range: nothing on it is routed off this machine.
set -euo pipefail
cmd=${1:?up or down}
name=${2:-sbx}
gw=${3:-sgw}
port=${4:-8081}
dns_port=${5:-}
host_if="${name}-h"
sbx_if="${name}-s"

case "$cmd" in
  up)
    ip netns add "$gw" 2>/dev/null || true
    ip netns add "$name"
    ip link add "$host_if" type veth peer name "$sbx_if"
    ip link set "$host_if" netns "$gw"
    ip link set "$sbx_if" netns "$name"
    ip -n "$gw" link set lo up
    ip -n "$gw" addr add 198.18.0.1/30 dev "$host_if"
    ip -n "$gw" link set "$host_if" up
    ip -n "$name" link set lo up
    ip -n "$name" addr add 198.18.0.2/30 dev "$sbx_if"
    ip -n "$name" link set "$sbx_if" up
    ip -n "$name" route add default via 198.18.0.1
    # Every TCP connection from the sandbox goes to the gateway's transparent listener;
    # UDP (incl. QUIC) is dropped: it is not proxied.
    if [ -n "$dns_port" ]; then
      # ...except DNS to the gateway itself: its policy-aware resolver (UDP and TCP).
      ip netns exec "$gw" iptables -t nat -A PREROUTING -i "$host_if" -p tcp -d 198.18.0.1 \
        --dport "$dns_port" -j RETURN
      ip netns exec "$gw" iptables -A INPUT -i "$host_if" -p udp -d 198.18.0.1 \
        --dport "$dns_port" -j ACCEPT
    fi
    ip netns exec "$gw" iptables -t nat -A PREROUTING -i "$host_if" -p tcp -j REDIRECT --to-ports "$port"
    ip netns exec "$gw" iptables -A INPUT -i "$host_if" -p udp -j DROP
    echo "sandbox netns $name (198.18.0.2) -> gateway netns $gw (198.18.0.1:$port${dns_port:+, DNS 198.18.0.1:$dns_port})"
    ;;
  down)
    ip netns del "$name" 2>/dev/null || true
    ip netns del "$gw" 2>/dev/null || true
    ;;
  *)
    echo "usage: $0 up|down [NAME] [GATEWAY_NS] [PORT] [DNS_PORT]" >&2
    exit 2
    ;;
esac
