// Package rabbitmq is the RabbitMQ sink (outbox.sink: rabbitmq): each event
// is one persistent message, published mandatory to an exchange with a
// routing key named after it, message_id = event_id and the CloudEvents
// attributes as cloudEvents: headers, reported published only once the
// broker confirmed it and did not return it as unroutable.
package rabbitmq

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/worker-dev/worker/internal/broker"
	rabbitmqbroker "github.com/worker-dev/worker/internal/broker/rabbitmq"
	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
	"github.com/worker-dev/worker/internal/outbox/sink"
)

// blockedRetry is how long the relay waits before retrying an event while
// the broker has blocked the connection (a memory or disk alarm).
const blockedRetry = time.Second

// Sink publishes events to an exchange. It is safe for concurrent Publish:
// one channel in confirm mode carries them all, each call waiting for its
// own confirm, so many calls in flight pipeline on it.
type Sink struct {
	cfg      outboxconfig.RabbitMQConfig
	key      *sink.Template
	log      *slog.Logger
	name     string
	shownURL string
	amqpCfg  amqp.Config
	slots    chan struct{} // one per publish awaiting its confirm

	// maxMessage is the broker's max_message_size once a refusal named it
	// (0 until then): a larger message is refused before it is sent.
	maxMessage atomic.Int64

	mu   sync.Mutex // guards the connection below and its replacement
	conn *amqp.Connection
	ch   *amqp.Channel
	link *link
}

// link is the state of one connection: returned message ids, whether the
// broker has blocked it, and why the broker closed its channel.
type link struct {
	returns chan amqp.Return
	closes  chan *amqp.Error

	mu         sync.Mutex
	returned   map[string]amqp.Return
	isBlocked  bool
	blockCause string
	closeErr   *amqp.Error // why the broker closed the channel, once read
}

// closedBy returns the error the channel was closed with, or nil while it
// is open or after a clean close. The client sends it before it fails the
// confirms in flight, so a publish that was not confirmed finds it here.
func (l *link) closedBy() *amqp.Error {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.closeErr == nil && l.closes != nil {
		select {
		case err, open := <-l.closes:
			if open {
				l.closeErr = err
			} else {
				l.closes = nil
			}
		default:
		}
	}
	return l.closeErr
}

// Options are what the sink needs beside its configuration section.
type Options struct {
	Name   string // the connection's name in the management UI
	Logger *slog.Logger
}

// New checks cfg and returns an unconnected sink; Connect connects it.
func New(cfg outboxconfig.RabbitMQConfig, opts Options) (*Sink, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	uri, err := amqp.ParseURI(cfg.URL)
	if err != nil {
		return nil, fmt.Errorf("outbox.rabbitmq.url=%q: %v", broker.RedactURLs(cfg.URL), err)
	}
	key, err := sink.ParseTemplate("outbox.rabbitmq.routing_key", cfg.RoutingKey, nil, rabbitmqbroker.RoutingWord)
	if err != nil {
		return nil, err
	}
	if cfg.Exchange == "" {
		if err := checkQueueName(cfg.RoutingKey, key); err != nil {
			return nil, err
		}
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &Sink{
		cfg:      cfg,
		key:      key,
		log:      log.With("sink", outboxconfig.SinkRabbitMQ),
		name:     opts.Name,
		shownURL: broker.RedactURLs(cfg.URL),
		slots:    make(chan struct{}, cfg.MaxPending),
	}
	s.amqpCfg = amqp.Config{
		Heartbeat:  10 * time.Second,
		Properties: amqp.Table{"connection_name": opts.Name},
	}
	if s.amqpCfg.TLSClientConfig, err = rabbitmqbroker.TLS("outbox.rabbitmq", uri, s.shownURL, cfg.TLSCAFile, cfg.TLSCertFile, cfg.TLSKeyFile); err != nil {
		return nil, err
	}
	return s, nil
}

// checkQueueName refuses a routing key template that lets an event choose
// its queue on the default exchange, where the routing key is the name of
// the queue the message goes to. An event value at its start could pick
// any queue of the virtual host: another application's, or a client's
// direct reply-to (amq.rabbitmq.reply-to...), answering a request it never
// received. Names starting with "amq." are the broker's (amq.gen-...,
// amq.rabbitmq.reply-to), so the literal start must not make one either.
// On any other exchange a routing key only matches that exchange's
// bindings, which the operator chose: it reaches nothing else.
func checkQueueName(text string, key *sink.Template) error {
	prefix, literal := key.Prefix()
	switch {
	case prefix == "" && !literal:
		return fmt.Errorf(`outbox.rabbitmq.routing_key=%q: with the default exchange (outbox.rabbitmq.exchange="") the routing key is a queue's name, `+
			`so it must start with literal text: an event value there would choose any queue of the virtual host (amq.rabbitmq.reply-to..., another application's); `+
			`start it with a fixed name, or publish to an exchange`, text)
	case strings.HasPrefix(prefix, "amq.") || !literal && strings.HasPrefix("amq.", prefix):
		return fmt.Errorf(`outbox.rabbitmq.routing_key=%q: with the default exchange (outbox.rabbitmq.exchange="") the routing key is a queue's name, `+
			`and queue names starting with "amq." are the broker's (amq.gen-..., amq.rabbitmq.reply-to): want a literal start that cannot begin "amq."`, text)
	}
	return nil
}

// Name implements outbox.Sink.
func (s *Sink) Name() string { return outboxconfig.SinkRabbitMQ }

// RoutingKey returns the routing key of e.
func (s *Sink) RoutingKey(e outbox.Event) string { return s.key.Render(e) }

// Connect connects and checks (or declares) the exchange, retrying until
// ctx ends. Its errors wrap broker.ErrUnreachable, broker.ErrRefused or
// broker.ErrSetup.
func (s *Sink) Connect(ctx context.Context) error {
	var last error
	for wait := 100 * time.Millisecond; ; wait = min(2*wait, 2*time.Second) {
		_, last = s.channel(ctx)
		if last == nil || broker.Fatal(last) {
			return last
		}
		s.log.Warn("rabbitmq not ready yet", "error", last.Error(), "retry_in", wait.String())
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w: rabbitmq %s: %w", broker.ErrUnreachable, s.shownURL, last)
		case <-time.After(wait):
		}
	}
}

