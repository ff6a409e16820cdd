// Package nats is the NATS JetStream sink (outbox.sink: nats): each event is
// one message on a subject named after it, with Nats-Msg-Id = event_id and
// the CloudEvents attributes as ce- headers, published asynchronously and
// reported published only once the stream has acknowledged it.
package nats

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"time"

	"github.com/nats-io/nats.go"
	"github.com/nats-io/nats.go/jetstream"

	"github.com/worker-dev/worker/internal/broker"
	natsbroker "github.com/worker-dev/worker/internal/broker/nats"
	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
	"github.com/worker-dev/worker/internal/outbox/sink"
)

// reconnectWait is the pause between reconnect attempts; the client retries
// for ever, and publishes in the meantime fail at once (see options).
const reconnectWait = 500 * time.Millisecond

// Sink publishes events to a JetStream stream. It is safe for concurrent
// Publish: every call waits for its own ack, so many calls in flight
// pipeline on the one connection.
type Sink struct {
	cfg      outboxconfig.NATSConfig
	subject  *sink.Template
	log      *slog.Logger
	name     string
	shownURL string // cfg.URL without credentials, for errors and logs
	minDedup time.Duration
	pubOpts  []jetstream.PublishOpt // the same for every message, built once

	conn *nats.Conn
	js   jetstream.JetStream
}

// Options are what the sink needs beside its configuration section.
type Options struct {
	// Name identifies the connection on the server (`nats server report
	// connections`).
	Name string
	// RedeliveryGap is the longest time after which the relay may publish an
	// event again; a stream whose duplicate window is shorter gets a warning
	// at Connect, because a redelivery after the window is a duplicate.
	RedeliveryGap time.Duration
	Logger        *slog.Logger
}

// New checks cfg and returns an unconnected sink; Connect connects it.
func New(cfg outboxconfig.NATSConfig, opts Options) (*Sink, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if err := natsbroker.ValidSubject("outbox.nats.subject_prefix", cfg.SubjectPrefix); err != nil {
		return nil, err
	}
	tmpl, err := sink.ParseTemplate("outbox.nats.subject", cfg.Subject, map[string]string{"prefix": cfg.SubjectPrefix}, natsbroker.SubjectToken)
	if err != nil {
		return nil, err
	}
	if err := natsbroker.ValidSubject("outbox.nats.subject", tmpl.Pattern("x")); err != nil {
		return nil, err
	}
	if err := checkFirstToken(cfg, tmpl); err != nil {
		return nil, err
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Sink{
		cfg:      cfg,
		subject:  tmpl,
		log:      log.With("sink", outboxconfig.SinkNATS),
		name:     opts.Name,
		shownURL: broker.RedactURLs(cfg.URL),
		minDedup: opts.RedeliveryGap,
		pubOpts: []jetstream.PublishOpt{
			jetstream.WithExpectStream(cfg.Stream),
			jetstream.WithStallWait(cfg.PublishTimeout),
			// The client would resend a message answered "no responders"
			// from a timer, possibly after Publish returned and the relay
			// moved on: the relay retries instead, knowing it did.
			jetstream.WithRetryAttempts(0),
		},
	}, nil
}

// checkFirstToken refuses a subject template whose first token an event
// could choose, or one the server keeps for itself. The server answers
// subjects starting with '$' ($JS.API.STREAM.DELETE..., $SYS, $KV, ...),
// and '_' starts the reply subjects (_INBOX, where publish acks come back;
// _R_ and _GR_, the server's own). With an event value as the first
// token, a producer's row picks among them: ('$JS', 'API', 'INFO') is a
// JetStream API request, and a stream made for '*.*.*' also stores the
// acks sent to inboxes. A first token written by the operator keeps every
// event in one namespace, which the stream's filter names.
func checkFirstToken(cfg outboxconfig.NATSConfig, tmpl *sink.Template) error {
	prefix, literal := tmpl.Prefix()
	first, _, whole := strings.Cut(prefix, ".")
	if !whole && !literal {
		return fmt.Errorf("%s=%q: the first token must be literal text, as in the default {prefix}.{aggregate_type}.{event_type}: "+
			"an event value there would choose the subject's namespace, the server's own ($JS.API..., _INBOX...) included",
			"outbox.nats.subject", cfg.Subject)
	}
	if strings.HasPrefix(first, "$") || strings.HasPrefix(first, "_") {
		key, value := "outbox.nats.subject", cfg.Subject
		if strings.HasPrefix(cfg.Subject, "{prefix}") {
			key, value = "outbox.nats.subject_prefix", cfg.SubjectPrefix
		}
		return fmt.Errorf("%s=%q: the subject's first token %q starts with %q: "+
			"want one that starts with neither '$' (the server's own subjects: $JS, $SYS, $KV, ...) nor '_' (reply subjects: _INBOX, ...)",
			key, value, first, first[:1])
	}
	return nil
}

// Name implements outbox.Sink.
func (s *Sink) Name() string { return outboxconfig.SinkNATS }

// Subject returns the subject e is published on.
func (s *Sink) Subject(e outbox.Event) string { return s.subject.Render(e) }

// Connect connects and checks the stream, retrying until ctx ends. Its
// errors wrap broker.ErrUnreachable, broker.ErrRefused or broker.ErrSetup.
func (s *Sink) Connect(ctx context.Context) error {
	opts, err := s.options()
	if err != nil {
		return fmt.Errorf("%w: %w", broker.ErrSetup, err)
	}
	var last error
	for wait := 100 * time.Millisecond; ; wait = min(2*wait, 2*time.Second) {
		last = s.connectOnce(ctx, opts)
		if last == nil || broker.Fatal(last) {
			return last
		}
		s.log.Warn("nats not ready yet", "error", last.Error(), "retry_in", wait.String())
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w: nats %s: %w", broker.ErrUnreachable, s.shownURL, last)
		case <-time.After(wait):
		}
	}
}

