package nats

import (
	"strings"
	"testing"
	"time"

	"github.com/nats-io/nats.go"

	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
	"github.com/worker-dev/worker/internal/outbox/sinktest"
)

// A subject template whose first token an event could choose, or whose
// first token is one of the server's namespaces, is refused by New, naming
// the key and the rule.
func TestSubjectTemplateStaysOutOfServerNamespaces(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		subject, prefix string
		want            string // "" when accepted
	}{
		{"{prefix}.{aggregate_type}.{event_type}", "outbox", ""},
		{"events.{aggregate_type}.{aggregate_id}.{event_type}", "outbox", ""},
		{"{prefix}.{aggregate_type}", "a.$b._c", ""}, // only the first token is the server's
		{"fixed", "outbox", ""},
		{"{aggregate_type}.{aggregate_id}.{event_type}", "outbox", `outbox.nats.subject="{aggregate_type}.{aggregate_id}.{event_type}": the first token must be literal text`},
		{"x{aggregate_type}.{event_type}", "outbox", `outbox.nats.subject="x{aggregate_type}.{event_type}": the first token must be literal text`},
		{"{event_type}", "outbox", "the first token must be literal text"},
		{"$JS.{aggregate_type}.{event_type}", "outbox", `outbox.nats.subject="$JS.{aggregate_type}.{event_type}": the subject's first token "$JS" starts with "$"`},
		{"_INBOX.{aggregate_type}", "outbox", `outbox.nats.subject="_INBOX.{aggregate_type}": the subject's first token "_INBOX" starts with "_"`},
		{"$SYS", "outbox", `the subject's first token "$SYS" starts with "$"`},
		{"{prefix}.{aggregate_type}.{event_type}", "$JS.API", `outbox.nats.subject_prefix="$JS.API": the subject's first token "$JS" starts with "$"`},
		{"{prefix}.{aggregate_type}.{event_type}", "_INBOX", `outbox.nats.subject_prefix="_INBOX"`},
	} {
		cfg := outboxconfig.DefaultNATSConfig()
		cfg.Subject, cfg.SubjectPrefix = c.subject, c.prefix
		_, err := New(cfg, Options{})
		switch {
		case c.want == "" && err != nil:
			t.Errorf("%q with prefix %q: %v", c.subject, c.prefix, err)
		case c.want != "" && (err == nil || !strings.Contains(err.Error(), c.want)):
			t.Errorf("%q with prefix %q: got %v, want an error with %q", c.subject, c.prefix, err, c.want)
		case c.want != "" && !strings.Contains(err.Error(), "'$'") && !strings.Contains(err.Error(), "$JS.API"):
			t.Errorf("%q: the error does not say what is refused: %v", c.subject, err)
		}
	}
}

// Events whose values spell the server's own subjects ($JS.API.INFO, a
// reply inbox) land escaped on the stream, under the configured first
// token, and nothing reaches the server's API or the inbox namespace.
func TestEventValuesStayOutOfServerNamespaces(t *testing.T) {
	t.Parallel()
	tg, _ := newTargetInProcess(t)
	tg.createStream(t, 0)
	cfg := tg.config()
	cfg.Subject = "{prefix}.{aggregate_type}.{aggregate_id}.{event_type}"
	s := connect(t, cfg)

	// A plain client watches where the values would have gone unescaped.
	nc, err := nats.Connect(tg.url, nats.UserInfo(tg.user, tg.password))
	if err != nil {
		t.Fatal(err)
	}
	defer nc.Close()
	// Roomy: the sink's acks and the test's own API requests and replies
	// come through these subscriptions too.
	reached := make(chan *nats.Msg, 1024)
	for _, subj := range []string{"$JS.API.>", "_INBOX.>", "*.$JS.>", "*.*.$JS.>", "*._INBOX.>"} {
		if _, err := nc.ChanSubscribe(subj, reached); err != nil {
			t.Fatal(err)
		}
	}
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}

	js := tg.js(t)
	events := map[string]outbox.Event{
		tg.prefix + ".%24JS.API.INFO":   {AggregateType: "$JS", AggregateID: "API", EventType: "INFO"},
		tg.prefix + ".%5FINBOX.x.y":     {AggregateType: "_INBOX", AggregateID: "x", EventType: "y"},
		tg.prefix + ".order.%24JS.INFO": {AggregateType: "order", AggregateID: "$JS", EventType: "INFO"},
	}
	for subject, e := range events {
		e.EventID, e.Payload, e.OccurredAt = sinktest.Event(e.AggregateID, 0).EventID, []byte(`{}`), time.Now()
		if got := s.Subject(e); got != subject {
			t.Errorf("subject %q, want %q", got, subject)
		}
		if err := s.Publish(t.Context(), e); err != nil {
			t.Fatalf("publish %s: %v", subject, err)
		}
		st, err := js.Stream(t.Context(), tg.stream)
		if err != nil {
			t.Fatal(err)
		}
		msg, err := st.GetLastMsgForSubject(t.Context(), subject)
		if err != nil {
			t.Errorf("%s is not on the stream: %v", subject, err)
		} else if msg.Header.Get("Nats-Msg-Id") != e.EventID {
			t.Errorf("%s holds %v, want event %s", subject, msg.Header, e.EventID)
		}
	}
	// Every publish was acknowledged, so the server has routed it; the
	// flush's round trip then comes after anything it routed to nc.
	if err := nc.Flush(); err != nil {
		t.Fatal(err)
	}
	for len(reached) > 0 {
		// The sink's acks and the JetStream requests carry no event id;
		// an event's message would.
		if m := <-reached; m.Header.Get("Nats-Msg-Id") != "" {
			t.Errorf("an event reached %s", m.Subject)
		}
	}
}
