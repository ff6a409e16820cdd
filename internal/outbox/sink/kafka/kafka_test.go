package kafka

import (
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/google/uuid"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"
	"github.com/twmb/franz-go/pkg/kmsg"

	"github.com/worker-dev/worker/internal/broker"
	kafkabroker "github.com/worker-dev/worker/internal/broker/kafka"
	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
	"github.com/worker-dev/worker/internal/outbox/sinktest"
)

// Child process settings of TestRelays.
const (
	childBrokersEnv = "WORKER_SINKTEST_KAFKA_BROKERS"
	childPrefixEnv  = "WORKER_SINKTEST_KAFKA_PREFIX"
)

const partitions = 8

// cluster is an in-process Kafka (kfake) with three brokers, its data in a
// directory so that it can be stopped and started again.
type cluster struct {
	t     testing.TB
	opts  []kfake.Opt
	c     *kfake.Cluster
	addrs []string
}

func startCluster(t testing.TB, topics ...string) *cluster {
	t.Helper()
	cl := &cluster{t: t, opts: []kfake.Opt{
		kfake.NumBrokers(3),
		kfake.DataDir(t.TempDir()),
	}}
	if len(topics) > 0 {
		cl.opts = append(cl.opts, kfake.SeedTopics(partitions, topics...))
	}
	cl.start()
	t.Cleanup(func() { cl.c.Close() })
	return cl
}

func (cl *cluster) start() {
	opts := cl.opts
	if cl.addrs != nil { // a restart: the same ports, so clients find it again
		opts = append(opts, kfake.Ports(ports(cl.t, cl.addrs)...))
	}
	c, err := kfake.NewCluster(opts...)
	if err != nil {
		cl.t.Fatal(err)
	}
	cl.c, cl.addrs = c, c.ListenAddrs()
}

func ports(t testing.TB, addrs []string) []int {
	var out []int
	for _, a := range addrs {
		_, port, err := net.SplitHostPort(a)
		if err != nil {
			t.Fatal(err)
		}
		p, err := strconv.Atoi(port)
		if err != nil {
			t.Fatal(err)
		}
		out = append(out, p)
	}
	return out
}

// restart stops every broker and starts them again on the same ports and
// data.
func (cl *cluster) restart() {
	cl.c.Close()
	cl.start()
}

func (cl *cluster) brokers() string { return strings.Join(cl.addrs, ",") }

func config(brokers, topic string) outboxconfig.KafkaConfig {
	c := outboxconfig.DefaultKafkaConfig()
	c.Brokers, c.Topic = brokers, topic
	c.ConnectTimeout = 10 * time.Second
	c.PublishTimeout = 5 * time.Second
	return c
}

func connect(t testing.TB, cfg outboxconfig.KafkaConfig) *Sink {
	t.Helper()
	s, err := New(cfg, Options{})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), cfg.ConnectTimeout)
	defer cancel()
	if err := s.Connect(ctx); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = s.Close(context.Background()) })
	return s
}

// read consumes every record of topic from the start, partition by
// partition, and checks that each aggregate stayed on one partition. opts
// add the consumer's SASL or TLS settings.
func read(t *testing.T, brokers, topic string, opts ...kgo.Opt) []sinktest.Message {
	t.Helper()
	cl, err := kgo.NewClient(append([]kgo.Opt{kgo.SeedBrokers(strings.Split(brokers, ",")...), kgo.ConsumeTopics(topic),
		kgo.ConsumeResetOffset(kgo.NewOffset().AtStart())}, opts...)...)
	if err != nil {
		t.Fatal(err)
	}
	defer cl.Close()
	ends, err := kadm.NewClient(cl).ListEndOffsets(t.Context(), topic)
	if err != nil {
		t.Fatal(err)
	}
	var total int64
	ends.Each(func(o kadm.ListedOffset) { total += o.Offset })
	byPartition := map[int32][]sinktest.Message{}
	home := map[string]int32{}
	for got := int64(0); got < total; {
		ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
		fs := cl.PollFetches(ctx)
		cancel()
		if err := fs.Err0(); err != nil {
			t.Fatalf("read %d of %d records: %v", got, total, err)
		}
		fs.EachRecord(func(r *kgo.Record) {
			got++
			m := sinktest.Message{Attrs: map[string]string{}, Headers: map[string]string{}, Body: r.Value}
			for _, h := range r.Headers {
				switch {
				case strings.HasPrefix(h.Key, "ce_"):
					m.Attrs[strings.TrimPrefix(h.Key, "ce_")] = string(h.Value)
				case h.Key == "content-type":
					m.Attrs["datacontenttype"] = string(h.Value)
				default:
					m.Headers[h.Key] = string(h.Value)
				}
			}
			m.ID = m.Attrs["id"] // the Kafka binding has no message id field: ce_id is it
			if p, ok := home[string(r.Key)]; ok && p != r.Partition {
				t.Errorf("aggregate %s on partitions %d and %d", r.Key, p, r.Partition)
			}
			home[string(r.Key)] = r.Partition
			byPartition[r.Partition] = append(byPartition[r.Partition], m)
		})
	}
	var out []sinktest.Message
	for p := range int32(partitions) {
		out = append(out, byPartition[p]...)
	}
	if len(home) > 1 && len(byPartition) < 2 {
		t.Errorf("%d aggregates all on one partition: the key does not spread them", len(home))
	}
	return out
}

