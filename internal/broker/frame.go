package broker

import (
	"cmp"
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/idemhq/idem/internal/wire"
)

// A message's properties and headers travel in one header frame, which
// AMQP never splits. RabbitMQ answers a frame larger than the connection's
// negotiated frame_max with FRAME_ERROR and closes the whole connection,
// every publish in flight on it included; so a publisher measures the
// header frame before it writes one.

// frameOverhead is a frame's type, channel, size and frame-end octets.
const frameOverhead = 1 + 2 + 4 + 1

// headerFrameSize is the size of the header frame amqp091 writes for p,
// overhead included: class, weight, body size and property flags, then
// each property that is set.
func headerFrameSize(p amqp.Publishing) int {
	n := frameOverhead + 2 + 2 + 8 + 2
	for _, s := range []string{p.ContentType, p.ContentEncoding, p.CorrelationId, p.ReplyTo,
		p.Expiration, p.MessageId, p.Type, p.UserId, p.AppId} {
		if s != "" {
			n += 1 + len(s)
		}
	}
	if len(p.Headers) > 0 {
		n += tableSize(p.Headers)
	}
	if p.DeliveryMode > 0 {
		n++
	}
	if p.Priority > 0 {
		n++
	}
	if !p.Timestamp.IsZero() {
		n += 8
	}
	return n
}

// tableSize is the encoded size of a field table, its length included.
func tableSize(t amqp.Table) int {
	n := 4
	for k, v := range t {
		n += entrySize(k, v)
	}
	return n
}

// entrySize is the encoded size of one table entry: its name, a short
// string, and its value.
func entrySize(k string, v any) int { return 1 + len(k) + fieldSize(v) }

// fieldSize is the encoded size of a field value, its type octet included,
// as amqp091's writeField encodes it.
func fieldSize(v any) int {
	switch v := v.(type) {
	case bool, byte, int8:
		return 2
	case int16, uint16:
		return 3
	case int, int32, uint32, float32:
		return 5
	case int64, float64, time.Time:
		return 9
	case amqp.Decimal:
		return 6
	case string:
		return 5 + len(v)
	case []byte:
		return 5 + len(v)
	case []any:
		n := 5
		for _, e := range v {
			n += fieldSize(e)
		}
		return n
	case amqp.Table:
		return 1 + tableSize(v)
	}
	return 1 // nil; any other type fails Table.Validate first
}

// HeaderHeadersDropped names, on a message whose headers were cut to fit
// the broker's frame_max, the headers that were dropped.
const HeaderHeadersDropped = wire.HeaderHeadersDropped

// maxDroppedList bounds HeaderHeadersDropped's value.
const maxDroppedList = 512

// fit drops headers of p that keep refuses, largest first, until p's
// header frame, with HeaderHeadersDropped naming what went, is at most
// limit bytes. It returns the names it dropped, none if p fits as it is,
// and an error if the headers keep holds are too large by themselves (p is
// then unchanged).
func fit(p *amqp.Publishing, limit int, keep func(name string) bool) ([]string, error) {
	size := headerFrameSize(*p)
	if size <= limit {
		return nil, nil
	}
	var droppable []string
	for k := range p.Headers {
		if k != HeaderHeadersDropped && !keep(k) {
			droppable = append(droppable, k)
		}
	}
	// Largest first, so that as few go as may; by name on a tie, so that
	// the same message always loses the same headers.
	slices.SortFunc(droppable, func(a, b string) int {
		return cmp.Or(cmp.Compare(entrySize(b, p.Headers[b]), entrySize(a, p.Headers[a])), strings.Compare(a, b))
	})
	h := maps.Clone(p.Headers)
	if v, ok := h[HeaderHeadersDropped]; ok { // an earlier cut's list is rewritten
		size -= entrySize(HeaderHeadersDropped, v)
		delete(h, HeaderHeadersDropped)
	}
	var list strings.Builder // the names an earlier cut dropped, then these
	earlier, _ := p.Headers[HeaderHeadersDropped].(string)
	list.WriteString(earlier)
	for i, k := range droppable {
		size -= entrySize(k, h[k])
		delete(h, k)
		if list.Len() <= maxDroppedList {
			if list.Len() > 0 {
				list.WriteString(", ")
			}
			list.WriteString(k)
		}
		mark := list.String()
		if len(mark) > maxDroppedList {
			mark = mark[:maxDroppedList-len("…")] + "…"
		}
		if size+entrySize(HeaderHeadersDropped, mark) <= limit {
			h[HeaderHeadersDropped] = mark
			p.Headers = h
			return droppable[:i+1], nil
		}
	}
	return nil, fmt.Errorf("the header frame is %d bytes with every header it may drop gone, more than the broker's frame_max allows (%d)", size, limit)
}
