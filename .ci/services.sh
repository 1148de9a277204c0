#!/usr/bin/env bash
# Makes sure the local PostgreSQL, Redis and RabbitMQ that the tests and the
# demo use are installed and running, starting (or, on a bare Debian machine,
# installing) each one that is not. On a machine without apt but with Docker
# (a developer laptop), it starts them with docker compose instead.
# Idempotent; used by .ci/run and `make`.
set -euo pipefail

log() { echo "services: $*" >&2; }

need_pkg() { # need_pkg COMMAND PACKAGE...
	command -v "$1" >/dev/null 2>&1 && return 0
	log "installing ${*:2}"
	export DEBIAN_FRONTEND=noninteractive
	apt-get update -qq && apt-get install -y -qq "${@:2}" >/dev/null
}

wait_for() { # wait_for NAME SECONDS COMMAND...
	local name=$1 secs=$2; shift 2
	for _ in $(seq 1 $((secs * 5))); do
		"$@" >/dev/null 2>&1 && return 0
		sleep 0.2
	done
	log "$name did not come up within ${secs}s"; return 1
}

postgres() {
	if ! command -v pg_ctlcluster >/dev/null 2>&1; then
		need_pkg pg_ctlcluster postgresql
		# Tests connect over TCP as postgres without a password.
		for hba in /etc/postgresql/*/main/pg_hba.conf; do
			sed -i -E 's/^(host\s+all\s+all\s+(127\.0\.0\.1\/32|::1\/128)\s+)\S+/\1trust/' "$hba"
		done
	fi
	if ! pg_isready -q -h 127.0.0.1 -p 5432; then
		log "starting PostgreSQL"
		pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | sort -V | tail -1)" main start
		wait_for PostgreSQL 60 pg_isready -q -h 127.0.0.1 -p 5432
	fi
	if ! psql -h 127.0.0.1 -U postgres -d test -Atc 'select 1' >/dev/null 2>&1; then
		log "creating database test"
		createdb -h 127.0.0.1 -U postgres test
	fi
}

redis() {
	need_pkg redis-server redis-server
	if ! redis-cli -h 127.0.0.1 -p 6379 ping >/dev/null 2>&1; then
		log "starting Redis"
		mkdir -p /var/lib/redis /var/log/redis
		redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" --appendonly no \
			--dir /var/lib/redis --logfile /var/log/redis/ci.log
		wait_for Redis 30 redis-cli -h 127.0.0.1 -p 6379 ping
	fi
}

rabbitmq() {
	need_pkg rabbitmq-server rabbitmq-server
	if ! rabbitmq-diagnostics -q check_port_connectivity >/dev/null 2>&1; then
		log "starting RabbitMQ"
		rabbitmq-server -detached || true
		wait_for RabbitMQ 120 rabbitmq-diagnostics -q check_port_connectivity
	fi
}

# promtool unit-tests the alert rules (deploy/prometheus/rules); only the
# tool is needed, no Prometheus server is started.
alert_tools() {
	need_pkg promtool --no-install-recommends prometheus
}

# pgbouncer: the tests that run idem behind a transaction-mode pooler
# start PgBouncers of their own (internal/sandbox); only the binary is
# needed. The package's own service is not used.
pooler_tools() {
	need_pkg pgbouncer pgbouncer
}

# chromium: the console's browser tests (test/e2e/console_test.go) drive
# Debian's Chromium headless through chromedp.
browser_tools() {
	need_pkg chromium --no-install-recommends chromium
}

port_open() { # port_open PORT
	(exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

# compose starts the three services in containers, on the ports the tests
# use, when they are not listening already. The Redis and Postgres tests
# that start servers of their own need redis-server and PostgreSQL's
# binaries on the machine too; without them they skip.
compose() {
	local root
	root=$(cd "$(dirname "$0")/.." && pwd)
	if port_open 5432 && port_open 6379 && port_open 5672; then
		return 0
	fi
	log "no apt-get: starting PostgreSQL, Redis and RabbitMQ with docker compose"
	docker compose -f "$root/docker-compose.yml" -f "$root/.ci/compose.services.yml" up -d --wait postgres redis rabbitmq
	wait_for PostgreSQL 60 port_open 5432
	wait_for Redis 30 port_open 6379
	wait_for RabbitMQ 120 port_open 5672
	command -v promtool >/dev/null 2>&1 || log "promtool is missing: the alert rules' test fails under CI=true and skips otherwise (install Prometheus's promtool)"
	command -v pgbouncer >/dev/null 2>&1 || log "pgbouncer is missing: the pooler tests fail under CI=true and skip otherwise (install PgBouncer)"
	command -v chromium >/dev/null 2>&1 || log "chromium is missing: the console's browser tests fail under CI=true and skip otherwise (install Chromium)"
}

if ! command -v apt-get >/dev/null 2>&1 && command -v docker >/dev/null 2>&1; then
	compose
	log "PostgreSQL, Redis and RabbitMQ are up (docker compose)"
	exit 0
fi

postgres
redis
rabbitmq
alert_tools
pooler_tools
browser_tools
log "PostgreSQL, Redis and RabbitMQ are up; promtool, pgbouncer and chromium are installed"
