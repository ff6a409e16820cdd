package kafka

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/twmb/franz-go/pkg/kadm"
	"github.com/twmb/franz-go/pkg/kerr"
	"github.com/twmb/franz-go/pkg/kfake"
	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/pgtest"
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
// aggregate; no id leaves ce_id out.
type event struct{ id, aggregate string }

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
			{Key: "ce_subject", Value: []byte(e.aggregate)},
			{Key: "ce_type", Value: []byte("order.updated")},
		}
		if e.id != "" {
			h = append(h, kgo.RecordHeader{Key: "ce_id", Value: []byte(e.id)})
		}
		recs[i] = &kgo.Record{Topic: testTopic, Key: []byte("order:" + e.aggregate), Headers: h,
			Value: fmt.Appendf(nil, `{"id": %q, "aggregate": %q}`, e.id, e.aggregate)}
	}
	if err := c.ProduceSync(context.Background(), recs...).FirstErr(); err != nil {
		t.Fatal(err)
	}
	return recs
}

// events returns n events over aggs aggregates, with ids prefix-0, prefix-1, ...
func events(prefix string, n, aggs int) []event {
	out := make([]event, n)
	for i := range out {
		out[i] = event{id: fmt.Sprintf("%s-%d", prefix, i), aggregate: fmt.Sprintf("agg-%d", i%aggs)}
	}
	return out
}

// seenSQL is the test's work: one row per message processed, in order.
const seenSQL = `INSERT INTO seen (id, order_key) VALUES (@id, @order_key)`

// fixture is one test's inbox: a database, a consumer with the sql
// handler and the Kafka source in front of it.
type fixture struct {
	t      testing.TB
	db     *pgtest.DB
	cl     *cluster
	src    inbox.SourceConfig
	cfg    inbox.Config
	states *states
}

