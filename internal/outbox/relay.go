package outbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/obs"
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
// rows are immediately claimable again. A publish still outstanding after
// detach_after is marked IN_FLIGHT and finishes on its own (publish.go).
// A TxSink instead writes the batch in the claim transaction (sink_tx.go).
type Relay struct {
	pool       *pgxpool.Pool
	sink       Sink
	cfg        Config
	instanceID string
	log        *slog.Logger
	m          *metrics
	lockSQL    string
	extendSQL  string

	wake   []chan struct{} // one per loop; a token means "look again"
	shares *shares         // splits windows between the loops; nil with one loop
	slots  chan struct{}   // one token per publish in progress: max_in_flight
	// latency is a moving average of the sink's publish time, in
	// nanoseconds: above detach_after, the loops pipeline (slowSink).
	latency atomic.Int64
	sinkUp  *breaker // open while the sink is unavailable (breaker.go)

	marker marker       // this relay's, as its detaches name it (marker.go)
	watch  *markerWatch // the listener session's view of the markers; the listener's alone
	looks  atomic.Int64 // looks at the markers that succeeded

	mu           sync.Mutex
	started      bool
	hardCtx      context.Context // publishes; cancelled when the shutdown budget is gone
	hardCancel   context.CancelFunc
	claimCtx     context.Context // cancelled when claiming stops
	stopClaiming context.CancelFunc
	loops        sync.WaitGroup
	publishers   sync.WaitGroup // publish workers, detached ones included
	background   sync.WaitGroup
	stopped      chan struct{} // closed once the relay stopped and owes the database nothing

	detachedMu sync.Mutex
	detached   map[*claimedRow]string // committed IN_FLIGHT, outcome not recorded yet: event → owner token

	completing         sync.Mutex
	completions        []*completion // outcomes of detached publishes waiting to be written
	writingCompletions bool          // a publisher is writing completions; the others wait for it
}

