package outbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
)

// NotifyChannel is the LISTEN/NOTIFY channel the insert trigger signals.
const NotifyChannel = "outbox_event"

// finishTimeout bounds the final write of a batch. It runs even after a
// hard stop, because it is what hands unpublished claims back.
const finishTimeout = 5 * time.Second

// cancelGrace is how long a detached publish may take to return once a hard
// stop cancelled it. A sink that honours its context returns at once and
// the publish records its own outcome; after that its event is handed back
// without it.
const cancelGrace = 500 * time.Millisecond

// Relay publishes outbox events to a sink. It runs cfg.Relays loops; each
// loop claims a batch by locking rows in a transaction, publishes it
// (different aggregates at once, each aggregate in order), records every
// outcome and commits. The row locks are the claim: other relays skip
// them, and if this process dies the database drops them at once, so the
// rows are immediately claimable again.
//
// The Relay itself only starts, runs and stops the parts (see "How the
// relay is built" in docs/outbox-internals.md):
//   - a claimer per loop (claim.go) owns the loop's connection and claim
//     transaction: windows, shares, locks, the commit of the outcomes;
//   - the publisher (publish.go), chosen once for the sink: concurrent
//     publishes with slots, pacing and the breaker, or, for a TxSink,
//     writes in the claim transaction (sink_tx.go);
//   - the completer (complete.go) writes the outcomes of detached
//     publishes and hands them back at a hard stop;
//   - the reporter (report.go) turns committed outcomes into metrics and
//     logs; the gauges (gauges.go) and the listener (listen.go) run on
//     their own.
//
// A loop hands its claimer's batch (a claim) to the publisher and the
// outcomes back to the claimer, which commits them with its next claim.
type Relay struct {
	cfg      outboxconfig.Config
	log      *slog.Logger
	m        *metrics // every collector is safe for concurrent use
	wake     wakers
	brk      *breaker
	claimers []*claimer // claimers[i] is loop i's alone
	pub      publishing
	done     *completer
	listener *listener
	gauges   *gauges
	// life is filled in by Start before any goroutine that reads it runs,
	// and is read-only after.
	life *lifetime

	// Start sets started and the cancel functions under mu; Shutdown reads
	// them after reading started under mu.
	mu           sync.Mutex
	started      bool
	hardCancel   context.CancelFunc
	stopClaiming context.CancelFunc
	loops        sync.WaitGroup // the loops
	background   sync.WaitGroup // the listener, the gauges and windDown
	stopped      chan struct{}  // closed once the relay stopped and owes the database nothing
}

// lifetime is the relay's two stop signals, shared by its parts.
type lifetime struct {
	hard     context.Context // publishes; cancelled when the shutdown budget is gone
	claiming context.Context // cancelled when claiming stops; a child of hard
}

