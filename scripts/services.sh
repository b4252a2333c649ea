#!/usr/bin/env bash
# Make sure Redis (127.0.0.1:6379) and PostgreSQL (127.0.0.1:5432, trust auth, database `test`) run.
# They normally run already on this machine; start them from Debian's packages when they don't.
set -uo pipefail
SUDO=""; [ "$(id -u)" = 0 ] || SUDO="sudo"

redis_up() { (exec 3<>/dev/tcp/127.0.0.1/6379) 2>/dev/null; }
pg_up() { command -v pg_isready >/dev/null && pg_isready -q -h 127.0.0.1 -p 5432; }

if ! redis_up; then
  if ! command -v redis-server >/dev/null; then
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq redis-server
  fi
  mkdir -p /var/lib/redis /var/log/redis 2>/dev/null || true
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
fi

if ! pg_up; then
  if ! ls /etc/postgresql/*/main >/dev/null 2>&1; then
    $SUDO apt-get update -qq && $SUDO apt-get install -y -qq postgresql
  fi
  ver=$(ls /etc/postgresql | sort -V | tail -n 1)
  conf=/etc/postgresql/$ver/main
  # trust auth on loopback, listening on 127.0.0.1 (idempotent)
  if ! grep -q "inferq-trust" "$conf/pg_hba.conf"; then
    { echo "# inferq-trust"; echo "host all all 127.0.0.1/32 trust"; echo "host all all ::1/128 trust"; cat "$conf/pg_hba.conf"; } > /tmp/pg_hba.$$ \
      && $SUDO cp /tmp/pg_hba.$$ "$conf/pg_hba.conf"
  fi
  $SUDO pg_ctlcluster --skip-systemctl-redirect "$ver" main start || $SUDO pg_ctlcluster "$ver" main start
fi

for i in $(seq 1 30); do
  redis_up && pg_up && break
  sleep 1
done
redis_up || { echo "Redis is not reachable on 127.0.0.1:6379" >&2; exit 1; }
pg_up || { echo "PostgreSQL is not reachable on 127.0.0.1:5432" >&2; exit 1; }
if ! psql -h 127.0.0.1 -U postgres -d test -qtAc "select 1" >/dev/null 2>&1; then
  $SUDO -u postgres psql -qc "create database test" 2>/dev/null || psql -h 127.0.0.1 -U postgres -qc "create database test" || true
fi
echo "services ready: redis 127.0.0.1:6379, postgresql 127.0.0.1:5432"
