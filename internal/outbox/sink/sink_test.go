package sink

import (
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/outbox"
)

func TestAttributeKeysNameEveryAttribute(t *testing.T) {
	t.Parallel()
	e := outbox.Event{EventID: "id", AggregateType: "order", AggregateID: "o-1", EventType: "order.paid", OccurredAt: time.Unix(1, 0)}
	keys := AttributeKeys("ce-")
	attrs := CloudEvent(e)
	if len(attrs) != len(keys) {
		t.Errorf("CloudEvent returned %d attributes, AttributeKeys has %d", len(attrs), len(keys))
	}
	for _, a := range attrs {
		if keys[a.Name] != "ce-"+a.Name {
			t.Errorf("AttributeKeys[%q] = %q, want %q", a.Name, keys[a.Name], "ce-"+a.Name)
		}
	}
}