func newFixture(t testing.TB, cl *cluster) *fixture {
	t.Helper()
	db := pgtest.New(t)
	if _, err := db.Pool.Exec(context.Background(), `CREATE TABLE seen (n bigserial, id text NOT NULL, order_key text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	cfg := inbox.DefaultConfig()
	cfg.BackoffBase, cfg.BackoffMax = 10*time.Millisecond, 100*time.Millisecond
	cfg.ProbeBackoffMax = 200 * time.Millisecond
	src := inbox.DefaultSource()
	src.Name, src.Kind = "orders", inbox.KindKafka
	src.Handler = inbox.HandlerConfig{Kind: inbox.HandlerSQL, SQL: seenSQL}
	src.Kafka.Brokers, src.Kafka.Topics, src.Kafka.Group = cl.brokers(), testTopic, testGroup
	src.Kafka.ConnectTimeout = 2 * time.Second
	return &fixture{t: t, db: db, cl: cl, src: src, cfg: cfg, states: &states{}}
}

// consumer returns an inbox consumer of the fixture's source with handler
// h (the sql handler when nil).
func (f *fixture) consumer(h inbox.Handler) *inbox.Consumer {
	if h == nil {
		h = inbox.SQLHandler{SQL: f.src.Handler.SQL}
	}
	m, err := inbox.NewMetrics(prometheus.NewRegistry())
	if err != nil {
		f.t.Fatal(err)
	}
	log := (&testkit.LogBuffer{}).Logger()
	return inbox.NewConsumer(f.db.Pool, f.src, f.cfg, h, "test-replica", log, m)
}

// run starts a source (a new client) in front of h until the test ends,
// reporting its state changes to f.states. stop ends it and returns Run's
// error.
func (f *fixture) run(h inbox.Handoff) (stop func() error) {
	f.t.Helper()
	s, err := New(f.src, f.cfg, nil)
	if err != nil {
		f.t.Fatal(err)
	}
	return runSource(f.t, s, &reporting{Handoff: h, states: f.states})
}

func runSource(t testing.TB, s inbox.Source, h inbox.Handoff) (stop func() error) {
	ctx, cancel := context.WithCancel(context.Background())
	errc := make(chan error, 1)
	go func() { errc <- s.Run(ctx, h) }()
	var once sync.Once
	var runErr error
	stop = func() error {
		once.Do(func() {
			cancel()
			select {
			case runErr = <-errc:
			case <-time.After(30 * time.Second):
				runErr = fmt.Errorf("Run did not return within 30s of its context ending")
			}
		})
		return runErr
	}
	t.Cleanup(func() {
		if err := stop(); err != nil {
			t.Errorf("Run: %v", err)
		}
	})
	return stop
}

// states records the source's Up and Down reports in order.
type states struct {
	mu   sync.Mutex
	seen []string
}

func (s *states) add(v string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.seen) == 0 || s.seen[len(s.seen)-1] != v {
		s.seen = append(s.seen, v)
	}
}

func (s *states) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return fmt.Sprint(s.seen)
}

// reporting passes a Handoff's calls on, recording Up and Down.
type reporting struct {
	inbox.Handoff
	states *states
}

func (r *reporting) Up() {
	r.states.add("up")
	r.Handoff.Up()
}

func (r *reporting) Down(err error) {
	r.states.add("down")
	r.Handoff.Down(err)
}

// outcomes passes a Handoff's calls on, recording what each message's
// deliveries were settled as.
type outcomes struct {
	inbox.Handoff
	mu   sync.Mutex
	byID map[string][]inbox.Outcome
}

func recordOutcomes(h inbox.Handoff) *outcomes {
	return &outcomes{Handoff: h, byID: map[string][]inbox.Outcome{}}
}

func (o *outcomes) Process(ctx context.Context, batch []*inbox.Delivery) {
	for _, d := range batch {
		settle, id := d.Settle, d.Message.ID
		d.Settle = func(ctx context.Context, out inbox.Outcome, after time.Duration) error {
			o.mu.Lock()
			o.byID[id] = append(o.byID[id], out)
			o.mu.Unlock()
			return settle(ctx, out, after)
		}
	}
	o.Handoff.Process(ctx, batch)
}

// count returns how many deliveries were settled as out.
func (o *outcomes) count(out inbox.Outcome) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	n := 0
	for _, os := range o.byID {
		for _, x := range os {
			if x == out {
				n++
			}
		}
	}
	return n
}

// counts returns how many times each id's work ran.
func (f *fixture) counts() map[string]int {
	f.t.Helper()
	rows, err := f.db.Pool.Query(context.Background(), `SELECT id, count(*) FROM seen GROUP BY id`)
	if err != nil {
		f.t.Fatal(err)
	}
	defer rows.Close()
	out := map[string]int{}
	for rows.Next() {
		var id string
		var n int
		if err := rows.Scan(&id, &n); err != nil {
			f.t.Fatal(err)
		}
		out[id] = n
	}
	if err := rows.Err(); err != nil {
		f.t.Fatal(err)
	}
	return out
}

func (f *fixture) scalar(sql string, args ...any) int {
	f.t.Helper()
	var n int
	if err := f.db.Pool.QueryRow(context.Background(), sql, args...).Scan(&n); err != nil {
		f.t.Fatal(err)
	}
	return n
}

// waitDone waits until n messages are finished in the inbox.
func (f *fixture) waitDone(n int) {
	f.t.Helper()
	testkit.Eventually(f.t, 60*time.Second, fmt.Sprintf("%d messages finished in the inbox", n), func() bool {
		return f.scalar(`SELECT count(*) FROM inbox_message WHERE state IN ('PROCESSED', 'DEAD')`) >= n
	})
}

// exactlyOnce checks that every id of evs ran exactly once.
func (f *fixture) exactlyOnce(evs []event) {
	f.t.Helper()
	counts := f.counts()
	for _, e := range evs {
		if counts[e.id] != 1 {
			f.t.Errorf("message %s processed %d times, want 1", e.id, counts[e.id])
		}
	}
	if len(counts) != len(evs) {
		f.t.Errorf("%d ids processed, want %d", len(counts), len(evs))
	}
}

// committed returns the group's committed offset per partition (absent:
// none committed).
func (f *fixture) committed(c *kgo.Client) map[int32]int64 {
	f.t.Helper()
	offs, err := kadm.NewClient(c).FetchOffsets(context.Background(), testGroup)
	if errors.Is(err, kerr.GroupIDNotFound) {
		return map[int32]int64{} // nothing committed yet
	}
	if err != nil {
		f.t.Fatal(err)
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
	f.t.Helper()
	testkit.Eventually(f.t, 60*time.Second, "offsets committed through the end", func() bool {
		ends, err := kadm.NewClient(c).ListEndOffsets(context.Background(), testTopic)
		if err != nil {
			f.t.Fatal(err)
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
