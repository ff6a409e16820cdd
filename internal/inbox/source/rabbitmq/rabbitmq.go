// Package rabbitmq is the RabbitMQ inbox source (inbox.sources[].kind:
// rabbitmq): it consumes one queue with manual acknowledgements and a
// prefetch limit, hands what is buffered to the inbox as one batch, and
// acknowledges each message only once the inbox has committed what became
// of it. A lost connection leaves the unacknowledged messages with the
// broker, which delivers them again; the inbox finds those it committed to
// be duplicates. So do acks a quorum queue drops when they arrive just
// before the connection closes (rabbitmq-server#10327): the messages come
// again, and are duplicates.
package rabbitmq

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"net"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/worker-dev/worker/internal/broker"
	rabbitmqbroker "github.com/worker-dev/worker/internal/broker/rabbitmq"
	"github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/inbox/inboxconfig"
	"github.com/worker-dev/worker/internal/obs"
)

const (
	// linger bounds the wait for more deliveries once one has arrived: the
	// broker streams a prefetch window in quick succession, and a fuller
	// batch costs the inbox fewer transactions, but a lone message must
	// not wait for company.
	linger = 2 * time.Millisecond
	// probeBase is the first reconnect's backoff ceiling; the cap is
	// inbox.probe_backoff_max.
	probeBase = 100 * time.Millisecond
)

// Options are what the source needs beside its configuration section.
type Options struct {
	// Name is the inbox source's name: the connection's name in the
	// management UI, and the configuration key in errors.
	Name string
	// BatchSize bounds a batch (inbox.batch_size); so does half the
	// prefetch. 0 means inbox's default.
	BatchSize int
	// ProbeBackoffMax caps the wait between reconnects
	// (inbox.probe_backoff_max). 0 means inbox's default.
	ProbeBackoffMax time.Duration
}

// Source consumes one queue. Run may be called once at a time.
type Source struct {
	cfg      inboxconfig.RabbitMQSource
	batch    int
	probeMax time.Duration
	section  string // configuration key, for errors
	shownURL string // URL without credentials
	amqpCfg  amqp.Config
}

var _ inbox.Source = (*Source)(nil)

// New checks cfg and returns an unconnected source.
func New(cfg inboxconfig.RabbitMQSource, opts Options) (*Source, error) {
	def := inboxconfig.DefaultConfig()
	s := &Source{
		cfg:      cfg,
		probeMax: cmp.Or(opts.ProbeBackoffMax, def.ProbeBackoffMax),
		section:  fmt.Sprintf("inbox.sources[%s].rabbitmq", opts.Name),
		shownURL: broker.RedactURLs(cfg.URL),
	}
	switch {
	case cfg.Queue == "":
		return nil, fmt.Errorf("%s.queue is empty: name the queue to consume", s.section)
	case cfg.Prefetch < 1 || cfg.Prefetch > 65535:
		return nil, fmt.Errorf("%s.prefetch=%d: want 1 to 65535", s.section, cfg.Prefetch)
	case cfg.ConnectTimeout <= 0:
		return nil, fmt.Errorf("%s.connect_timeout=%s: want a positive duration such as 30s", s.section, cfg.ConnectTimeout)
	}
	// At most half the prefetch: the broker sends the next batch while
	// this one is processed, so it is waiting, whole, when this one is
	// acknowledged. A batch of the whole prefetch would start with what
	// the acks just freed, which trickles in (measured: twice the
	// throughput with the next batch waiting, BenchmarkInboxRabbitMQ).
	s.batch = min(cmp.Or(opts.BatchSize, def.BatchSize), max(cfg.Prefetch/2, 1))
	uri, err := amqp.ParseURI(cfg.URL)
	if err != nil {
		return nil, fmt.Errorf("%s.url=%q: %v", s.section, s.shownURL, err)
	}
	s.amqpCfg = amqp.Config{
		Heartbeat:  10 * time.Second,
		Properties: amqp.Table{"connection_name": "inbox " + opts.Name},
	}
	if s.amqpCfg.TLSClientConfig, err = rabbitmqbroker.TLS(s.section, uri, s.shownURL, cfg.TLSCAFile, cfg.TLSCertFile, cfg.TLSKeyFile); err != nil {
		return nil, err
	}
	return s, nil
}

