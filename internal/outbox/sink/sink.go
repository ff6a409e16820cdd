// Package sink holds what the broker sinks (sink/nats, ...) share: the
// CloudEvents attributes of an event and the templates that name a
// subject, routing key or topic after it. Each broker's wire convention
// is in internal/broker/<name>, shared with the inbox's sources.
package sink

import (
	"fmt"
	"strings"
	"time"

	"github.com/worker-dev/worker/internal/broker"
	"github.com/worker-dev/worker/internal/outbox"
)

// CloudEvent returns e's CloudEvents attributes: id = event_id, source =
// aggregate_type, subject = aggregate_id, type = event_type, time =
// occurred_at.
func CloudEvent(e outbox.Event) broker.Attributes {
	a := broker.Attributes{ID: e.EventID, Source: e.AggregateType, Type: e.EventType, Subject: e.AggregateID}
	if !e.OccurredAt.IsZero() {
		a.Time = e.OccurredAt.UTC().Format(time.RFC3339Nano)
	}
	return a
}

// Template names a subject, routing key or topic after an event. It is
// text with placeholders: {aggregate_type}, {aggregate_id}, {event_type},
// and the fixed values the sink passes (such as {prefix}). Event values go
// through the sink's escape function, fixed values do not.
type Template struct {
	parts  []templatePart
	escape func(string) string
	fixed  int // bytes of literal text, to size a rendered name at once
}

type templatePart struct {
	text  string
	field func(outbox.Event) string // nil for literal text
}

var eventFields = map[string]func(outbox.Event) string{
	"aggregate_type": func(e outbox.Event) string { return e.AggregateType },
	"aggregate_id":   func(e outbox.Event) string { return e.AggregateID },
	"event_type":     func(e outbox.Event) string { return e.EventType },
}

// ParseTemplate parses text; key names the setting in errors.
func ParseTemplate(key, text string, fixed map[string]string, escape func(string) string) (*Template, error) {
	t := &Template{escape: escape}
	rest := text
	for rest != "" {
		open := strings.IndexByte(rest, '{')
		if open < 0 {
			t.parts = append(t.parts, templatePart{text: rest})
			break
		}
		closing := strings.IndexByte(rest[open:], '}')
		if closing < 0 {
			return nil, fmt.Errorf("%s=%q: unclosed '{'", key, text)
		}
		name := rest[open+1 : open+closing]
		if open > 0 {
			t.parts = append(t.parts, templatePart{text: rest[:open]})
		}
		switch v, isFixed := fixed[name]; {
		case isFixed:
			t.parts = append(t.parts, templatePart{text: v})
		case eventFields[name] != nil:
			t.parts = append(t.parts, templatePart{field: eventFields[name]})
		default:
			return nil, fmt.Errorf("%s=%q: unknown placeholder {%s}; want %s", key, text, name, placeholders(fixed))
		}
		rest = rest[open+closing+1:]
	}
	for _, p := range t.parts {
		t.fixed += len(p.text)
	}
	return t, nil
}

func placeholders(fixed map[string]string) string {
	names := []string{"{aggregate_type}", "{aggregate_id}", "{event_type}"}
	for name := range fixed {
		names = append(names, "{"+name+"}")
	}
	return strings.Join(names, ", ")
}

// Render returns the name for e. It runs once per event, so the name is
// built in one allocation unless escaping lengthens a value.
func (t *Template) Render(e outbox.Event) string {
	var b strings.Builder
	b.Grow(t.fixed + len(e.AggregateType) + len(e.AggregateID) + len(e.EventType))
	for _, p := range t.parts {
		if p.field == nil {
			b.WriteString(p.text)
		} else {
			b.WriteString(t.escape(p.field(e)))
		}
	}
	return b.String()
}

// Prefix returns the literal text before the first event placeholder, and
// whether the template has no event placeholder at all. That text is the
// part of every name no event can choose, which is what a sink checks
// against the names its broker keeps for itself.
func (t *Template) Prefix() (text string, literal bool) {
	var b strings.Builder
	for _, p := range t.parts {
		if p.field != nil {
			return b.String(), false
		}
		b.WriteString(p.text)
	}
	return b.String(), true
}

// Pattern returns the template with every event placeholder replaced by
// wildcard, for a check or a filter that must match every rendered name.
func (t *Template) Pattern(wildcard string) string {
	var b strings.Builder
	for _, p := range t.parts {
		if p.field == nil {
			b.WriteString(p.text)
		} else {
			b.WriteString(wildcard)
		}
	}
	return b.String()
}