func TestConformance(t *testing.T) {
	t.Parallel()
	const topic = "Sales_20Order" // TopicPart("Sales Order")
	cl := startCluster(t, topic)
	sinktest.Exercise(t, sinktest.Broker{
		New:  func(t *testing.T) outbox.Sink { return connect(t, config(cl.brokers(), "{aggregate_type}")) },
		Read: func(t *testing.T) []sinktest.Message { return read(t, cl.brokers(), topic) },
		Refused: func(*testing.T) outbox.Event {
			e := sinktest.Event("big", 0)
			e.Payload = []byte(`"` + strings.Repeat("x", 1_100_000) + `"`) // over the 1 MB batch limit
			return e
		},
		Unreachable: func(t *testing.T, publishTimeout time.Duration) outbox.Sink {
			down := startCluster(t, topic)
			cfg := config(down.brokers(), "{aggregate_type}")
			cfg.PublishTimeout = max(publishTimeout, time.Second)
			s := connect(t, cfg)
			down.c.Close()
			return s
		},
		Silent: func(t *testing.T, publishTimeout time.Duration) outbox.Sink {
			mute := startCluster(t, topic)
			mute.c.ControlKey(int16(kmsg.Produce), func(kmsg.Request) (kmsg.Response, error, bool) {
				mute.c.KeepControl()
				return nil, nil, true // read and never answered
			})
			cfg := config(mute.brokers(), "{aggregate_type}")
			cfg.PublishTimeout = max(publishTimeout, time.Second)
			return connect(t, cfg)
		},
	})
}

// TestRelayProcess is the child relay process of TestRelays.
func TestRelayProcess(t *testing.T) {
	sinktest.RelayProcess(t, func(t *testing.T) outbox.Sink {
		return connect(t, config(os.Getenv(childBrokersEnv), os.Getenv(childPrefixEnv)+"{aggregate_type}"))
	})
}

// TestRelays: 3 relays in 2 processes publish 20,000 events over 200
// aggregates to a topic of 8 partitions; the child is SIGKILLed mid-batch
// and every broker restarted mid-run. Every event is on the topic, each
// aggregate on one partition with its first deliveries in order.
func TestRelays(t *testing.T) {
	t.Parallel()
	prefix := "t" + uuid.NewString()[:8] + "-"
	topic := prefix + "Order"
	cl := startCluster(t, topic)
	sinktest.RelayRun(t, sinktest.Relays{
		Broker: sinktest.Broker{
			New:  func(t *testing.T) outbox.Sink { return connect(t, config(cl.brokers(), prefix+"{aggregate_type}")) },
			Read: func(t *testing.T) []sinktest.Message { return read(t, cl.brokers(), topic) },
		},
		HelperTest: "TestRelayProcess",
		ChildEnv:   []string{childBrokersEnv + "=" + cl.brokers(), childPrefixEnv + "=" + prefix},
		Disrupt:    func(*testing.T) { cl.restart() },
	})
}

// A topic that does not exist is a transient failure (Kafka reports it as
// retriable: it may be being created), bounded by the publish timeout; once
// it exists, the retry goes through.
func TestMissingTopic(t *testing.T) {
	t.Parallel()
	cl := startCluster(t)
	cfg := config(cl.brokers(), "{aggregate_type}")
	// The client gives up on the record after half of this (2s), with the
	// topic's error, well before the publish's own deadline: at 1s both
	// end together, and a loaded machine sees the deadline first.
	cfg.PublishTimeout = 4 * time.Second
	s := connect(t, cfg)
	e := sinktest.Event("a", 0)
	e.AggregateType = "NotYet"
	// Every retry too: each is an attempt toward max_attempts. With the
	// client's default 5 s between metadata queries, a retry within that
	// time timed out without the topic's error and read as an outage.
	for attempt := range 3 {
		start := time.Now()
		err := s.Publish(t.Context(), e)
		if err == nil || outbox.IsPermanent(err) || outbox.IsUnavailable(err) || !strings.Contains(err.Error(), "NotYet") {
			t.Fatalf("attempt %d: got %v after %s, want a failure of the event naming the topic", attempt+1, err, time.Since(start))
		}
	}
	adm := kadm.NewClient(s.client)
	if _, err := adm.CreateTopic(t.Context(), 2, -1, nil, "NotYet"); err != nil {
		t.Fatal(err)
	}
	if err := s.Publish(t.Context(), e); err != nil {
		t.Errorf("after the topic was created: %v", err)
	}
}

