# The README's two commands are `make demo` and `make test`.
GO ?= go
export PATH := /usr/local/go/bin:$(PATH)

.PHONY: demo test services build lint chaos lab bench clean

## demo: start the local services, then run a fleet of consumers on a stream with duplicates and verify it
demo: services build
	./bin/idem demo

## test: start the local services, then run every test (unit, Postgres, Redis, RabbitMQ, crash and chaos) with -race
test: services
	$(GO) test -race -count=1 -timeout 15m ./...

## services: make sure PostgreSQL, Redis and RabbitMQ run locally
services:
	@bash .ci/services.sh

build:
	$(GO) build -buildvcs=auto -o bin/idem ./cmd/idem

lint:
	@test -z "$$(gofmt -l .)" || (gofmt -l .; exit 1)
	$(GO) vet ./...

## chaos: ten minutes of the fleet under every fault kind, ending in a verdict and an HTML timeline (CHAOS_FLAGS to change it)
chaos: services build
	./bin/idem chaos --duration 10m --dir chaos-report $(CHAOS_FLAGS)

## lab: the five approaches (and SET NX claim-first) side by side on the same stream and faults
lab: services build
	./bin/idem lab --events 10000 --json lab.json

## bench: one event through the guard, two tiers against the Postgres-only baseline (median of 6 runs)
bench: services
	$(GO) test -run '^$$' -bench Process -count 6 -benchtime 2000x ./pkg/guard/ | tee /tmp/idem-bench.txt
	$(GO) run golang.org/x/perf/cmd/benchstat@v0.0.0-20260908200009-22c9c6c9d4da /tmp/idem-bench.txt

clean:
	rm -rf bin
