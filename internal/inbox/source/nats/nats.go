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
	"github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/inbox/inboxconfig"
	"github.com/worker-dev/worker/internal/obs"
)

const (
	// idleWait bounds one pull that waits for a message when none is
	// waiting, so that Run notices its end soon.
	idleWait = 5 * time.Second
	// probeBase is the first wait before a reconnect.
	probeBase = 100 * time.Millisecond
	// pingInterval and maxPingsOut bound how long a server that stopped
	// answering (frozen, or cut off without a reset) goes unnoticed: the
	// client pings every pingInterval, and closes the connection as stale
	// when maxPingsOut pings are unanswered at the next one: within
	// (maxPingsOut+1) × pingInterval, 6s. The session then ends, and the
	// source reports itself down.
	pingInterval = 2 * time.Second
	maxPingsOut  = 2
)

// Source consumes a JetStream durable pull consumer into the inbox.
type Source struct {
	cfg      inboxconfig.NATSSource
	section  string // inbox.sources[<name>].nats, for errors
	name     string
	batch    int
	probeMax time.Duration
	shownURL string // cfg.URL without credentials
	log      *slog.Logger
}

var _ inbox.Source = (*Source)(nil)

// New checks src's nats section and returns the source; Run connects.
// batch_size and probe_backoff_max come from cfg.
func New(src inboxconfig.SourceConfig, cfg inboxconfig.Config, log *slog.Logger) (*Source, error) {
	section := "inbox.sources[" + src.Name + "].nats"
	if err := validate(section, src.NATS); err != nil {
		return nil, err
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	return &Source{
		cfg:      src.NATS,
		section:  section,
		name:     src.Name,
		batch:    max(cfg.BatchSize, 1),
		probeMax: max(cfg.ProbeBackoffMax, probeBase),
		shownURL: broker.RedactURLs(src.NATS.URL),
		log:      log.With("inbox_source", src.Name, "source_kind", inboxconfig.KindNATS),
	}, nil
}

func validate(section string, c inboxconfig.NATSSource) error {
	badName := func(s string) bool { return s == "" || strings.ContainsAny(s, ".*> \t\r\n") }
	switch {
	case c.URL == "":
		return fmt.Errorf("%s.url is empty: want nats://host:4222 (or a comma-separated list)", section)
	case badName(c.Stream):
		return fmt.Errorf("%s.stream=%q: want a stream name without '.', '*', '>' or whitespace", section, c.Stream)
	case badName(c.Consumer):
		return fmt.Errorf("%s.consumer=%q: want a durable consumer name without '.', '*', '>' or whitespace", section, c.Consumer)
	case strings.ContainsAny(c.FilterSubject, " \t\r\n"):
		return fmt.Errorf("%s.filter_subject=%q: want a subject without whitespace", section, c.FilterSubject)
	case c.ConnectTimeout < 100*time.Millisecond:
		return fmt.Errorf("%s.connect_timeout=%s: want at least 100ms", section, c.ConnectTimeout)
	case c.CreateConsumer && c.AckWait < time.Second:
		return fmt.Errorf("%s.ack_wait=%s: want at least 1s", section, c.AckWait)
	case c.CreateConsumer && c.MaxAckPending < 1:
		return fmt.Errorf("%s.max_ack_pending=%d: want at least 1", section, c.MaxAckPending)
	case c.Password != "" && c.User == "":
		return fmt.Errorf("%s.password is set without %s.user", section, section)
	case (c.TLSCertFile == "") != (c.TLSKeyFile == ""):
		return fmt.Errorf("%s.tls_cert_file and %s.tls_key_file: set both for a client certificate, or neither", section, section)
	}
	methods := 0
	for _, set := range []bool{c.User != "", c.Token != "", c.NKeySeedFile != "", c.CredsFile != ""} {
		if set {
			methods++
		}
	}
	if methods > 1 {
		return fmt.Errorf("%s: user, token, nkey_seed_file and creds_file are alternatives; set one", section)
	}
	return nil
}

// Run implements inbox.Source. Each session connects, finds the consumer
// and fetches until the connection fails; then the source is down, and
// the next session starts after a jittered backoff.
func (s *Source) Run(ctx context.Context, h inbox.Handoff) error {
	opts, err := s.options()
	if err != nil {
		return fmt.Errorf("%w: %w", broker.ErrSetup, err)
	}
	for failures := 0; ; {
		err := s.session(ctx, h, opts, &failures)
		switch {
		case ctx.Err() != nil:
			return nil
		case broker.Fatal(err):
			return err
		}
		h.Down(err)
		failures++
		if !obs.Sleep(ctx, obs.FullJitter(probeBase, s.probeMax, failures)) {
			return nil
		}
	}
}

// session is one connection: it returns when the connection fails or ctx
// ends. failures is reset once the consumer is found.
func (s *Source) session(ctx context.Context, h inbox.Handoff, opts []nats.Option, failures *int) error {
	// closing ends with ctx, or when the connection closes: a pull that
	// waits for messages returns at once then.
	closing, closed := context.WithCancel(ctx)
	defer closed()
	conn, err := nats.Connect(s.cfg.URL, append(opts, nats.ClosedHandler(func(*nats.Conn) { closed() }))...)
	if err != nil {
		if verdict := natsbroker.ConnectVerdict(s.section, s.shownURL, err); verdict != nil {
			return verdict
		}
		return fmt.Errorf("nats %s: %w", s.shownURL, err)
	}
	defer conn.Close()
	js, err := jetstream.New(conn)
	if err != nil {
		return err
	}
	cons, err := s.consumer(ctx, js)
	if err != nil {
		return err
	}
	info := cons.CachedInfo().Config
	// One fetch asks for no more than the consumer lets out at once: the
	// server holds a pull for more open, waiting for acks that only come
	// after this very batch, until the pull expires.
	batch := s.batch
	if info.MaxAckPending > 0 {
		batch = min(batch, info.MaxAckPending)
	}
	h.Up()
	*failures = 0
	acks := &ackLog{}
	defer s.reportLostAcks(acks)
	for {
		msgs, err := s.fetch(closing, cons, batch)
		switch {
		case ctx.Err() != nil:
			return ctx.Err()
		case conn.IsClosed():
			return s.closedError(conn)
		case err != nil:
			return fmt.Errorf("nats %s: fetching from %s/%s: %w", s.shownURL, s.cfg.Stream, s.cfg.Consumer, err)
		}
		if len(msgs) > 0 {
			s.process(ctx, h, msgs, info.AckWait, acks)
		}
	}
}

// closedError says why conn closed: the client's own verdict (a stale
// connection: the server stopped answering pings) when it has one.
func (s *Source) closedError(conn *nats.Conn) error {
	if err := conn.LastError(); err != nil {
		return fmt.Errorf("nats %s: connection closed: %w", s.shownURL, err)
	}
	return fmt.Errorf("nats %s: %w", s.shownURL, nats.ErrConnectionClosed)
}

// options are the connection's options: credentials and TLS from
// natsbroker.AuthOptions, as the outbox's NATS sink builds them. The client
// does not reconnect by itself: a lost connection ends the session, and
// Run reconnects with the inbox's backoff and reports the outage.
func (s *Source) options() ([]nats.Option, error) {
	log := s.log
	opts := []nats.Option{
		nats.Name("worker inbox " + s.name),
		nats.NoReconnect(),
		nats.Timeout(s.cfg.ConnectTimeout),
		nats.PingInterval(pingInterval),
		nats.MaxPingsOutstanding(maxPingsOut),
		nats.ErrorHandler(func(_ *nats.Conn, _ *nats.Subscription, err error) { log.Warn("nats error", "error", err.Error()) }),
	}
	c := s.cfg
	auth, err := natsbroker.AuthOptions(s.section, natsbroker.Auth{
		User: c.User, Password: c.Password, Token: c.Token, CredsFile: c.CredsFile, NKeySeedFile: c.NKeySeedFile,
		TLSCAFile: c.TLSCAFile, TLSCertFile: c.TLSCertFile, TLSKeyFile: c.TLSKeyFile,
	})
	if err != nil {
		return nil, err
	}
	return append(opts, auth...), nil
}

// consumer finds the durable consumer, creating or updating it first when
// create_consumer is set.
func (s *Source) consumer(ctx context.Context, js jetstream.JetStream) (jetstream.Consumer, error) {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.ConnectTimeout)
	defer cancel()
	stream, err := js.Stream(ctx, s.cfg.Stream)
	switch {
	case errors.Is(err, jetstream.ErrStreamNotFound):
		return nil, fmt.Errorf("%w: %s.stream=%q does not exist on %s", broker.ErrSetup, s.section, s.cfg.Stream, s.shownURL)
	case errors.Is(err, jetstream.ErrJetStreamNotEnabled), errors.Is(err, jetstream.ErrJetStreamNotEnabledForAccount):
		return nil, fmt.Errorf("%w: %s.url=%s: JetStream is not enabled for this account", broker.ErrSetup, s.section, s.shownURL)
	case err != nil:
		return nil, fmt.Errorf("nats %s: stream %s: %w", s.shownURL, s.cfg.Stream, err)
	}
	var cons jetstream.Consumer
	if s.cfg.CreateConsumer {
		cons, err = stream.CreateOrUpdateConsumer(ctx, jetstream.ConsumerConfig{
			Durable:       s.cfg.Consumer,
			AckPolicy:     jetstream.AckExplicitPolicy,
			AckWait:       s.cfg.AckWait,
			MaxAckPending: s.cfg.MaxAckPending,
			FilterSubject: s.cfg.FilterSubject,
			// A message nak'd busy comes back until its claim settles:
			// the inbox, not the server, decides when it is done.
			MaxDeliver: -1,
		})
		if refusedConfig(err) {
			return nil, fmt.Errorf("%w: %s.create_consumer: the server refused consumer %q on stream %q: %w",
				broker.ErrSetup, s.section, s.cfg.Consumer, s.cfg.Stream, err)
		}
	} else {
		cons, err = stream.Consumer(ctx, s.cfg.Consumer)
		if errors.Is(err, jetstream.ErrConsumerNotFound) {
			return nil, fmt.Errorf("%w: %s.consumer=%q does not exist on stream %q; create it (a durable pull consumer with explicit ack) or set %s.create_consumer=true",
				broker.ErrSetup, s.section, s.cfg.Consumer, s.cfg.Stream, s.section)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("nats %s: consumer %s/%s: %w", s.shownURL, s.cfg.Stream, s.cfg.Consumer, err)
	}
	info := cons.CachedInfo().Config
	switch {
	case info.DeliverSubject != "":
		return nil, fmt.Errorf("%w: %s.consumer=%q is a push consumer (deliver subject %q); want a pull consumer", broker.ErrSetup, s.section, s.cfg.Consumer, info.DeliverSubject)
	case info.AckPolicy != jetstream.AckExplicitPolicy:
		return nil, fmt.Errorf("%w: %s.consumer=%q has ack policy %s; want explicit, so that a message is acknowledged only after the inbox commit",
			broker.ErrSetup, s.section, s.cfg.Consumer, info.AckPolicy)
	}
	return cons, nil
}

// refusedConfig reports whether the server answered a consumer request
// with a refusal of the request itself (4xx), which no retry changes.
func refusedConfig(err error) bool {
	var api *jetstream.APIError
	return errors.As(err, &api) && api.Code >= 400 && api.Code < 500
}

// fetch returns the next batch: the messages waiting, at most batch, in
// one request. When none is waiting it waits for one, at most idleWait,
// and then takes what else is waiting with it.
func (s *Source) fetch(ctx context.Context, cons jetstream.Consumer, batch int) ([]jetstream.Msg, error) {
	msgs, err := collect(cons.FetchNoWait(batch))
	if err != nil || len(msgs) > 0 {
		return msgs, err
	}
	wctx, cancel := context.WithTimeout(ctx, idleWait)
	defer cancel()
	msgs, err = collect(cons.Fetch(1, jetstream.FetchContext(wctx)))
	switch {
	case ctx.Err() != nil:
		return nil, ctx.Err()
	case errors.Is(err, context.DeadlineExceeded):
		return nil, nil
	case err != nil || len(msgs) == 0 || batch == 1:
		return msgs, err
	}
	more, err := collect(cons.FetchNoWait(batch - 1))
	return append(msgs, more...), err
}

// collect reads a fetch's messages until the server ends the request.
func collect(b jetstream.MessageBatch, err error) ([]jetstream.Msg, error) {
	if err != nil {
		return nil, err
	}
	var msgs []jetstream.Msg
	for m := range b.Messages() {
		msgs = append(msgs, m)
	}
	return msgs, b.Error()
}