// NewRelay builds a relay; Start runs it. reg receives the outbox metrics
// (nil: a private registry). instanceID is recorded as claimed_by and in
// logs.
func NewRelay(pool *pgxpool.Pool, sink Sink, cfg Config, instanceID string, log *slog.Logger, reg prometheus.Registerer) (*Relay, error) {
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	if pool == nil || sink == nil {
		return nil, errors.New("outbox: relay needs a pool and a sink")
	}
	if cfg.MaxInFlight == 0 {
		cfg.MaxInFlight = DefaultMaxInFlight(sink.Name())
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	m, err := newMetrics(reg, sink.Name())
	if err != nil {
		return nil, fmt.Errorf("outbox: register metrics: %w", err)
	}
	r := &Relay{
		pool:       pool,
		sink:       sink,
		cfg:        cfg,
		instanceID: instanceID,
		log:        log.With("job", RelayJobName, "sink", sink.Name()),
		m:          m,
		lockSQL:    lockSQL(cfg.BlockOnDead),
		extendSQL:  extendSQL(cfg.BlockOnDead),
		wake:       make([]chan struct{}, cfg.Relays),
		slots:      make(chan struct{}, cfg.MaxInFlight),
		stopped:    make(chan struct{}),
		detached:   map[*claimedRow]string{},
	}
	for i := range r.wake {
		r.wake[i] = make(chan struct{}, 1)
	}
	r.sinkUp = newBreaker(cfg.ProbeBackoffMax, r.breakerOpened, r.breakerClosed)
	if cfg.Relays > 1 {
		r.shares = newShares(r.wake)
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
	r.hardCtx, r.hardCancel = context.WithCancel(ctx)
	r.claimCtx, r.stopClaiming = context.WithCancel(r.hardCtx)
	for i := range r.cfg.Relays {
		r.loops.Add(1)
		go r.loop(i)
	}
	r.background.Add(3)
	go r.listen()
	go r.refreshMetrics()
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
		r.publishers.Wait() // every worker started by a loop, detached ones included
		close(idle)
	}()
	select {
	case <-idle:
		return
	case <-r.hardCtx.Done():
	}
	grace := time.NewTimer(cancelGrace)
	defer grace.Stop()
	select {
	case <-idle:
		return
	case <-grace.C:
	}
	r.loops.Wait() // every detached publish is now known
	r.handBackDetached()
}

// loop claims and publishes batches until claiming stops. While there is
// backlog it goes straight on, holding its connection, and each batch's
// outcomes are committed in the same round trip that opens the next batch;
// otherwise it waits for a notification or the poll interval.
func (r *Relay) loop(i int) {
	defer r.loops.Done()
	poll := time.NewTimer(r.cfg.PollInterval)
	defer poll.Stop()
	failures := 0
	st := loopState{loop: i}
	defer r.settle(&st)
	for r.claimCtx.Err() == nil {
		if r.sinkUp.open() {
			r.settle(&st) // hold no claim and no connection while the sink is down
		}
		probe, ok := r.sinkUp.admit(r.claimCtx)
		if !ok {
			break
		}
		n, err := r.runBatch(r.claimCtx, &st, probe)
		if probe && n == 0 {
			r.sinkUp.probeEnded()
		}
		if err != nil && r.claimCtx.Err() == nil {
			failures++
			r.log.Warn("outbox batch failed", "relay", i, "error", err, "consecutive_failures", failures)
			// Back off (up to the poll interval) so a database outage is
			// not hammered by every loop.
			wait(r.claimCtx, backoff(50*time.Millisecond, r.cfg.PollInterval, failures))
			continue
		}
		failures = 0
		if n > 0 || st.again {
			continue
		}
		r.settle(&st)
		poll.Reset(r.cfg.PollInterval)
		select {
		case <-r.claimCtx.Done():
		case <-r.wake[i]:
		case <-poll.C:
		}
	}
}

// wakeAll tells every loop to look for work.
func (r *Relay) wakeAll() {
	for _, w := range r.wake {
		wake(w)
	}
}

// wake leaves a loop the token that makes it look again.
func wake(w chan struct{}) {
	select {
	case w <- struct{}{}:
	default: // a token is already waiting
	}
}

// loopState is what a relay loop carries from one batch to the next.
type loopState struct {
	loop         int            // the loop's index, which is also its share of the windows
	size         int            // events the next claim takes: batch_size, or fewer for a slow sink (nextSize)
	window       int            // rows the next window claim reads
	again        bool           // claim again at once: the window was widened, or a share was stale
	probe        bool           // the claim is the probe of an open breaker: one event
	conn         *pgxpool.Conn  // held while batches follow each other
	pending      *outcomes      // the last batch's outcomes, not yet committed
	kept         []aggregateKey // the aggregates of the last sink-bound batch (keptHeadsSQL)
	behind       aggregateKey   // where the next look behind the window starts
	lookedBehind time.Time      // when the loop last looked behind the window
}

// settle commits the pending outcomes, if any, and gives the connection
// back to the pool.
func (r *Relay) settle(st *loopState) {
	if r.shares != nil {
		r.shares.hold(st.loop, nil)
	}
	if st.conn == nil {
		return
	}
	if st.pending != nil {
		ctx, cancel := context.WithTimeout(context.Background(), finishTimeout)
		b := &pgx.Batch{}
		r.queueFinish(b, st.pending)
		err := st.conn.Conn().SendBatch(ctx, b).Close()
		cancel()
		r.finished(st.conn.Conn(), st.pending, err)
		st.pending = nil
	}
	st.conn.Release()
	st.conn = nil
}

// failure is the outcome of a failed publish.
type failure struct {
	ev     claimedRow
	err    error
	status string // FAILED or DEAD
	delay  time.Duration
}

// outcomes of a batch.
type outcomes struct {
	claimed   int
	published []*claimedRow
	at        []time.Time // when each was accepted, on the database clock
	failed    []failure
	handBack  []*claimedRow
	detached  []*claimedRow // still being published: written IN_FLIGHT under token
	token     string
	started   int           // events whose publish started
	cutShort  bool          // detach_after ended the batch before all its events were published
	settled   chan struct{} // closed once the outcomes are committed or rolled back
	committed bool          // read after settled is closed
}

// runBatch claims one batch and publishes it, or a single event when it is
// the probe of an open breaker. It returns the number of events claimed.
// The outcomes are committed with the next claim, or by settle.
func (r *Relay) runBatch(ctx context.Context, st *loopState, probe bool) (int, error) {
	_, txSink := r.sink.(TxSink)
	limit, reserved := 0, 0 // 0: claim st.size
	switch {
	case probe:
		limit = 1
	case !txSink && r.slowSink():
		if reserved = r.reserveSlots(ctx, st); reserved == 0 {
			return 0, nil // stopping
		}
		limit = reserved
	}
	if st.conn == nil {
		conn, err := r.pool.Acquire(ctx)
		if err != nil {
			r.releaseSlots(reserved)
			return 0, err
		}
		st.conn = conn
	}
	st.probe = probe
	runs, skew, err := r.claim(ctx, st, limit)
	if r.shares != nil {
		r.shares.hold(st.loop, runs)
	}
	r.keep(st, runs)
	if err != nil {
		r.releaseSlots(reserved)
		rollback(st.conn.Conn())
		st.conn.Release()
		st.conn = nil
		return 0, err
	}
	n := 0
	for _, run := range runs {
		n += len(run)
	}
	if n == 0 {
		r.releaseSlots(reserved)
		rollback(st.conn.Conn())
		return 0, nil
	}
	claimedAt := time.Now()
	r.m.batchSize.Observe(float64(n))
	r.m.claimed.Add(float64(n))

	var out *outcomes
	if ts, ok := r.sink.(TxSink); ok {
		out = r.publishTx(ts, st.conn.Conn(), runs, skew)
	} else {
		out = r.publish(st.conn.Conn(), runs, claimedAt, skew, probe, reserved)
		r.sinkWideFailure(out)
		if limit == 0 {
			st.size = r.nextSize(st.size, out)
		}
	}
	out.claimed += n // the runs extended meanwhile counted theirs
	st.pending = out
	if r.claimCtx.Err() != nil {
		r.settle(st) // stopping: commit now, there is no next claim
	}
	return n, nil
}

// claim commits the previous batch's outcomes, opens the batch transaction
// and locks a batch: heads from the window and their runs, topped up by
// heads from behind the window when it is blocked: limit events, or
// st.size when limit is 0. It returns the runs to publish, oldest head
// first, and the database clock minus ours.
func (r *Relay) claim(ctx context.Context, st *loopState, limit int) ([][]claimedRow, time.Duration, error) {
	if st.size == 0 {
		st.size = r.cfg.BatchSize
	}
	n := st.size
	switch {
	case limit > 0:
		n = limit
	case r.sinkBound():
		n = r.sinkBoundClaim()
	}
	st.window = max(st.window, r.minWindow())
	// A share left from a sibling's window needs no window of its own. A
	// probe reads one: it picks among the whole window's aggregates.
	var cands []*candidate
	var gen uint64 // of the share cands come from
	if r.shares != nil && !st.probe {
		cands, gen = r.shares.take(st.loop, n, r.depth(n), r.spares())
	}
	conn := st.conn.Conn()
	b := &pgx.Batch{}
	fin := st.pending
	st.pending = nil
	finishing := 0
	sendCtx := ctx
	if fin != nil {
		finishing = r.queueFinish(b, fin)
		// The previous batch's outcomes must be written even if claiming
		// stops meanwhile. Only this round trip is bound by the finish
		// timeout; the locks below may take longer.
		var cancel context.CancelFunc
		sendCtx, cancel = context.WithTimeout(context.WithoutCancel(ctx), finishTimeout)
		defer cancel()
	}
	b.Queue("BEGIN")
	// If the relay stalls (process frozen, network gone) while holding its
	// claims, the server ends the session after the visibility timeout,
	// which releases them.
	b.Queue(beginClaimSQL, strconv.FormatInt(r.cfg.InFlightTimeout.Milliseconds(), 10))
	fromShare := len(cands) > 0
	// One loop's window is all its own and holds the kept heads when they
	// are among the oldest: offering them too lowered one loop over 200
	// aggregates at 20 ms from 0.87 to 0.77 of the ideal. A sink slower
	// than detach_after detaches every publish, so the kept heads are
	// IN_FLIGHT, not due.
	keeping := r.shares != nil && !st.probe && len(st.kept) > 0 && r.sinkBound() && !r.slowSink()
	if keeping {
		types, ids := make([]string, len(st.kept)), make([]string, len(st.kept))
		for i, k := range st.kept {
			types[i], ids[i] = k.typ, k.id
		}
		b.Queue(keptHeadsSQL, types, ids, r.depth(n))
	}
	if !fromShare {
		b.Queue(windowSQL, st.window)
	}
	res := conn.SendBatch(sendCtx, b)
	defer res.Close()
	var err error
	for range finishing {
		if _, err = res.Exec(); err != nil {
			break
		}
	}
	if fin != nil {
		if err != nil {
			_ = res.Close() // the connection must be idle before the rollback
			r.finished(conn, fin, err)
			return nil, 0, err
		}
		r.finished(conn, fin, nil)
	}
	if _, err := res.Exec(); err != nil {
		return nil, 0, err
	}
	var dbNow time.Time
	if err := res.QueryRow().Scan(nil, nil, &dbNow); err != nil {
		return nil, 0, err
	}
	skew := time.Until(dbNow) // database clock minus ours
	var kept []*candidate
	if keeping {
		heads, err := readWindow(res.Query())
		if err != nil {
			return nil, 0, err
		}
		kept = candidates(heads)
	}
	var win []windowRow
	var all []*candidate // the whole window's, for all loops
	if !fromShare {
		if win, err = readWindow(res.Query()); err != nil {
			return nil, 0, err
		}
		all = candidates(win)
		switch {
		case st.probe:
			cands = r.sinkUp.unprobed(all)
		case r.shares != nil:
			cands, gen = r.shares.split(all, st.loop, n, r.depth(n), r.spares())
		default:
			cands = all
		}
	}
	if err := res.Close(); err != nil {
		return nil, 0, err
	}
	if err := ctx.Err(); err != nil {
		return nil, 0, err // stopping: lock nothing only to hand it back
	}
	cands = withKept(cands, kept)

	runs, rest, err := r.lockWindow(ctx, conn, cands, n, r.depth(n))
	if err == nil && st.probe && len(runs) == 0 && len(all) > 0 {
		// Every due aggregate of the window failed as unavailable since
		// the sink last answered: probe one behind the window, or, when
		// there is none, the oldest again.
		if runs, err = r.lockBehind(ctx, conn, st, nil, 1); err == nil && len(runs) == 0 {
			r.sinkUp.forgetFailed()
			runs, _, err = r.lockWindow(ctx, conn, all, 1, 0)
		}
	}
	if err != nil {
		return nil, 0, err
	}
	if r.shares != nil && !st.probe {
		r.shares.giveBack(st.loop, gen, rest)
	}
	got := 0
	for _, run := range runs {
		got += len(run)
	}

	// Size the next window. A window that yields less than half a batch is
	// congested: other relays hold its aggregates, or they wait for a
	// retry. Widen it, so the loop sees aggregates nobody holds. Only when
	// the widest window offers fewer than half a batch of aggregates (the
	// rest wait for retries or for outstanding publishes, or one aggregate
	// fills it) does the loop look behind it, at most once per poll
	// interval, so that the aggregates behind cannot starve. Many
	// aggregates that other relays hold are no reason to look behind: those
	// relays are working, and the window moves on as they finish.
	congested := !fromShare && got < (n+1)/2 && len(win) >= st.window
	blocked := len(all) < (n+1)/2
	// A share whose heads others took meanwhile says nothing about the
	// backlog: read a window at once rather than sleep.
	st.again = fromShare && got == 0
	switch {
	case congested && st.window < maxWindowFactor*r.cfg.BatchSize:
		st.window *= 2
		st.again = true
	case congested && blocked && time.Since(st.lookedBehind) >= r.cfg.PollInterval:
		st.lookedBehind = time.Now()
		more, err := r.lockBehind(ctx, conn, st, runs, n-got)
		if err != nil {
			return nil, 0, err
		}
		runs = append(runs, more...)
	case !fromShare && got >= n && st.window > r.minWindow():
		st.window /= 2
	}
	return runs, skew, nil
}

// minWindow is the window a claim reads when nothing is congested. With
// several loops, one window read serves them all (see shares), and its
// oldest rows are mostly the siblings' batches being published, so it
// holds two batches per loop.
func (r *Relay) minWindow() int {
	if r.cfg.Relays == 1 {
		return r.cfg.BatchSize
	}
	return r.cfg.BatchSize * min(2*r.cfg.Relays, maxWindowFactor)
}

// lockBehind locks up to n heads of aggregates anywhere in the backlog,
// visiting at most maxWindowFactor*batch_size aggregates from where the
// last look ended, so successive looks cover every aggregate in turn. The
// aggregates of runs, which this transaction already holds, are left out:
// their heads would lock again (a transaction's own locks never skip).
func (r *Relay) lockBehind(ctx context.Context, conn *pgx.Conn, st *loopState, runs [][]claimedRow, n int) ([][]claimedRow, error) {
	visit := maxWindowFactor * r.cfg.BatchSize
	heads, err := readWindow(conn.Query(ctx, aggregateHeadsSQL, st.behind.typ, st.behind.id, visit))
	if err != nil {
		return nil, err
	}
	st.behind = aggregateKey{}
	if len(heads) == visit {
		st.behind = heads[len(heads)-1].key
	}
	held := make(map[aggregateKey]bool, len(runs))
	for _, run := range runs {
		held[run[0].key()] = true
	}
	heads = slices.DeleteFunc(heads, func(h windowRow) bool { return held[h.key] })
	cands := candidates(heads)
	if st.probe {
		cands = r.sinkUp.unprobed(cands)
	}
	locked, _, err := r.lockWindow(ctx, conn, cands, n, r.depth(n))
	return locked, err
}

// maxWindowFactor bounds the window at this many batches.
const maxWindowFactor = 8

// nextSize is how many events the loop claims after a batch that claimed
// size. A batch that detach_after cut short claimed more than the sink took
// in that time: the events it never started were read and locked for
// nothing, and handed back. So the next claim takes as many as this one
// started, at least one; a batch that finished doubles it again, up to
// batch_size. Only a sink slower than batch_size events per detach_after
// (or a hung call) makes batches smaller.
func (r *Relay) nextSize(size int, out *outcomes) int {
	if out.cutShort {
		return max(1, min(size, out.started))
	}
	return min(r.cfg.BatchSize, 2*size)
}

// depth is the longest run of one aggregate a claim of n events takes: n
// spread over max_in_flight aggregates once n is below batch_size. An
// aggregate's events are published one after another, so a slow sink gets
// through a batch faster as many short runs than as a few long ones. With
// a sink-bound relay, what one slot publishes before detach_after (runLen).
// Zero: no bound.
func (r *Relay) depth(n int) int {
	if r.sinkBound() {
		return r.runLen()
	}
	if n >= r.cfg.BatchSize {
		return 0
	}
	return (n + r.cfg.MaxInFlight - 1) / r.cfg.MaxInFlight
}

// lockWindow locks heads and their runs, up to n events, in one statement.
// Runs are cut to depth events (0: no bound). It returns one run per locked
// head: the head, then as much of its run as came back locked, in order;
// and the candidates the statement never came to, because it had its heads
// before them.
func (r *Relay) lockWindow(ctx context.Context, conn *pgx.Conn, cands []*candidate, n, depth int) (runs [][]claimedRow, rest []*candidate, err error) {
	if len(cands) == 0 {
		return nil, nil, nil
	}
	runOf := func(c *candidate) []windowRow {
		if depth > 0 {
			return c.run[:min(len(c.run), depth-1)] // a prefix: the rest waits, in order
		}
		return c.run
	}
	// As many heads as a batch needs at the window's mean run length.
	events := 0
	heads := make([]pgtype.TID, len(cands))
	var runTIDs, runHeads []pgtype.TID
	for i, c := range cands {
		heads[i] = c.head.tid
		events += 1 + len(runOf(c))
		for _, w := range runOf(c) {
			runTIDs = append(runTIDs, w.tid)
			runHeads = append(runHeads, c.head.tid)
		}
	}
	want := min(len(cands), (n*len(cands)+events-1)/events)
	lockedHeads, lockedRuns, err := readEvents(conn.Query(ctx, r.lockSQL, heads, want, runTIDs, runHeads, n))
	if err != nil || len(lockedHeads) == 0 {
		return nil, nil, err
	}
	if len(lockedHeads) == want {
		// Heads are locked oldest first: the statement stopped at the last.
		last := lockedHeads[len(lockedHeads)-1].Seq
		for _, c := range cands {
			if c.head.id > last {
				rest = append(rest, c)
			}
		}
	}
	byTID := make(map[pgtype.TID]*candidate, len(cands))
	for _, c := range cands {
		byTID[c.head.tid] = c
	}
	locked := make(map[pgtype.TID]claimedRow, len(lockedRuns))
	for _, row := range lockedRuns {
		locked[row.tid] = row
	}
	// Heads came back oldest first.
	runs = make([][]claimedRow, 0, len(lockedHeads))
	for _, h := range lockedHeads {
		c := byTID[h.tid]
		if c == nil || c.head.id != h.Seq {
			continue // not the row the window saw there: not a head we know
		}
		run := []claimedRow{h}
		for _, w := range runOf(c) {
			row, ok := locked[w.tid]
			if !ok || row.Seq != w.id {
				break // the rest of this aggregate waits
			}
			run = append(run, row)
		}
		runs = append(runs, run)
	}
	return runs, rest, nil
}

// classify turns a publish error into the event's next state.
func (r *Relay) classify(ev claimedRow, err error) failure {
	f := failure{ev: ev, err: err, status: StatusFailed}
	attempts := ev.Attempts + 1
	if IsPermanent(err) || attempts >= r.cfg.MaxAttempts {
		f.status = StatusDead
		return f
	}
	f.delay = retryDelay(r.cfg.BackoffBase, r.cfg.BackoffMax, attempts, err)
	return f
}

// queueFinish queues the writes of a batch's outcomes and its COMMIT, and
// returns how many statements it queued.
func (r *Relay) queueFinish(b *pgx.Batch, out *outcomes) int {
	if len(out.published) > 0 {
		tids := make([]pgtype.TID, len(out.published))
		for i, ev := range out.published {
			tids[i] = ev.tid
		}
		b.Queue(markPublishedSQL, tids, r.instanceID)
	}
	if len(out.failed) > 0 {
		tids := make([]pgtype.TID, len(out.failed))
		statuses := make([]string, len(out.failed))
		delays := make([]int64, len(out.failed))
		errs := make([]string, len(out.failed))
		for i, f := range out.failed {
			tids[i], statuses[i], delays[i] = f.ev.tid, f.status, f.delay.Milliseconds()
			errs[i] = errorText(f.err)
		}
		b.Queue(markFailedSQL, tids, statuses, delays, errs, r.instanceID)
	}
	if len(out.detached) > 0 {
		tids := make([]pgtype.TID, len(out.detached))
		for i, ev := range out.detached {
			tids[i] = ev.tid
		}
		if id, pid, ok := r.marker.current(); ok {
			b.Queue(markInFlightNamedSQL, tids, r.cfg.InFlightTimeout.Milliseconds(), out.token, id, int32(pid))
		} else {
			b.Queue(markInFlightSQL, tids, r.cfg.InFlightTimeout.Milliseconds(), out.token)
		}
	}
	var back []pgtype.TID
	for _, ev := range out.handBack {
		if ev.status != StatusPending {
			back = append(back, ev.tid)
		}
	}
	if len(back) > 0 {
		b.Queue(handBackSQL, back)
	}
	if len(out.detached) == 0 {
		// The commit travels with the next claim, so its WAL flush would
		// delay that claim's window. Losing it in a server crash only
		// means publishing its events again (at least once), in order: WAL
		// is replayed in order, so a later batch's outcomes never survive
		// an earlier one's. Not so for IN_FLIGHT marks: a lost one would
		// let another relay publish the event while it is still being
		// published, so those commits wait for the flush.
		b.Queue("SET LOCAL synchronous_commit = off")
	}
	b.Queue("COMMIT")
	return b.Len()
}

// finished accounts for a batch whose outcomes were written (err == nil)
// or lost (the transaction rolled back: the rows stay as they were and the
// published events will be published again, at least once).
func (r *Relay) finished(conn *pgx.Conn, out *outcomes, err error) {
	// Detached events stay claimed until their own outcome is written.
	r.m.claimed.Sub(float64(out.claimed - len(out.detached)))
	out.committed = err == nil
	if out.committed {
		r.trackDetached(out)
	}
	close(out.settled)
	if err != nil {
		rollback(conn)
		if r.hardCtx.Err() == nil {
			r.log.Warn("outbox batch outcomes not recorded; its events will be published again",
				"events", out.claimed, "error", err)
		}
		return
	}
	r.record(out)
}

// record updates metrics and logs once the outcomes are committed.
func (r *Relay) record(out *outcomes) {
	counts := map[string]int{}
	for i, ev := range out.published {
		counts[ev.EventType]++
		r.m.observeLatency(out.at[i].Sub(ev.OccurredAt))
	}
	for t, n := range counts {
		r.m.published.WithLabelValues(r.m.eventType(t)).Add(float64(n))
	}
	for _, f := range out.failed {
		kind := kindTransient
		if IsPermanent(f.err) {
			kind = kindPermanent
		}
		r.m.failures.WithLabelValues(r.m.eventType(f.ev.EventType), kind).Inc()
		attrs := []any{
			"event_id", f.ev.EventID, "aggregate_type", f.ev.AggregateType, "aggregate_id", f.ev.AggregateID,
			"event_type", f.ev.EventType, "attempts", f.ev.Attempts + 1, "error", f.err,
		}
		if f.status == StatusDead {
			r.m.dlq.WithLabelValues(RelayJobName).Inc()
			r.log.Error("outbox event dead-lettered", append(attrs, "error.code", obs.CodeJobDeadLetter, "permanent", kind == kindPermanent)...)
			continue
		}
		r.m.retry.WithLabelValues(RelayJobName, "scheduled").Inc()
		r.log.Warn("outbox publish failed; retry scheduled", append(attrs, "retry_in", f.delay)...)
	}
}

func rollback(conn *pgx.Conn) {
	// A connection left inside a transaction is destroyed by the pool on
	// release, which also rolls back; this is the cheaper path.
	ctx, cancel := context.WithTimeout(context.Background(), finishTimeout)
	defer cancel()
	if conn.PgConn().TxStatus() != 'I' {
		_, _ = conn.Exec(ctx, "ROLLBACK")
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
