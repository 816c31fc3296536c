#!/usr/bin/env bash
# Starts a local redis-server on 127.0.0.1:${DOCKRL_REDIS_PORT:-6379} unless one already answers.
set -euo pipefail
port=${DOCKRL_REDIS_PORT:-6379}
if redis-cli -h 127.0.0.1 -p "$port" ping 2>/dev/null | grep -q PONG; then
    exit 0
fi
dir=${TMPDIR:-/tmp}/dockrl-redis-$port
mkdir -p "$dir"
redis-server --daemonize yes --bind 127.0.0.1 --port "$port" --save "" --appendonly no \
    --dir "$dir" --logfile "$dir/redis.log"
for _ in $(seq 50); do
    redis-cli -h 127.0.0.1 -p "$port" ping 2>/dev/null | grep -q PONG && exit 0
    sleep 0.1
done
echo "redis-server did not answer on 127.0.0.1:$port" >&2
exit 1
