# The README's two commands are `make demo` and `make test`.
GO ?= go
export PATH := /usr/local/go/bin:$(PATH)

.PHONY: demo test services build lint chaos lab bench scale console console-shots clean

## demo: start the local services, then run a fleet of consumers on a stream with duplicates and verify it
demo: services build
	./bin/idem-lab demo

## test: start the local services, then run every test (unit, Postgres, Redis, RabbitMQ, crash and chaos) with -race
## The longest packages are named first, so they start first (go test runs
## packages in the order given; ./... then adds every other package once):
## test/chaos's cluster runs, which need the machine to themselves, beside
## pkg/idem, whose tests mostly wait, and test/e2e once they are over.
LONG_TESTS := ./test/chaos ./pkg/idem ./pkg/consumer ./test/e2e
test: services
	$(GO) test -race -count=1 -timeout 15m $(LONG_TESTS) ./...

## services: make sure PostgreSQL, Redis and RabbitMQ run locally
services:
	@bash .ci/services.sh

## build: bin/idem, the shipped binary, and bin/idem-lab, the harness (demo, chaos, lab, bench)
build:
	$(GO) build -buildvcs=auto -o bin/idem ./cmd/idem
	$(GO) build -buildvcs=auto -o bin/idem-lab ./cmd/idem-lab

lint:
	@test -z "$$(gofmt -l .)" || (gofmt -l .; exit 1)
	$(GO) vet ./...

## chaos: ten minutes of the fleet under every fault kind, ending in a verdict and an HTML timeline (CHAOS_FLAGS to change it)
chaos: services build
	./bin/idem-lab chaos --duration 10m --dir chaos-report $(CHAOS_FLAGS)

## lab: the five approaches (and SET NX claim-first) side by side on the same stream and faults
lab: services build
	./bin/idem-lab lab --events 10000 --json lab.json

# BASELINE is the git revision `make bench` judges the work tree against:
# HEAD, the last commit, by default; e.g. `make bench BASELINE=ca5bcd9`.
BASELINE ?= HEAD
# PG_LATENCY is the round trip of the bench's "Postgres N ms away" rows.
PG_LATENCY ?= 1ms

## bench: every consumer configuration against a raw consume+ack baseline, and against the build of BASELINE (default HEAD), in one run (docs/performance.md)
bench: services build
	GO=$(GO) bash .ci/build-baseline.sh $(BASELINE) bin/idem-lab-baseline
	./bin/idem-lab bench --baseline-bin bin/idem-lab-baseline --pg-latency $(PG_LATENCY) --json bench.json --svg docs/performance.svg $(BENCH_FLAGS)

## scale: the measurements docs/scale.md is built from (row and marker sizes, CPU per tier), then idem chaos --cluster for 3 minutes
scale: services build
	$(GO) test -run '^$$' -bench ProcessedRowSize -benchtime 200000x ./pkg/guard/pgtier/
	$(GO) test -run '^$$' -bench DoneMarkerMemory -benchtime 200000x ./pkg/guard/redistier/
	./bin/idem-lab bench --events 200000 --runs 3 --json scale-bench.json --rows 'raw 25%;batched, Redis on, 25%;batched, Redis off, 25%;batched, Redis on, 100%'
	./bin/idem-lab chaos --cluster --duration 3m --seed 20261130 --dir chaos-cluster-report

## console: serve the operator's console on http://127.0.0.1:8089/ for the local demo's stream (docs/console.md)
console: services build
	./bin/idem console

## console-shots: rerun the console's browser test, saving its screenshots to docs/console
console-shots: services
	CONSOLE_SHOTS=$(CURDIR)/docs/console $(GO) test -race -count=1 -run TestTheConsoleShowsWhatIsWrongAndFixesIt ./test/e2e/

clean:
	rm -rf bin
