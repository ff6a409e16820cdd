// Package kafka is the Kafka sink (outbox.sink: kafka): each event is one
// record, keyed by its aggregate so the default partitioner keeps an
// aggregate on one partition, with the CloudEvents attributes as ce_
// headers, produced by franz-go's idempotent producer with acks=all and
// reported published only once the partition's in-sync replicas have it.
package kafka

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/worker-dev/worker/internal/broker"
	kafkabroker "github.com/worker-dev/worker/internal/broker/kafka"
	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
	"github.com/worker-dev/worker/internal/outbox/sink"
)

// maxTopic is Kafka's limit on a topic name's length.
const maxTopic = 249

// settleWait is how long a publish that gave up waits for the client to
// fail its record by itself, which it does at once unless the record is
// on the wire.
const settleWait = 250 * time.Millisecond

// Sink produces events to Kafka. It is safe for concurrent Publish: each
// call waits for its own record's ack, and franz-go batches the records in
// flight per partition.
type Sink struct {
	cfg   outboxconfig.KafkaConfig
	topic *sink.Template
	opts  []kgo.Opt
	log   *slog.Logger

	mu     sync.Mutex // guards the client and its replacement
	client *kgo.Client
	closed bool
}

// Options are what the sink needs beside its configuration section.
type Options struct {
	Logger *slog.Logger
}

