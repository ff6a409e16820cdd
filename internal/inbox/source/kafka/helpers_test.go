package kafka

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/inbox/inboxconfig"
	"github.com/worker-dev/worker/internal/inbox/inboxtest"
	"github.com/worker-dev/worker/internal/testkit"
)

const (
	testTopic  = "orders"
	testGroup  = "inbox"
	partitions = 3
)

// cluster is an in-process Kafka (kfake) keeping its data in a directory,
// so that it can be stopped and started again on the same ports.
type cluster struct {
	t     testing.TB
	opts  []kfake.Opt
	c     *kfake.Cluster
	addrs []string
}

func startCluster(t testing.TB, opts ...kfake.Opt) *cluster {
	t.Helper()
	cl := &cluster{t: t, opts: append([]kfake.Opt{
		kfake.NumBrokers(1), kfake.DataDir(t.TempDir()), kfake.SeedTopics(partitions, testTopic),
	}, opts...)}
	cl.start()
	t.Cleanup(func() { cl.c.Close() })
	return cl
}

func (cl *cluster) start() {
	opts := cl.opts
	if cl.addrs != nil { // a restart: the same ports, so clients find it again
		var ports []int
		for _, a := range cl.addrs {
			_, port, _ := net.SplitHostPort(a)
			p, err := strconv.Atoi(port)
			if err != nil {
				cl.t.Fatal(err)
			}
			ports = append(ports, p)
		}
		opts = append(opts, kfake.Ports(ports...))
	}
	c, err := kfake.NewCluster(opts...)
	if err != nil {
		cl.t.Fatal(err)
	}
	cl.c, cl.addrs = c, c.ListenAddrs()
}

func (cl *cluster) stop() { cl.c.Close() }

func (cl *cluster) brokers() string { return strings.Join(cl.addrs, ",") }

// client is a plain client of the cluster, for producing and reading the
// group's offsets.
func (cl *cluster) client(t testing.TB) *kgo.Client {
	t.Helper()
	c, err := kgo.NewClient(kgo.SeedBrokers(cl.addrs...), kgo.ProducerLinger(0))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(c.Close)
	return c
}

// event is a record as the outbox's Kafka sink produces it, keyed by its
// aggregate; no ID leaves ce_id out.
type event = inboxtest.Event

// produce produces events in order and returns their records, with the
// partitions and offsets the cluster gave them.
func produce(t testing.TB, c *kgo.Client, events ...event) []*kgo.Record {
	t.Helper()
	recs := make([]*kgo.Record, len(events))
	for i, e := range events {
		h := []kgo.RecordHeader{
			{Key: "content-type", Value: []byte("application/json")},
			{Key: "ce_specversion", Value: []byte("1.0")},
			{Key: "ce_source", Value: []byte("order")},
			{Key: "ce_subject", Value: []byte(e.Aggregate)},
			{Key: "ce_type", Value: []byte("order.updated")},
		}
		if e.ID != "" {
			h = append(h, kgo.RecordHeader{Key: "ce_id", Value: []byte(e.ID)})
		}
		recs[i] = &kgo.Record{Topic: testTopic, Key: []byte("order:" + e.Aggregate), Headers: h,
			Value: fmt.Appendf(nil, `{"id": %q, "aggregate": %q}`, e.ID, e.Aggregate)}
	}
	if err := c.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	return recs
}

// fixture is one test's inbox (see inboxtest.Fixture) with the Kafka
// source in front of it.
type fixture struct {
	*inboxtest.Fixture
	cl *cluster
}

func newFixture(t testing.TB, cl *cluster) *fixture {
	t.Helper()
	f := &fixture{Fixture: inboxtest.NewFixture(t, inboxconfig.KindKafka), cl: cl}
	f.Src.Kafka.Brokers, f.Src.Kafka.Topics, f.Src.Kafka.Group = cl.brokers(), testTopic, testGroup
	f.Src.Kafka.ConnectTimeout = 2 * time.Second
	return f
}

// run starts a source (a new client) in front of h until the test ends,
// reporting its state changes to f.States. stop ends it and returns Run's
// error.
func (f *fixture) run(h inbox.Handoff) (stop func() error) {
	f.T.Helper()
	s, err := New(f.Src, f.Cfg, nil)
	if err != nil {
		f.T.Fatal(err)
	}
	return f.Run(s, h)
}

// committed returns the group's committed offset per partition (absent:
// none committed).
func (f *fixture) committed(c *kgo.Client) map[int32]int64 {
	f.T.Helper()
	offs, err := kadm.NewClient(c).FetchOffsets(context.Background(), testGroup)
	if errors.Is(err, kerr.GroupIDNotFound) {
		return map[int32]int64{} // nothing committed yet
	}
	if err != nil {
		f.T.Fatal(err)
	}
	out := map[int32]int64{}
	offs.Each(func(o kadm.OffsetResponse) {
		if o.Topic == testTopic && o.Err == nil {
			out[o.Partition] = o.At
		}
	})
	return out
}

// waitCommitted waits until the group has committed every partition
// through its end.
func (f *fixture) waitCommitted(c *kgo.Client) {
	f.T.Helper()
	testkit.Eventually(f.T, 60*time.Second, "offsets committed through the end", func() bool {
		ends, err := kadm.NewClient(c).ListEndOffsets(context.Background(), testTopic)
		if err != nil {
			f.T.Fatal(err)
		}
		got := f.committed(c)
		done := true
		ends.Each(func(o kadm.ListedOffset) {
			if o.Offset > 0 && got[o.Partition] < o.Offset {
				done = false
			}
		})
		return done
	})
}