// Run implements inbox.Source. It consumes until ctx ends, reconnecting
// with capped, jittered backoff whenever the connection or the channel is
// lost. A refusal (credentials, TLS, a queue missing or declared
// otherwise) before it ever consumed is returned: the configuration is
// wrong, and retrying cannot fix it. Once it has consumed, the same
// refusal is an outage like any other (a password rotated, a queue being
// recreated), reported through h.Down and retried.
func (s *Source) Run(ctx context.Context, h inbox.Handoff) error {
	consumed := false
	for failures := 0; ; {
		up, err := s.session(ctx, h)
		if ctx.Err() != nil {
			return nil
		}
		if up {
			consumed, failures = true, 0
		}
		if !consumed && broker.Fatal(err) {
			return err
		}
		h.Down(err)
		failures++
		if !obs.Sleep(ctx, obs.FullJitter(probeBase, s.probeMax, failures)) {
			return nil
		}
	}
}

// session connects, consumes and hands batches over until the connection
// or the channel is lost (the error says why) or ctx ends (nil). consumed
// reports that it got as far as consuming.
func (s *Source) session(ctx context.Context, h inbox.Handoff) (consumed bool, err error) {
	conn, err := s.dial(ctx)
	if err != nil {
		return false, err
	}
	// Closing the connection hands every unacknowledged delivery back to
	// the queue. A broker that does not answer the close is left behind.
	defer func() { _ = conn.CloseDeadline(time.Now().Add(time.Second)) }()
	connClosed := conn.NotifyClose(make(chan *amqp.Error, 1))
	ch, err := conn.Channel()
	if err != nil {
		return false, fmt.Errorf("rabbitmq %s: open channel: %w", s.shownURL, err)
	}
	chClosed := ch.NotifyClose(make(chan *amqp.Error, 1))
	cancelled := ch.NotifyCancel(make(chan string, 1))
	deliveries, err := s.consume(ch)
	if err != nil {
		return false, err
	}
	h.Up()
	for {
		select {
		case <-ctx.Done():
			return true, nil
		case <-cancelled:
			return true, fmt.Errorf("rabbitmq %s: the broker cancelled the consumer of queue %q (deleted, or its node went down)", s.shownURL, s.cfg.Queue)
		case d, ok := <-deliveries:
			if !ok {
				return true, lost(s.shownURL, connClosed, chClosed)
			}
			s.process(ctx, h, collect(d, deliveries, s.batch))
		}
	}
}

// dial connects within connect_timeout, or until ctx ends.
func (s *Source) dial(ctx context.Context) (*amqp.Connection, error) {
	cfg := s.amqpCfg
	var stop func() bool
	cfg.Dial = func(network, addr string) (net.Conn, error) {
		dctx, cancel := context.WithTimeout(ctx, s.cfg.ConnectTimeout)
		defer cancel()
		c, err := new(net.Dialer).DialContext(dctx, network, addr)
		if err != nil {
			return nil, err
		}
		// The deadline bounds the TLS and AMQP handshakes; the client
		// clears it once the connection is open. ctx ending cuts them
		// short, so shutdown never waits for a broker that stalls.
		_ = c.SetDeadline(time.Now().Add(s.cfg.ConnectTimeout))
		stop = context.AfterFunc(ctx, func() { _ = c.SetDeadline(time.Unix(1, 0)) })
		return c, nil
	}
	conn, err := amqp.DialConfig(s.cfg.URL, cfg)
	if stop != nil {
		stop()
	}
	if err != nil {
		return nil, rabbitmqbroker.DialError(s.section, s.shownURL, err)
	}
	return conn, nil
}

