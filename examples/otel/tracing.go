// Package idemotel is the OpenTelemetry tracing observer that
// docs/operations.md quotes: it wraps idem's Prometheus observer and starts a
// span per delivery and per guard stage. It is a module of its own, so that
// idem does not depend on OpenTelemetry; the docs test compiles it.
package idemotel

import (
	"context"
	"time"

	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	"go.opentelemetry.io/otel/trace"

	"github.com/idemhq/idem/pkg/consumer"
	"github.com/idemhq/idem/pkg/guard"
	"github.com/idemhq/idem/pkg/metrics"
)

// docs:begin

// tracing records a span per delivery and per guard stage, and hands
// everything on to the Prometheus metrics it embeds.
type tracing struct {
	*metrics.Metrics
	tracer trace.Tracer
}

func (o tracing) Settled(ctx context.Context, s consumer.Settlement) {
	o.Metrics.Settled(ctx, s)
	_, span := o.tracer.Start(ctx, "idem.delivery", trace.WithTimestamp(s.Received),
		trace.WithSpanKind(trace.SpanKindConsumer),
		trace.WithAttributes(
			attribute.String("idem.event_id", s.EventID),
			attribute.String("idem.scope", s.Scope),
			attribute.String("idem.outcome", s.Outcome.String()),
			attribute.String("idem.reason", s.Reason),
			attribute.Int("idem.attempt", s.Attempt),
			attribute.String("messaging.message.id", s.Message.ID),
		))
	if s.Err != nil {
		span.RecordError(s.Err)
		span.SetStatus(codes.Error, s.Reason)
	}
	span.End()
}

func (o tracing) ObserveStage(ctx context.Context, stage guard.Stage, events int, took time.Duration, err error) {
	o.Metrics.ObserveStage(ctx, stage, events, took, err)
	_, span := o.tracer.Start(ctx, "idem."+string(stage), trace.WithTimestamp(time.Now().Add(-took)),
		trace.WithAttributes(attribute.Int("idem.events", events)))
	if err != nil {
		span.RecordError(err)
		span.SetStatus(codes.Error, err.Error())
	}
	span.End()
}

// docs:end

// New wraps m so that it also traces, with tracer.
func New(m *metrics.Metrics, tracer trace.Tracer) interface {
	guard.Observer
	consumer.Observer
} {
	return tracing{Metrics: m, tracer: tracer}
}
