#!/usr/bin/env bash
# Start PostgreSQL, MariaDB, Redis and RabbitMQ when they are not answering (as this machine kind does),
# then wait until each answers. Safe to run when they already run.
set -euo pipefail

answers() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

wait_port() {  # name port seconds
  local deadline=$((SECONDS + $3))
  until answers "$2"; do
    if (( SECONDS >= deadline )); then echo "services: $1 did not answer on port $2" >&2; exit 1; fi
    sleep 0.5
  done
}

if ! answers 5432; then
  echo "services: starting PostgreSQL"
  pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start
fi
if ! answers 3306; then
  echo "services: starting MariaDB"
  mkdir -p /run/mysqld && chown mysql:mysql /run/mysqld 2>/dev/null || true
  start-stop-daemon --start --oknodo --background --exec /usr/sbin/mariadbd
fi
if ! answers 6379; then
  echo "services: starting Redis"
  mkdir -p /var/lib/redis /var/log/redis
  redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
    --dir /var/lib/redis --logfile /var/log/redis/ci.log
fi
if ! answers 5672; then
  echo "services: starting RabbitMQ"
  rabbitmq-server -detached
fi
wait_port PostgreSQL 5432 60
wait_port MariaDB 3306 60
wait_port Redis 6379 30
wait_port RabbitMQ 5672 120
until pg_isready -q -h 127.0.0.1 -p 5432; do sleep 0.5; done
until mysqladmin --host=127.0.0.1 --user=root ping >/dev/null 2>&1; do sleep 0.5; done
echo "services: PostgreSQL, MariaDB, Redis and RabbitMQ answer"