// queueArgs are the arguments of the queue declare_queue declares: a
// quorum queue (replicated, durable) with a single active consumer, so
// that one replica at a time receives its messages, in the queue's order.
// The others wait as standby consumers and take over when it goes away.
func queueArgs() amqp.Table {
	return amqp.Table{
		amqp.QueueTypeArg:            amqp.QueueTypeQuorum,
		amqp.SingleActiveConsumerArg: true,
	}
}

// consume sets the prefetch, declares the queue if configured to, and
// starts consuming with manual acknowledgements.
func (s *Source) consume(ch *amqp.Channel) (<-chan amqp.Delivery, error) {
	if err := ch.Qos(s.cfg.Prefetch, 0, false); err != nil {
		return nil, fmt.Errorf("rabbitmq %s: prefetch: %w", s.shownURL, err)
	}
	if s.cfg.DeclareQueue {
		if _, err := ch.QueueDeclare(s.cfg.Queue, true, false, false, false, queueArgs()); err != nil {
			return nil, s.refusal("declare queue", err)
		}
	}
	d, err := ch.Consume(s.cfg.Queue, "", false, false, false, false, nil)
	if err != nil {
		return nil, s.refusal("consume queue", err)
	}
	return d, nil
}

// refusal classifies a channel error on the queue: a queue that is missing
// or was declared with other arguments is the configuration's fault
// (broker.ErrSetup), a permission the user lacks is broker.ErrRefused.
func (s *Source) refusal(what string, err error) error {
	var ae *amqp.Error
	if errors.As(err, &ae) {
		switch ae.Code {
		case amqp.NotFound:
			return fmt.Errorf("%w: %s.queue=%q: %s; declare it, or set %s.declare_queue=true", broker.ErrSetup, s.section, s.cfg.Queue, ae.Reason, s.section)
		case amqp.PreconditionFailed:
			return fmt.Errorf("%w: %s.queue=%q: %s; it exists with other arguments than a durable quorum queue with single active consumer: "+
				"declare it yourself and set %s.declare_queue=false", broker.ErrSetup, s.section, s.cfg.Queue, ae.Reason, s.section)
		case amqp.AccessRefused:
			return fmt.Errorf("%w: rabbitmq %s: %s %q: %s", broker.ErrRefused, s.shownURL, what, s.cfg.Queue, ae.Reason)
		}
	}
	return fmt.Errorf("rabbitmq %s: %s %q: %w", s.shownURL, what, s.cfg.Queue, err)
}

// lost says why the deliveries stopped: the client closes them when the
// channel or the connection shuts down, and sends the reason, if the
// broker gave one, on the close notifications.
func lost(url string, conn, ch <-chan *amqp.Error) error {
	timeout := time.NewTimer(time.Second)
	defer timeout.Stop()
	for conn != nil || ch != nil {
		select {
		case e, ok := <-conn:
			if e != nil {
				return fmt.Errorf("rabbitmq %s: connection lost: %w", url, e)
			}
			if !ok {
				conn = nil
			}
		case e, ok := <-ch:
			if e != nil {
				return fmt.Errorf("rabbitmq %s: channel closed: %w", url, e)
			}
			if !ok {
				ch = nil
			}
		case <-timeout.C:
			conn, ch = nil, nil
		}
	}
	return fmt.Errorf("rabbitmq %s: the deliveries stopped", url)
}

// collect returns first and what follows it within linger, up to size.
func collect(first amqp.Delivery, in <-chan amqp.Delivery, size int) []amqp.Delivery {
	batch := append(make([]amqp.Delivery, 0, size), first)
	var timer *time.Timer
	for len(batch) < size {
		select {
		case d, ok := <-in:
			if !ok {
				return batch
			}
			batch = append(batch, d)
			continue
		default:
		}
		if timer == nil {
			timer = time.NewTimer(linger)
			defer timer.Stop()
		}
		select {
		case d, ok := <-in:
			if !ok {
				return batch
			}
			batch = append(batch, d)
		case <-timer.C:
			return batch
		}
	}
	return batch
}