func TestTopicPart(t *testing.T) {
	t.Parallel()
	for in, want := range map[string]string{
		"Order":         "Order",
		"order.created": "order.created",
		"Sales Order":   "Sales_20Order",
		"a_b/c":         "a_5Fb_2Fc",
		"":              "_",
		// Never Kafka's own names, nor "." or "..".
		"__consumer_offsets": "_5F_5Fconsumer_5Foffsets",
		".":                  "_2E",
		"..":                 "_2E.",
		"._x":                "_2E_5Fx",
		"a.":                 "a.",
	} {
		if got := kafkabroker.TopicPart(in); got != want {
			t.Errorf("TopicPart(%q) = %q, want %q", in, got, want)
		}
		if got := kafkabroker.TopicPart(in); reservedTopic(got) || got == ".." {
			t.Errorf("TopicPart(%q) = %q, a name Kafka keeps or refuses", in, got)
		}
	}
	if _, err := New(config("x:1", "a/{aggregate_type}"), Options{}); err == nil || !strings.Contains(err.Error(), "outbox.kafka.topic") {
		t.Errorf("a literal '/' in the template: %v", err)
	}
}

// A template whose fixed start is '_' or '.' is refused naming the key and
// the rule: "__" starts Kafka's own topics, '_' a platform's, and Kafka
// reads '.' as '_' when it compares names.
func TestTopicTemplateStaysOutOfReservedNames(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		topic string
		ok    bool
	}{
		{"{aggregate_type}", true},
		{"{aggregate_type}.{event_type}", true},
		{"events.{aggregate_type}", true},
		{"a_{aggregate_type}", true},
		{"orders", true},
		{"__consumer_offsets", false},
		{"__transaction_state", false},
		{"_schemas", false},
		{"_{aggregate_type}", false},
		{"__{aggregate_type}", false},
		{".{aggregate_type}", false},
		{".", false},
		{"..", false},
	} {
		_, err := New(config("x:1", c.topic), Options{})
		want := fmt.Sprintf(`outbox.kafka.topic=%q: want a topic that starts with neither '_' nor '.': names starting with "__" are Kafka's own`, c.topic)
		switch {
		case c.ok && err != nil:
			t.Errorf("%q: %v", c.topic, err)
		case !c.ok && (err == nil || !strings.Contains(err.Error(), want)):
			t.Errorf("%q: got %v, want an error with %q", c.topic, err, want)
		}
	}
}

// An empty value ("_") followed by '_' or '.' is the one way left to a
// name starting with "__" once '.' is read as '_': such an event is
// refused before anything is sent, and it is permanent.
func TestReservedTopicIsPermanent(t *testing.T) {
	t.Parallel()
	cl := startCluster(t)
	s := connect(t, config(cl.brokers(), "{aggregate_type}.{event_type}"))
	e := sinktest.Event("a", 0)
	e.AggregateType, e.EventType = "", "consumer_offsets"
	err := s.Publish(t.Context(), e)
	if !outbox.IsPermanent(err) || !strings.Contains(err.Error(), `topic "_.consumer_5Foffsets" is Kafka's own`) {
		t.Errorf("got %v, want a permanent refusal naming the topic", err)
	}
	e.AggregateType = "order"
	if got, want := s.Topic(e), "order.consumer_5Foffsets"; got != want {
		t.Errorf("topic %q, want %q", got, want)
	}
}

func TestConnect(t *testing.T) {
	t.Parallel()
	t.Run("unreachable until the budget ends", func(t *testing.T) {
		s, err := New(config("127.0.0.1:1", "{aggregate_type}"), Options{})
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(t.Context(), 500*time.Millisecond)
		defer cancel()
		if err := s.Connect(ctx); !errors.Is(err, broker.ErrUnreachable) {
			t.Errorf("got %v", err)
		}
	})
}