// NewRelay builds a relay; Start runs it. reg receives the outbox metrics
// (nil: a private registry). instanceID is recorded as claimed_by and in
// logs.
func NewRelay(pool *pgxpool.Pool, sink Sink, cfg outboxconfig.Config, instanceID string, log *slog.Logger, reg prometheus.Registerer) (*Relay, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if pool == nil || sink == nil {
		return nil, errors.New("outbox: relay needs a pool and a sink")
	}
	if cfg.MaxInFlight == 0 {
		cfg.MaxInFlight = outboxconfig.DefaultMaxInFlight(sink.Name())
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	m, err := newMetrics(reg, sink.Name())
	if err != nil {
		return nil, fmt.Errorf("outbox: register metrics: %w", err)
	}
	m.interval.Set(cfg.PartitionInterval.Seconds())
	log = log.With("job", RelayJobName, "sink", sink.Name())
	wake := newWakers(cfg.Relays)
	r := &Relay{
		cfg:     cfg,
		log:     log,
		m:       m,
		wake:    wake,
		life:    &lifetime{},
		stopped: make(chan struct{}),
	}
	rep := &reporter{m: m, log: log, pool: pool, probeBackoffMax: cfg.ProbeBackoffMax}
	r.brk = newBreaker(cfg.ProbeBackoffMax, rep.sinkDown, func(openFor time.Duration) {
		wake.all() // loops idle since before the outage look again at once
		rep.sinkBack(openFor)
	})
	r.done = newCompleter(pgCompletions{pool: pool, instanceID: instanceID}, rep, m, log)
	policy := retryPolicy{maxAttempts: cfg.MaxAttempts, base: cfg.BackoffBase, max: cfg.BackoffMax}
	if ts, ok := sink.(TxSink); ok {
		r.pub = &txPublisher{sink: ts, policy: policy, life: r.life, inFlightTimeout: cfg.InFlightTimeout}
	} else {
		r.pub = newPublisher(sink, cfg, instanceID, policy, r.brk, rep, r.done, r.life, log)
	}
	r.listener = newListener(pool, cfg.InFlightTimeout, log, wake.all)
	r.gauges = &gauges{pool: pool, m: m, interval: cfg.MetricsInterval, log: log}
	var sh *shares
	if cfg.Relays > 1 {
		sh = newShares(wake)
	}
	stmts := &claimSQL{lock: lockSQL(cfg.BlockOnDead), extend: extendSQL(cfg.BlockOnDead)}
	fin := finishSQL{instanceID: instanceID, inFlightTimeout: cfg.InFlightTimeout, marker: &r.listener.marker}
	for i := range cfg.Relays {
		r.claimers = append(r.claimers, &claimer{
			loop: i, pool: pool, cfg: cfg, sql: stmts, fin: fin, shares: sh, brk: r.brk,
			done: r.done, rep: rep, m: m, log: log, life: r.life,
		})
	}
	return r, nil
}

// Start runs the relay loops, the LISTEN connection and the metrics
// refresher, and returns. Cancelling ctx is a hard stop: publishes in
// progress are cancelled and their events handed back, detached ones
// included (see windDown). Use Shutdown for a graceful stop.
func (r *Relay) Start(ctx context.Context) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.started {
		return errors.New("outbox: relay already started")
	}
	r.started = true
	r.life.hard, r.hardCancel = context.WithCancel(ctx)
	r.life.claiming, r.stopClaiming = context.WithCancel(r.life.hard)
	for _, c := range r.claimers {
		r.loops.Add(1)
		go r.loop(c)
	}
	r.background.Add(3)
	go r.listen()
	go func() {
		defer r.background.Done()
		r.gauges.run(r.life.claiming)
	}()
	go r.windDown()
	r.log.Info("outbox relay started", "relays", r.cfg.Relays, "batch_size", r.cfg.BatchSize, "block_on_dead", r.cfg.BlockOnDead)
	return nil
}

// Shutdown stops claiming, lets the publishes in progress finish while ctx
// allows, detached ones included, hands every claimed but unpublished
// event back (as PENDING, no attempt used) and waits for the relay to stop.
// If ctx ends first, it is a hard stop (see windDown), and Shutdown
// returns ctx.Err() once that has handed everything back.
func (r *Relay) Shutdown(ctx context.Context) error {
	r.mu.Lock()
	started := r.started
	r.mu.Unlock()
	if !started {
		return nil
	}
	r.stopClaiming()
	var err error
	select {
	case <-r.stopped:
	case <-ctx.Done():
		err = ctx.Err()
	}
	r.hardCancel()      // a hard stop, unless the relay stopped already
	r.background.Wait() // windDown included
	r.log.Info("outbox relay stopped", "graceful", err == nil)
	return err
}

// listen runs the listener until the relay has stopped: it holds the
// marker that detached events name, so it outlives claiming and lasts
// while detached publishes finish.
func (r *Relay) listen() {
	defer r.background.Done()
	ctx, cancel := context.WithCancel(context.WithoutCancel(r.life.hard))
	go func() {
		<-r.stopped
		cancel()
	}()
	r.listener.run(ctx)
}

// windDown closes r.stopped once the loops have committed their last
// batches and every detached publish has recorded its outcome. After a
// hard stop it waits for that at most cancelGrace, plus the loops' last
// batches (cut at detach_after, written within finishTimeout); detached
// publishes still outstanding then, whose sink ignores the cancellation,
// have their events handed back, so they are published again at once,
// not after in_flight_timeout.
func (r *Relay) windDown() {
	defer r.background.Done()
	defer close(r.stopped)
	idle := make(chan struct{})
	go func() {
		r.loops.Wait()
		r.pub.wait() // every worker started by a loop, detached ones included
		close(idle)
	}()
	select {
	case <-idle:
		return
	case <-r.life.hard.Done():
	}
	grace := time.NewTimer(cancelGrace)
	defer grace.Stop()
	select {
	case <-idle:
		return
	case <-grace.C:
	}
	r.loops.Wait() // every detached publish is now known
	r.done.handBackOutstanding()
}