// channel returns the open channel, connecting first when there is none
// or the broker closed it: a lost connection costs the publishes in flight
// a retry, and the next publish reconnects.
func (s *Sink) channel(ctx context.Context) (*amqp.Channel, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ch != nil && !s.ch.IsClosed() && !s.conn.IsClosed() {
		return s.ch, nil
	}
	if s.conn != nil {
		_ = s.conn.CloseDeadline(time.Now()) // already lost; do not wait for the broker
		s.log.Warn("rabbitmq connection lost; reconnecting")
	}
	s.conn, s.ch, s.link = nil, nil, nil
	cfg := s.amqpCfg
	dial := 5 * time.Second
	if d, ok := ctx.Deadline(); ok {
		dial = max(min(dial, time.Until(d)), 10*time.Millisecond)
	}
	tcp := amqp.DefaultDial(dial)
	cfg.Dial = func(network, addr string) (net.Conn, error) {
		c, err := tcp(network, addr)
		if err != nil {
			return nil, err
		}
		return newCoalescingConn(c), nil
	}
	conn, err := amqp.DialConfig(s.cfg.URL, cfg)
	if err != nil {
		return nil, rabbitmqbroker.DialError("outbox.rabbitmq", s.shownURL, err)
	}
	ch, err := s.setup(conn)
	if err != nil {
		_ = conn.Close()
		return nil, err
	}
	l := &link{
		returns:  ch.NotifyReturn(make(chan amqp.Return, s.cfg.MaxPending)),
		closes:   ch.NotifyClose(make(chan *amqp.Error, 1)),
		returned: map[string]amqp.Return{},
	}
	go l.followBlocking(conn.NotifyBlocked(make(chan amqp.Blocking, 1)), s.log)
	s.conn, s.ch, s.link = conn, ch, l
	return ch, nil
}

// setup opens the publishing channel: the exchange checked or declared,
// confirm mode on.
func (s *Sink) setup(conn *amqp.Connection) (*amqp.Channel, error) {
	ch, err := conn.Channel()
	if err != nil {
		return nil, fmt.Errorf("rabbitmq: open channel: %w", err)
	}
	if s.cfg.Exchange != "" {
		declare := ch.ExchangeDeclarePassive
		if s.cfg.DeclareExchange {
			declare = ch.ExchangeDeclare
		}
		if err := declare(s.cfg.Exchange, s.cfg.ExchangeType, true, false, false, false, nil); err != nil {
			var ae *amqp.Error
			if errors.As(err, &ae) && (ae.Code == amqp.NotFound || ae.Code == amqp.PreconditionFailed) {
				return nil, fmt.Errorf("%w: outbox.rabbitmq.exchange=%q: %s; declare it or set outbox.rabbitmq.declare_exchange=true (with the right outbox.rabbitmq.exchange_type)",
					broker.ErrSetup, s.cfg.Exchange, ae.Reason)
			}
			return nil, fmt.Errorf("rabbitmq: exchange %q: %w", s.cfg.Exchange, err)
		}
	}
	if err := ch.Confirm(false); err != nil {
		return nil, fmt.Errorf("rabbitmq: confirm mode: %w", err)
	}
	return ch, nil
}

