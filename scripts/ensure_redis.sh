#!/usr/bin/env bash
# Make sure a Redis server answers on 127.0.0.1:6379: install it from Debian's packages if missing, start it if down.
set -euo pipefail
ping_redis() { (exec 3<>/dev/tcp/127.0.0.1/6379 && printf 'PING\r\n' >&3 && timeout 2 head -c 5 <&3 | grep -q PONG) 2>/dev/null; }
if ping_redis; then exit 0; fi
if ! command -v redis-server >/dev/null 2>&1; then
  echo "installing redis-server from Debian's packages…"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi
mkdir -p /var/lib/redis /var/log/redis 2>/dev/null || true
redis-server --daemonize yes --bind 127.0.0.1 --port 6379 --save "" --appendonly no --dir /tmp --logfile /tmp/kvyard-redis.log
for _ in $(seq 50); do ping_redis && exit 0; sleep 0.1; done
echo "redis did not start; see /tmp/kvyard-redis.log" >&2
exit 1