// loop claims and publishes batches until claiming stops. While there is
// backlog it goes straight on, its claimer holding its connection, and
// each batch's outcomes are committed in the same round trip that opens
// the next batch; otherwise it waits for a notification or the poll
// interval.
func (r *Relay) loop(c *claimer) {
	defer r.loops.Done()
	ctx := r.life.claiming
	poll := time.NewTimer(r.cfg.PollInterval)
	defer poll.Stop()
	failures := 0
	defer c.settle()
	for ctx.Err() == nil {
		if r.brk.open() {
			c.settle() // hold no claim and no connection while the sink is down
		}
		probe, ok := r.brk.admit(ctx)
		if !ok {
			break
		}
		n, err := r.runBatch(ctx, c, probe)
		if probe && n == 0 {
			r.brk.probeEnded()
		}
		if err != nil && ctx.Err() == nil {
			failures++
			r.log.Warn("outbox batch failed", "relay", c.loop, "error", err, "consecutive_failures", failures)
			// Back off (up to the poll interval) so a database outage is
			// not hammered by every loop.
			wait(ctx, backoff(50*time.Millisecond, r.cfg.PollInterval, failures))
			continue
		}
		failures = 0
		if n > 0 && c.drained && !woken(r.wake[c.loop]) {
			// Nothing was left behind the batch and nothing came since:
			// the next claim would only commit its outcomes and find
			// nothing. Commit them now and wait, a round trip and a
			// window read fewer for every event at a low rate.
			n = 0
		}
		if n > 0 || c.again {
			continue
		}
		c.settle()
		poll.Reset(r.cfg.PollInterval)
		select {
		case <-ctx.Done():
		case <-r.wake[c.loop]:
		case <-poll.C:
		}
	}
}

// runBatch is one turn of a loop: the publisher paces the claim, the
// claimer claims it, the publisher publishes it, and the claimer keeps the
// outcomes to commit with its next claim. It returns the number of events
// claimed.
func (r *Relay) runBatch(ctx context.Context, c *claimer, probe bool) (int, error) {
	pc, ok := r.pub.pace(ctx, probe, false)
	if !ok {
		c.settle() // hold no claim and no connection while waiting for a slot
		if pc, ok = r.pub.pace(ctx, probe, true); !ok {
			return 0, nil // stopping
		}
	}
	cl, err := c.claim(ctx, pc)
	if err != nil || cl == nil {
		r.pub.unreserve(pc)
		return 0, err
	}
	c.hold(r.pub.publish(cl), pc)
	return cl.events, nil
}

// wakers are the loops' wake-up channels, one each: a token means "look
// again". Anyone may send; only loop i receives from wakers[i].
type wakers []chan struct{}

func newWakers(n int) wakers {
	w := make(wakers, n)
	for i := range w {
		w[i] = make(chan struct{}, 1)
	}
	return w
}

// all tells every loop to look for work.
func (w wakers) all() {
	for _, c := range w {
		wake(c)
	}
}

// wake leaves a loop the token that makes it look again.
func wake(w chan struct{}) {
	select {
	case w <- struct{}{}:
	default: // a token is already waiting
	}
}

// woken takes a token from w if there is one: someone asked the loop to
// look again.
func woken(w chan struct{}) bool {
	select {
	case <-w:
		return true
	default:
		return false
	}
}

func wait(ctx context.Context, d time.Duration) {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C:
	}
}

// errorText is err's message as storable text: bounded, valid UTF-8 and
// free of NUL bytes, which a text column rejects.
func errorText(err error) string {
	s := err.Error()
	if len(s) > 2000 {
		s = s[:2000]
	}
	return strings.ReplaceAll(strings.ToValidUTF8(s, ""), "\x00", "")
}