// Publish implements outbox.Sink: one persistent, mandatory message,
// confirmed by the broker. An ack after the broker returned the message
// (no queue bound for its routing key) is a permanent failure: it reached
// nobody, and retrying will not change that until someone binds a queue.
//
// What says the broker, not the event, failed is Unavailable (see
// docs/sinks.md): no connection, a blocked connection, no confirm (a nack,
// a lost connection or publish_timeout: the outcome is unknown). Nothing is
// ever resent by the client: amqp091-go's recovery stays off (amqp.Config
// without Recovery), and a lost connection is replaced only by the next
// Publish, which sends its own event once.
func (s *Sink) Publish(ctx context.Context, e outbox.Event) error {
	ctx, cancel := context.WithTimeout(ctx, s.cfg.PublishTimeout)
	defer cancel()
	key := s.key.Render(e)
	if err := s.refusedAtOnce(e, key); err != nil {
		return outbox.Permanent(err)
	}
	select {
	case s.slots <- struct{}{}:
		defer func() { <-s.slots }()
	case <-ctx.Done():
		// Every slot waits for a confirm: the broker is not confirming.
		return outbox.Unavailable(fmt.Errorf("rabbitmq: event %s: waiting for a publish slot: %w", e.EventID, ctx.Err()))
	}
	ch, err := s.channel(ctx)
	if err != nil {
		return outbox.Unavailable(fmt.Errorf("rabbitmq: event %s: %w", e.EventID, err))
	}
	l := s.linkOf(ch)
	if cause, blocked := l.blockedNow(); blocked {
		return outbox.Unavailable(&outbox.RetryAfterError{
			Err:   fmt.Errorf("rabbitmq: event %s: the broker blocked the connection: %s", e.EventID, cause),
			After: blockedRetry,
		})
	}
	msg := s.message(e)
	if size := headerSize(msg); size > s.frameLimit() {
		return outbox.Permanent(fmt.Errorf("rabbitmq: event %s: its headers take about %d bytes, more than the broker's frame_max allows (%d)",
			e.EventID, size, s.frameLimit()))
	}
	dc, err := ch.PublishWithDeferredConfirmWithContext(ctx, s.cfg.Exchange, key, true, false, msg)
	if err != nil {
		return outbox.Unavailable(fmt.Errorf("rabbitmq: event %s: publish: %w", e.EventID, err))
	}
	acked, err := dc.WaitContext(ctx)
	switch {
	case err != nil:
		return outbox.Unavailable(fmt.Errorf("rabbitmq: event %s: waiting for the confirm: %w", e.EventID, err))
	case !acked:
		return s.notConfirmed(e, l)
	}
	if r, ok := l.takeReturn(e.EventID); ok {
		return outbox.Permanent(fmt.Errorf("rabbitmq: event %s: returned unroutable by exchange %q with routing key %q: %d %s; bind a queue for it",
			e.EventID, s.cfg.Exchange, key, r.ReplyCode, r.ReplyText))
	}
	return nil
}

// refusedAtOnce says why the broker would refuse e whatever its state: a
// routing key over 255 bytes, or a body over the max_message_size a
// refusal named earlier.
func (s *Sink) refusedAtOnce(e outbox.Event, key string) error {
	if len(key) > 255 {
		return fmt.Errorf("rabbitmq: event %s: routing key is %d bytes, the limit is 255", e.EventID, len(key))
	}
	if limit := s.maxMessage.Load(); limit > 0 && int64(len(e.Payload)) > limit {
		return fmt.Errorf("rabbitmq: event %s: message size %d is larger than the broker's max_message_size %d", e.EventID, len(e.Payload), limit)
	}
	return nil
}

// tooLarge is how RabbitMQ words the channel error for a message over its
// max_message_size.
var tooLarge = regexp.MustCompile(`message size (\d+) is larger than configured max size (\d+)`)

// notConfirmed classifies a publish the broker did not confirm. The broker
// closes the channel for a message over its max_message_size, which fails
// every publish in flight on it: the refusal names the size, so only the
// event of that size is permanent. Every other case (a nack, a lost
// connection) leaves the outcome unknown: Unavailable.
func (s *Sink) notConfirmed(e outbox.Event, l *link) error {
	if closed := l.closedBy(); closed != nil {
		if m := tooLarge.FindStringSubmatch(closed.Reason); m != nil {
			limit, _ := strconv.ParseInt(m[2], 10, 64)
			s.maxMessage.Store(limit)
			if m[1] == strconv.Itoa(len(e.Payload)) {
				return outbox.Permanent(fmt.Errorf("rabbitmq: event %s: the broker refused it: %s", e.EventID, closed.Reason))
			}
		}
		return outbox.Unavailable(fmt.Errorf("rabbitmq: event %s: not confirmed, the broker closed the channel: %s", e.EventID, closed.Reason))
	}
	return outbox.Unavailable(fmt.Errorf("rabbitmq: event %s: the broker did not confirm it (nack or connection lost)", e.EventID))
}