func (s *Sink) connectOnce(ctx context.Context, opts []nats.Option) error {
	dial := 2 * time.Second
	if d, ok := ctx.Deadline(); ok {
		dial = max(min(dial, time.Until(d)), 10*time.Millisecond)
	}
	conn, err := nats.Connect(s.cfg.URL, append(opts, nats.Timeout(dial))...)
	if err != nil {
		if verdict := natsbroker.ConnectVerdict("outbox.nats", s.shownURL, err); verdict != nil {
			return verdict
		}
		return err
	}
	js, err := jetstream.New(conn,
		jetstream.WithPublishAsyncMaxPending(s.cfg.MaxPending),
		jetstream.WithPublishAsyncTimeout(s.cfg.PublishTimeout))
	if err == nil {
		err = s.checkStream(ctx, js)
	}
	if err != nil {
		conn.Close()
		return err
	}
	s.conn, s.js = conn, js
	return nil
}

func (s *Sink) options() ([]nats.Option, error) {
	log := s.log
	opts := []nats.Option{
		nats.Name(s.name),
		nats.MaxReconnects(-1),
		nats.ReconnectWait(reconnectWait),
		// No reconnect buffer: a publish while the connection is down fails
		// at once (ErrReconnectBufExceeded) instead of waiting in the
		// client and going out on reconnect, behind the relay's back.
		nats.ReconnectBufSize(-1),
		nats.DisconnectErrHandler(func(_ *nats.Conn, err error) {
			if err != nil {
				log.Warn("nats disconnected", "error", err.Error())
			}
		}),
		nats.ReconnectHandler(func(c *nats.Conn) { log.Info("nats reconnected", "server", c.ConnectedUrlRedacted()) }),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) { log.Warn("nats error", "error", err.Error()) }),
	}
	c := s.cfg
	auth, err := natsbroker.AuthOptions("outbox.nats", natsbroker.Auth{
		User: c.User, Password: c.Password, Token: c.Token, CredsFile: c.CredsFile, NKeySeedFile: c.NKeySeedFile,
		TLSCAFile: c.TLSCAFile, TLSCertFile: c.TLSCertFile, TLSKeyFile: c.TLSKeyFile,
	})
	if err != nil {
		return nil, err
	}
	return append(opts, auth...), nil
}

