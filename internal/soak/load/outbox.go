package load

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Receiver is the outbox's webhook endpoint. It keeps, per aggregate, the
// next event number it expects: an event beyond it is out of order, one
// before it a duplicate (delivery is at least once). Its memory does not
// grow with the events, so a soak may run for hours.
type Receiver struct {
	URL string
	srv *httptest.Server

	mu         sync.Mutex
	next       []int // per aggregate
	firsts     int
	dups       int
	outOfOrder []string
	latencies  []time.Duration // from occurred_at to arrival, since the last Latencies
}

// NewReceiver starts a receiver for aggregates aggregates; Close stops it.
func NewReceiver(aggregates int) *Receiver {
	r := &Receiver{next: make([]int, aggregates)}
	r.srv = httptest.NewServer(r)
	r.URL = r.srv.URL
	return r
}

func (r *Receiver) Close() { r.srv.Close() }

func (r *Receiver) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	arrived := time.Now()
	body, err := io.ReadAll(req.Body)
	if err != nil {
		w.WriteHeader(http.StatusServiceUnavailable)
		return
	}
	var ev struct{ A, N int }
	occurred, terr := time.Parse(time.RFC3339Nano, req.Header.Get("Ce-Time"))
	r.mu.Lock()
	defer r.mu.Unlock()
	switch {
	case json.Unmarshal(body, &ev) != nil || ev.A < 0 || ev.A >= len(r.next):
		r.outOfOrder = append(r.outOfOrder, fmt.Sprintf("a malformed event: %q", body))
	case ev.N < r.next[ev.A]:
		r.dups++
	case ev.N > r.next[ev.A]:
		r.outOfOrder = append(r.outOfOrder, fmt.Sprintf("aggregate %d: event %d arrived before event %d", ev.A, ev.N, r.next[ev.A]))
		r.next[ev.A] = ev.N + 1
		r.firsts++
	default:
		r.next[ev.A]++
		r.firsts++
		if terr == nil {
			r.latencies = append(r.latencies, arrived.Sub(occurred))
		}
	}
	// Answered once recorded: an aggregate's next event is sent only after.
	w.WriteHeader(http.StatusNoContent)
}

// Firsts is how many events arrived in order for the first time.
func (r *Receiver) Firsts() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.firsts
}

// Outcome is what the receiver saw: duplicates (allowed) and deliveries
// out of order (none allowed).
func (r *Receiver) Outcome() (dups int, outOfOrder []string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.dups, slices.Clone(r.outOfOrder)
}

// LatencyP99 is the 99th percentile of the first deliveries' latencies
// since the last call, and how many there were.
func (r *Receiver) LatencyP99() (time.Duration, int) {
	r.mu.Lock()
	l := r.latencies
	r.latencies = nil
	r.mu.Unlock()
	if len(l) == 0 {
		return 0, 0
	}
	slices.Sort(l)
	return l[min(len(l)-1, len(l)*99/100)], len(l)
}

// Producer inserts outbox events at a steady rate over aggregates
// aggregates, in batches of one transaction each: event g is event
// g/aggregates of aggregate g%aggregates, payload {"a": …, "n": …}.
type Producer struct {
	aggregates int
	committed  atomic.Int64
	err        error
	stop       context.CancelFunc
	done       chan struct{}
}

const producerBatch = 10

// StartProducer starts inserting perSecond events a second until Stop.
func StartProducer(pool *pgxpool.Pool, aggregates, perSecond int) *Producer {
	ctx, stop := context.WithCancel(context.Background())
	p := &Producer{aggregates: aggregates, stop: stop, done: make(chan struct{})}
	go func() {
		defer close(p.done)
		p.err = p.run(ctx, pool, perSecond)
	}()
	return p
}

func (p *Producer) run(ctx context.Context, pool *pgxpool.Pool, perSecond int) error {
	every := time.Second * producerBatch / time.Duration(perSecond)
	next := time.Now()
	for batch := int64(0); ; batch++ {
		g := batch * producerBatch
		aggs, seqs := make([]int32, producerBatch), make([]int32, producerBatch)
		for i := range producerBatch {
			aggs[i], seqs[i] = int32((g+int64(i))%int64(p.aggregates)), int32((g+int64(i))/int64(p.aggregates))
		}
		err := retry(ctx, func() error {
			return pgx.BeginFunc(ctx, pool, func(tx pgx.Tx) error {
				if _, err := tx.Exec(ctx, `INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
					SELECT 'load', 'agg-' || a, 'load.tick', jsonb_build_object('a', a, 'n', n)
					FROM unnest($1::int[], $2::int[]) AS e(a, n)`, aggs, seqs); err != nil {
					return err
				}
				_, err := tx.Exec(ctx, `INSERT INTO load_produced VALUES ($1)`, batch)
				return err
			})
		}, func() (bool, error) {
			return exists(ctx, pool, `SELECT EXISTS (SELECT 1 FROM load_produced WHERE batch = $1)`, batch)
		})
		if err != nil {
			return nil // stopped
		}
		p.committed.Store(g + producerBatch)
		// On schedule, catching up on a slow insert, but not on an
		// outage: a second behind, the schedule starts again from now.
		next = next.Add(every)
		if behind := time.Since(next); behind > time.Second {
			next = time.Now()
		}
		if !sleep(ctx, time.Until(next)) {
			return nil
		}
	}
}

// Committed is how many events are committed.
func (p *Producer) Committed() int { return int(p.committed.Load()) }

// Stop stops inserting and returns how many events were committed.
func (p *Producer) Stop() int {
	p.stop()
	<-p.done
	return p.Committed()
}

// Lost is how many committed events have not arrived, once the producer
// stopped: per aggregate, what was produced less what arrived in order.
func (r *Receiver) Lost(produced, aggregates int) int {
	r.mu.Lock()
	defer r.mu.Unlock()
	lost := 0
	for a := range aggregates {
		want := produced / aggregates
		if a < produced%aggregates {
			want++
		}
		lost += max(0, want-r.next[a])
	}
	return lost
}