// New checks cfg and returns an unconnected sink; Connect connects it.
func New(cfg outboxconfig.KafkaConfig, opts Options) (*Sink, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	topic, err := sink.ParseTemplate("outbox.kafka.topic", cfg.Topic, nil, kafkabroker.TopicPart)
	if err != nil {
		return nil, err
	}
	if lit := topic.Pattern("x"); strings.Trim(lit, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._-") != "" {
		return nil, fmt.Errorf("outbox.kafka.topic=%q: want letters, digits, '.', '_' and '-' around the placeholders", cfg.Topic)
	}
	if prefix, _ := topic.Prefix(); prefix != "" && (prefix[0] == '_' || prefix[0] == '.') {
		return nil, fmt.Errorf("outbox.kafka.topic=%q: want a topic that starts with neither '_' nor '.': "+
			`names starting with "__" are Kafka's own (__consumer_offsets, __transaction_state), a leading '_' marks a platform's (_schemas), `+
			"and Kafka reads '.' as '_' when it compares names (\".\" and \"..\" are refused outright)", cfg.Topic)
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	s := &Sink{cfg: cfg, topic: topic, log: log.With("sink", outboxconfig.SinkKafka)}
	s.opts = []kgo.Opt{
		kgo.SeedBrokers(strings.Split(strings.ReplaceAll(cfg.Brokers, " ", ""), ",")...),
		kgo.ClientID(cfg.ClientID),
		// The idempotent producer (franz-go's default) with acks from every
		// in-sync replica: a record is confirmed once it cannot be lost with
		// a leader, and retries never duplicate or reorder it.
		kgo.RequiredAcks(kgo.AllISRAcks()),
		// A record the client could not get acknowledged within the publish
		// timeout fails; the retries inside it resend the same producer
		// sequence, which the broker deduplicates, never reorders. It fails
		// before the publish's own deadline, so that a record waiting for
		// its topic's metadata fails naming the last error (a missing
		// topic is the event's failure, not an outage). A record on the
		// wire is the client's to finish whatever the timeout: Publish
		// then gives up on the whole client (giveUp).
		kgo.RecordDeliveryTimeout(max(cfg.PublishTimeout/2, time.Second)),
		// That needs a metadata answer within the delivery timeout on every
		// attempt. The client's default of 5 s between metadata queries let
		// a retry of the same event time out before its topic was looked
		// up again, without the topic's error, so it read as an outage and
		// a poison event never reached max_attempts.
		kgo.MetadataMinAge(metadataMinAge),
		kgo.ProduceRequestTimeout(cfg.PublishTimeout),
		// No lingering (franz-go's default is 10ms): the relay waits for
		// each record's ack before it hands over the aggregate's next one,
		// so no more records come while a partition lingers, and every
		// publish would wait out the linger. Records still batch while a
		// produce request is on the wire.
		kgo.ProducerLinger(0),
	}
	auth, err := kafkabroker.AuthOptions("outbox.kafka", kafkabroker.Auth{
		SASLMechanism: cfg.SASLMechanism, SASLUser: cfg.SASLUser, SASLPassword: cfg.SASLPassword,
		TLS: cfg.TLS, TLSCAFile: cfg.TLSCAFile, TLSCertFile: cfg.TLSCertFile, TLSKeyFile: cfg.TLSKeyFile,
	})
	if err != nil {
		return nil, err
	}
	s.opts = append(s.opts, auth...)
	return s, nil
}

// reservedTopic reports whether Kafka keeps topic for itself or refuses
// it: "." and "..", and a name starting with "__" once '.' is read as '_'
// (Kafka's own topics, and the names that collide with them). New refuses
// templates whose fixed start makes one, and TopicPart keeps values from
// it; only an empty value ("_") followed by '_' or '.' still could.
func reservedTopic(topic string) bool {
	us := func(c byte) bool { return c == '_' || c == '.' }
	return topic == "." || len(topic) >= 2 && us(topic[0]) && us(topic[1])
}

// Key is the record key of e: its aggregate, so all of an aggregate's
// events land on one partition, in order.
func Key(e outbox.Event) []byte {
	k := make([]byte, 0, len(e.AggregateType)+1+len(e.AggregateID))
	k = append(k, e.AggregateType...)
	k = append(k, ':')
	return append(k, e.AggregateID...)
}

// Name implements outbox.Sink.
func (s *Sink) Name() string { return outboxconfig.SinkKafka }

// Topic returns the topic e is produced to.
func (s *Sink) Topic(e outbox.Event) string { return s.topic.Render(e) }

// Connect creates the client and waits until a broker answers, retrying
// until ctx ends. Its errors wrap broker.ErrUnreachable, broker.ErrRefused or
// broker.ErrSetup.
func (s *Sink) Connect(ctx context.Context) error {
	client, err := kgo.NewClient(s.opts...)
	if err != nil {
		return fmt.Errorf("%w: %w", broker.ErrSetup, err)
	}
	var last error
	for {
		err := client.Ping(ctx)
		verdict := kafkabroker.ConnectVerdict("outbox.kafka", s.cfg.Brokers, s.cfg.SASLMechanism, err)
		switch {
		case err == nil:
			s.mu.Lock()
			s.client = client
			s.mu.Unlock()
			return nil
		case verdict != nil:
			client.Close()
			return verdict
		case ctx.Err() != nil:
			client.Close()
			// The attempt the deadline cut short says only that; the one
			// before it says why no broker answered (a certificate, ...).
			if last == nil || !errors.Is(err, ctx.Err()) {
				last = err
			}
			return fmt.Errorf("%w: kafka %s: %w", broker.ErrUnreachable, s.cfg.Brokers, last)
		}
		last = err
		s.log.Warn("kafka not ready yet", "error", err.Error())
		select {
		case <-ctx.Done():
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// Publish implements outbox.Sink: one record, acked by all in-sync
// replicas. See classify for what is permanent and what Unavailable.
func (s *Sink) Publish(ctx context.Context, e outbox.Event) error {
	client := s.current()
	if client == nil {
		return outbox.Unavailable(errors.New("kafka: no client (publish before Connect or after Close)"))
	}
	topic := s.topic.Render(e)
	if len(topic) > maxTopic {
		return outbox.Permanent(fmt.Errorf("kafka: event %s: topic %q is longer than %d bytes", e.EventID, topic, maxTopic))
	}
	if reservedTopic(topic) {
		return outbox.Permanent(fmt.Errorf(`kafka: event %s: topic %q is Kafka's own (it starts with "__" once '.' is read as '_'); an empty value made it`, e.EventID, topic))
	}
	rec := &kgo.Record{Topic: topic, Key: Key(e), Value: e.Payload, Headers: headers(e)}
	// franz-go times a record out only between attempts; a request on the
	// wire waits for its answer. The publish timeout bounds the whole wait.
	ctx, cancel := context.WithTimeout(ctx, s.cfg.PublishTimeout)
	defer cancel()
	done := make(chan error, 1)
	client.Produce(ctx, rec, func(_ *kgo.Record, err error) { done <- err })
	var err error
	select {
	case err = <-done:
	case <-ctx.Done():
		err = s.giveUp(client, done, ctx.Err())
	}
	if err == nil {
		return nil
	}
	return classify(fmt.Errorf("kafka: event %s to %s: %w", e.EventID, topic, err))
}

// giveUp ends a publish whose context ended before the record's answer.
// The client fails a record it has not sent as soon as its context ends.
// One on the wire it keeps, and resends until the broker answers: that
// record could land after the relay has given up on it and published the
// aggregate's next event elsewhere. So the client is closed, which fails
// every record it holds, and a new one takes its place. When giveUp
// returns, the client will never send the record again.
func (s *Sink) giveUp(client *kgo.Client, done <-chan error, cause error) error {
	select {
	case err := <-done:
		return err // the client's verdict: it is done with the record
	case <-time.After(settleWait):
	}
	s.abandon(client)
	select {
	case err := <-done: // Close fails every record the client held
		if err == nil {
			return nil // acknowledged before the close
		}
	case <-time.After(settleWait): // closed all the same: it sends nothing more
	}
	return fmt.Errorf("%w: no answer from the broker; the outcome is unknown", cause)
}

// current returns the client publishes go through.
func (s *Sink) current() *kgo.Client {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.client
}

// abandon closes c and, unless the sink was closed or c was already
// replaced, puts a new client with the same options in its place.
func (s *Sink) abandon(c *kgo.Client) {
	s.mu.Lock()
	if s.client == c && !s.closed {
		fresh, err := kgo.NewClient(s.opts...)
		if err != nil { // the options were accepted at Connect: not expected
			s.log.Error("kafka client could not be replaced", "error", err.Error())
		}
		s.client = fresh
		s.log.Debug("kafka client replaced: a record was on the wire when its publish gave up")
	}
	s.mu.Unlock()
	c.Close()
}

// metadataMinAge is the least time between the client's metadata queries:
// well within the shortest delivery timeout (1 s), at most four queries a
// second while topics fail to load.
const metadataMinAge = 250 * time.Millisecond

// permanentErrors are the broker's refusals of the record itself.
var permanentErrors = []error{kerr.MessageTooLarge, kerr.RecordListTooLarge, kerr.InvalidTopicException,
	kerr.InvalidRecord, kerr.TopicAuthorizationFailed}

// eventErrors are failures about the record's topic or data that other
// events may not share: they count toward max_attempts.
var eventErrors = []error{kerr.UnknownTopicOrPartition, kerr.UnknownTopicID, kerr.CorruptMessage}

// unavailableErrors are the client's own ways of saying that the brokers
// did not answer: the record timed out or ran out of retries, or the
// client was closed under it (see giveUp).
var unavailableErrors = []error{kgo.ErrRecordTimeout, kgo.ErrRecordRetries, kgo.ErrClientClosed, kgo.ErrMaxBuffered}

// classify sorts a publish error (see docs/sinks.md): a record the broker
// can never take is permanent (too large, an invalid topic, refused by the
// broker's validation, not authorised); a missing topic is this event's
// failure; a broker unreachable, not enough in-sync replicas, a leader
// moving, a request timeout, any other error Kafka calls retriable and
// the client timing out are Unavailable.
func classify(err error) error {
	for _, p := range permanentErrors {
		if errors.Is(err, p) {
			return outbox.Permanent(err)
		}
	}
	for _, p := range eventErrors {
		if errors.Is(err, p) {
			return err
		}
	}
	for _, u := range unavailableErrors {
		if errors.Is(err, u) {
			return outbox.Unavailable(err)
		}
	}
	if kerr.IsRetriable(err) || outbox.IsUnavailable(err) {
		return outbox.Unavailable(err)
	}
	return err
}

// headers are the CloudEvents attributes in the Kafka binding's binary
// mode (ce_ headers, content-type) after the stored headers.
func headers(e outbox.Event) []kgo.RecordHeader {
	attrs := sink.CloudEvent(e)
	size := len(broker.ContentType) + len(broker.SpecVersion) + len(attrs.ID) + len(attrs.Source) + len(attrs.Type) + len(attrs.Subject) + len(attrs.Time)
	for _, v := range e.Headers {
		size += len(v)
	}
	// The values share one buffer instead of one allocation each.
	buf := make([]byte, 0, size)
	value := func(v string) []byte {
		buf = append(buf, v...)
		return buf[len(buf)-len(v) : len(buf) : len(buf)]
	}
	h := make([]kgo.RecordHeader, 0, len(e.Headers)+1+len(broker.Names))
	for k, v := range e.Headers {
		if n := strings.ToLower(k); !strings.HasPrefix(n, "ce_") && n != "content-type" {
			h = append(h, kgo.RecordHeader{Key: k, Value: value(v)})
		}
	}
	h = append(h, kgo.RecordHeader{Key: "content-type", Value: value(broker.ContentType)})
	kafkabroker.Encode(attrs, func(k, v string) { h = append(h, kgo.RecordHeader{Key: k, Value: value(v)}) })
	return h
}

// Ready reports whether a broker answers, for /readyz.
func (s *Sink) Ready(ctx context.Context) error {
	client := s.current()
	if client == nil {
		return errors.New("kafka: not connected")
	}
	return client.Ping(ctx)
}

// Close closes the client; the relay has stopped.
func (s *Sink) Close(context.Context) error {
	s.mu.Lock()
	client := s.client
	s.client, s.closed = nil, true
	s.mu.Unlock()
	if client != nil {
		client.Close()
	}
	return nil
}
