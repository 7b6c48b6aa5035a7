#!/bin/sh
# Form the Redis Cluster once: wait for every node, then `redis-cli --cluster create`.
# Idempotent: exits 0 when the cluster is already formed, and refuses (exit 1) when the
# first node already knows other nodes but the cluster is not ok (a human must look).
#   REDIS_NODES     space-separated host:port of every node, first one is asked for state
#   REDIS_REPLICAS  replicas per master
#   REDISCLI_AUTH   the password (read by redis-cli itself)
set -eu
addrs=""
for node in $REDIS_NODES; do
  host=${node%:*}
  port=${node##*:}
  until [ "$(redis-cli -h "$host" -p "$port" ping 2>/dev/null)" = "PONG" ]; do
    echo "waiting for $node"
    sleep 2
  done
  # CLUSTER MEET takes addresses; the nodes announce their DNS names to clients.
  ip=$(getent hosts "$host" | awk 'NR == 1 { print $1 }')
  addrs="$addrs $ip:$port"
done
first=${REDIS_NODES%% *}
state() { redis-cli -h "${first%:*}" -p "${first##*:}" cluster info | tr -d '\r'; }
if state | grep -q '^cluster_state:ok$'; then
  echo "cluster already formed"
  exit 0
fi
if ! state | grep -q '^cluster_known_nodes:1$'; then
  echo "$first already knows other nodes but the cluster is not ok; not re-creating" >&2
  state >&2
  exit 1
fi
# shellcheck disable=SC2086  # one argument per address
redis-cli --cluster create $addrs --cluster-replicas "$REDIS_REPLICAS" --cluster-yes
tries=0
until state | grep -q '^cluster_state:ok$'; do
  tries=$((tries + 1))
  if [ "$tries" -gt 60 ]; then
    echo "cluster did not reach cluster_state:ok" >&2
    exit 1
  fi
  sleep 1
done
echo "cluster formed"