// headerSize estimates the bytes of msg's content header frame, from
// above: per header its name, type, length and value, plus the short
// string properties and room for the fixed ones.
func headerSize(msg amqp.Publishing) int {
	n := 256 + len(msg.ContentType) + len(msg.MessageId) + len(msg.Type) + len(msg.AppId)
	for k, v := range msg.Headers {
		s, _ := v.(string) // message sets strings only
		n += 1 + len(k) + 1 + 4 + len(s)
	}
	return n
}

// frameLimit is the largest content header the connection's negotiated
// frame_max carries: the broker closes the whole connection for a larger
// frame, failing every publish on it.
func (s *Sink) frameLimit() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	size := 131072 // RabbitMQ's default frame_max
	if s.conn != nil && s.conn.Config.FrameSize > 0 {
		size = s.conn.Config.FrameSize
	}
	return size - 8 // the frame's own header and end octet
}

func (s *Sink) linkOf(ch *amqp.Channel) *link {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.ch == ch && s.link != nil {
		return s.link
	}
	return &link{returned: map[string]amqp.Return{}} // replaced meanwhile: a closed channel's publish fails anyway
}

// takeReturn reports whether the broker returned the message id. The
// broker sends basic.return before the basic.ack of the same message and
// the client hands both over in that order, so after the ack the return, if
// any, is in the channel or already moved to the map.
func (l *link) takeReturn(id string) (amqp.Return, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	for drained := false; !drained && l.returns != nil; {
		select {
		case r, ok := <-l.returns:
			if !ok { // the channel closed
				l.returns = nil
				break
			}
			l.returned[r.MessageId] = r
		default:
			drained = true
		}
	}
	r, ok := l.returned[id]
	delete(l.returned, id)
	return r, ok
}

// followBlocking applies the broker's connection.blocked and unblocked
// notifications until the connection closes, and logs one warning per
// blocked period. It reads them as they come: the client hands them over
// from its frame reader, which stalls on a full channel and then drops the
// notification, and a lost "unblocked" would fail every publish until the
// connection is replaced.
func (l *link) followBlocking(notes <-chan amqp.Blocking, log *slog.Logger) {
	for b := range notes {
		l.mu.Lock()
		was := l.isBlocked
		l.isBlocked, l.blockCause = b.Active, b.Reason
		l.mu.Unlock()
		switch {
		case b.Active && !was:
			log.Warn("rabbitmq blocked the connection (a memory or disk alarm); publishes are retried until it unblocks", "reason", b.Reason)
		case !b.Active && was:
			log.Info("rabbitmq unblocked the connection")
		}
	}
}

// blockedNow reports whether the broker has blocked the connection, and
// why.
func (l *link) blockedNow() (string, bool) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.blockCause, l.isBlocked
}

// message is the AMQP message of e: CloudEvents attributes as
// "cloudEvents:" headers (the AMQP binding's application properties),
// datacontenttype as content_type, stored headers passed through.
func (s *Sink) message(e outbox.Event) amqp.Publishing {
	h := make(amqp.Table, len(e.Headers)+len(broker.Names))
	for k, v := range e.Headers {
		if !strings.HasPrefix(strings.ToLower(k), "cloudevents") {
			h[k] = v
		}
	}
	rabbitmqbroker.Encode(sink.CloudEvent(e), h)
	return amqp.Publishing{
		Headers:      h,
		ContentType:  broker.ContentType,
		DeliveryMode: amqp.Persistent,
		MessageId:    e.EventID,
		Type:         e.EventType,
		Timestamp:    e.OccurredAt,
		AppId:        s.cfg.AppID,
		Body:         e.Payload,
	}
}

// Ready reports whether the broker can be reached, reconnecting if the
// connection was lost while no event was published.
func (s *Sink) Ready(ctx context.Context) error {
	_, err := s.channel(ctx)
	return err
}

// Close closes the connection; the relay has stopped, so every publish
// has its answer or has given up on it. A broker that does not answer the
// close within a second (or ctx) is left behind.
func (s *Sink) Close(ctx context.Context) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.conn == nil || s.conn.IsClosed() {
		return nil
	}
	deadline := time.Now().Add(time.Second)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	if err := s.conn.CloseDeadline(deadline); err != nil && !errors.Is(err, amqp.ErrClosed) {
		s.log.Warn("rabbitmq connection did not close cleanly", "error", err.Error())
	}
	return nil
}
