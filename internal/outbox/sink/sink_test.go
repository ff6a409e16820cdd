package sink

import (
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/broker"
	"github.com/worker-dev/worker/internal/outbox"
)

func TestCloudEventNamesEveryAttribute(t *testing.T) {
	t.Parallel()
	e := outbox.Event{EventID: "id", AggregateType: "order", AggregateID: "o-1", EventType: "order.paid", OccurredAt: time.Unix(1, 0)}
	keys := broker.Keys("ce-")
	attrs := CloudEvent(e).List()
	if len(attrs) != len(keys) {
		t.Errorf("CloudEvent returned %d attributes, Keys has %d", len(attrs), len(keys))
	}
	for _, a := range attrs {
		if keys[a.Name] != "ce-"+a.Name {
			t.Errorf("Keys[%q] = %q, want %q", a.Name, keys[a.Name], "ce-"+a.Name)
		}
	}
}

// Prefix is the text before the first event value: fixed values count as
// literal text.
func TestTemplatePrefix(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		text, prefix string
		literal      bool
	}{
		{"{prefix}.{aggregate_type}.{event_type}", "outbox.", false},
		{"{aggregate_type}.{event_type}", "", false},
		{"a{prefix}b{event_type}.c", "aoutboxb", false},
		{"fixed.name", "fixed.name", true},
		{"{prefix}", "outbox", true},
	} {
		tmpl, err := ParseTemplate("k", c.text, map[string]string{"prefix": "outbox"}, func(v string) string { return v })
		if err != nil {
			t.Fatal(err)
		}
		if prefix, literal := tmpl.Prefix(); prefix != c.prefix || literal != c.literal {
			t.Errorf("%q: Prefix() = %q, %v; want %q, %v", c.text, prefix, literal, c.prefix, c.literal)
		}
	}
}