// checkStream finds (or creates) the stream and warns when its duplicate
// window is shorter than the relay's longest redelivery gap.
func (s *Sink) checkStream(ctx context.Context, js jetstream.JetStream) error {
	stream, err := js.Stream(ctx, s.cfg.Stream)
	switch {
	case errors.Is(err, jetstream.ErrStreamNotFound) && s.cfg.CreateStream:
		stream, err = js.CreateStream(ctx, jetstream.StreamConfig{
			Name:       s.cfg.Stream,
			Subjects:   []string{s.streamSubjects()},
			Storage:    jetstream.FileStorage,
			Duplicates: max(2*time.Minute, s.minDedup),
		})
		if err != nil {
			return fmt.Errorf("%w: outbox.nats.create_stream: creating stream %q: %w", broker.ErrSetup, s.cfg.Stream, err)
		}
		s.log.Info("nats stream created", "stream", s.cfg.Stream, "subjects", s.streamSubjects())
	case errors.Is(err, jetstream.ErrStreamNotFound):
		return fmt.Errorf("%w: outbox.nats.stream=%q does not exist; create it for subjects %q or set outbox.nats.create_stream=true",
			broker.ErrSetup, s.cfg.Stream, s.streamSubjects())
	case errors.Is(err, jetstream.ErrJetStreamNotEnabled), errors.Is(err, jetstream.ErrJetStreamNotEnabledForAccount):
		return fmt.Errorf("%w: outbox.nats.url=%s: JetStream is not enabled for this account", broker.ErrSetup, s.shownURL)
	case err != nil:
		return err
	}
	if window := stream.CachedInfo().Config.Duplicates; window < s.minDedup {
		s.log.Warn("nats stream duplicate window is shorter than the relay's longest redelivery gap: a late redelivery is stored twice; raise the stream's duplicate_window",
			"stream", s.cfg.Stream, "duplicate_window", window.String(), "redelivery_gap", s.minDedup.String())
	}
	return nil
}

// streamSubjects is the subject filter that matches every subject the
// template renders: event tokens become '*'.
func (s *Sink) streamSubjects() string {
	toks := strings.Split(s.subject.Pattern("\x00"), ".")
	for i, t := range toks {
		if strings.Contains(t, "\x00") {
			toks[i] = "*"
		}
	}
	return strings.Join(toks, ".")
}

// Publish implements outbox.Sink: one message, acknowledged by the stream.
// A duplicate ack (the stream already holds this Nats-Msg-Id) is success.
func (s *Sink) Publish(ctx context.Context, e outbox.Event) error {
	if s.js == nil {
		return outbox.Unavailable(errors.New("nats: publish before Connect"))
	}
	msg := &nats.Msg{Subject: s.subject.Render(e), Data: e.Payload, Header: headers(e)}
	ack, err := s.js.PublishMsgAsync(msg, s.pubOpts...)
	if err != nil {
		return s.failure(e, err)
	}
	select {
	case <-ack.Ok():
		return nil
	case err := <-ack.Err():
		return s.failure(e, err)
	case <-ctx.Done():
		// Sent, not acknowledged: the outcome is unknown. The stream
		// deduplicates the retry on Nats-Msg-Id.
		return outbox.Unavailable(fmt.Errorf("nats: event %s: waiting for the ack: %w", e.EventID, ctx.Err()))
	}
}

// failure classifies a publish error (see docs/sinks.md):
//   - permanent: what the server refuses about the message itself, its
//     size, its headers' size, its subject;
//   - unavailable: the connection down or reconnecting, no responders (no
//     stream leader), no ack within the publish timeout (the outcome is
//     unknown), a stalled producer, a stream that cannot store (full,
//     offline, out of resources);
//   - otherwise a failure of this event, counted toward max_attempts.
func (s *Sink) failure(e outbox.Event, err error) error {
	err = fmt.Errorf("nats: event %s to %s: %w", e.EventID, s.cfg.Stream, err)
	var api *jetstream.APIError
	switch {
	case errors.Is(err, nats.ErrMaxPayload), errors.Is(err, nats.ErrBadSubject), errors.Is(err, nats.ErrHeadersNotSupported):
		return outbox.Permanent(err)
	case errors.As(err, &api) && permanentCodes[api.ErrorCode]:
		return outbox.Permanent(err)
	case errors.As(err, &api) && (api.Code >= 500 || unavailableCodes[api.ErrorCode]):
		return outbox.Unavailable(err)
	case errors.As(err, &api):
		return err
	case unavailable(err):
		return outbox.Unavailable(err)
	}
	return err
}

// unavailable reports whether a client error says the server, not the
// message, is the problem.
func unavailable(err error) bool {
	for _, u := range []error{
		nats.ErrReconnectBufExceeded, // disconnected, and the reconnect buffer is off
		nats.ErrDisconnected, nats.ErrConnectionClosed, nats.ErrConnectionReconnecting,
		nats.ErrConnectionDraining, nats.ErrStaleConnection, nats.ErrNoServers,
		nats.ErrNoResponders, jetstream.ErrNoStreamResponse, // no stream leader
		nats.ErrTimeout, jetstream.ErrAsyncPublishTimeout, // sent, outcome unknown
		jetstream.ErrTooManyStalledMsgs, // the acks before it did not come
	} {
		if errors.Is(err, u) {
			return true
		}
	}
	return outbox.IsUnavailable(err)
}

// permanentCodes are JetStream refusals of the message itself: no retry
// can change them.
var permanentCodes = map[jetstream.ErrorCode]bool{
	jetstream.JSErrCodeStreamMessageExceedsMaximum: true,
	10097: true, // header size exceeds maximum allowed
	10060: true, // expected stream does not match: the subject belongs to another stream
}

// unavailableCodes are JetStream refusals about the stream's capacity that
// the server answers without a 5xx code.
var unavailableCodes = map[jetstream.ErrorCode]bool{
	10002: true, // resource limits exceeded for account
	10047: true, // insufficient storage resources available
	10028: true, // insufficient memory resources available
}

// headers carries the message id (Nats-Msg-Id = event_id, which the stream
// deduplicates on), the CloudEvents attributes (binary mode, ce- headers,
// values percent-encoded as in the HTTP binding) and the stored headers.
// Stored headers go first, so the ones the protocol owns win.
func headers(e outbox.Event) nats.Header {
	n := len(e.Headers) + len(broker.Names) + 2
	h := make(nats.Header, n)
	// Every header has one value: they share one backing array instead of
	// one allocation each.
	values := make([]string, 0, n)
	set := func(k, v string) {
		values = append(values, v)
		h[k] = values[len(values)-1 : len(values) : len(values)]
	}
	for k, v := range e.Headers {
		if passThrough(k, v) {
			set(k, v)
		}
	}
	set(jetstream.MsgIDHeader, e.EventID)
	set("content-type", broker.ContentType)
	natsbroker.Encode(sink.CloudEvent(e), set)
	return h
}

// passThrough reports whether a stored header may travel: not one the
// protocol owns (ce-*, Nats-*, content-type), and a name and value the
// NATS header block can carry.
func passThrough(name, value string) bool {
	n := strings.ToLower(name)
	if strings.HasPrefix(n, "ce-") || strings.HasPrefix(n, "nats-") || n == "content-type" || n == "" {
		return false
	}
	bad := func(r rune) bool { return r < ' ' || r == 0x7f }
	return !strings.ContainsFunc(name, func(r rune) bool { return bad(r) || r == ' ' || r == ':' }) &&
		!strings.ContainsFunc(value, func(r rune) bool { return bad(r) && r != '\t' })
}

// Ready reports whether the connection is up, for /readyz.
func (s *Sink) Ready(context.Context) error {
	if s.conn == nil {
		return errors.New("nats: not connected")
	}
	if st := s.conn.Status(); st != nats.CONNECTED {
		return fmt.Errorf("nats: connection %s", strings.ToLower(st.String()))
	}
	return nil
}

// Close closes the connection. The relay has stopped, so every publish has
// its answer or has given up on it.
func (s *Sink) Close(context.Context) error {
	if s.conn != nil {
		s.conn.Close()
	}
	return nil
}
