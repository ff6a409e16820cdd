package outbox

import (
	"context"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
)

// claimer claims one loop's batches. It owns the loop's connection and the
// claim transaction open on it: it reads windows and shares, locks heads
// and runs, and commits each batch's outcomes in the round trip that opens
// the next batch (or in settle). The publisher reaches the transaction
// only through the claim it is handed (claimTxn), on the loop's goroutine.
//
// Every field is the loop goroutine's alone, except where noted.
type claimer struct {
	loop   int // the loop's index, which is also its share of the windows
	pool   *pgxpool.Pool
	cfg    outboxconfig.Config
	sql    *claimSQL  // read-only
	fin    finishSQL  // read-only
	shares *shares    // shared by the loops under its own mutex; nil with one loop
	brk    *breaker   // a probe's choice of aggregates (unprobed, forgetFailed)
	done   *completer // told of the detached events each commit leaves IN_FLIGHT
	rep    *reporter
	m      *metrics
	log    *slog.Logger
	life   *lifetime

	size         int            // events the next claim takes when its pace leaves it to the claimer: batch_size, or fewer (nextSize)
	window       int            // rows the next window claim reads
	again        bool           // claim again at once: the window was widened, or a share was stale; read by the loop
	drained      bool           // the last claim took every live event its window read, and the window was not full; read by the loop
	conn         *pgxpool.Conn  // held while batches follow each other
	replan       bool           // conn's plans may predate the backlog: drop them at its first full batch
	claimed      int            // events locked in the open claim transaction, extensions included
	pending      *outcomes      // the last batch's outcomes, not yet committed
	kept         []aggregateKey // the aggregates of the last sink-bound batch (keptHeadsSQL)
	behind       aggregateKey   // where the next look behind the window starts
	lookedBehind time.Time      // when the loop last looked behind the window
}

// replanClaim is the claim size (or batch_size, if smaller) at which a
// claimer's connection plans its statements afresh (claim). Loops that
// split a window take less than a full batch each.
const replanClaim = 100

// claimSQL are the claim statements that depend on the configuration.
type claimSQL struct {
	lock   string // lockSQL
	extend string // extendSQL
}

// claim is what a claimer hands the publisher: one batch's runs, each an
// aggregate's events in order, locked in the claimer's open transaction,
// and the one way into that transaction (tx). The publisher returns the
// batch's outcomes, which the claimer commits.
type claim struct {
	pace   pace
	runs   [][]claimedRow // oldest head first
	events int
	at     time.Time     // when the claim was made, on our clock
	skew   time.Duration // database clock minus ours
	tx     claimTxn
}

// claimTxn is what the publisher may do in the claim transaction, on the
// loop's goroutine while it publishes the batch.
type claimTxn interface {
	// extend locks the next events of the aggregates whose runs end with
	// tails, at most n each (extend.go).
	extend(ctx context.Context, tails []claimedRow, n int) ([]claimedRow, error)
	// savepoint opens a savepoint for a TxSink to write in (sink_tx.go).
	savepoint(ctx context.Context) (pgx.Tx, error)
}

// claim commits the previous batch's outcomes, opens the batch transaction
// and locks a batch as pc asks. It returns nil, with the transaction
// rolled back and the connection kept, when there was nothing to claim.
func (c *claimer) claim(ctx context.Context, pc pace) (*claim, error) {
	if c.conn == nil {
		conn, err := c.pool.Acquire(ctx)
		if err != nil {
			return nil, err
		}
		c.conn = conn
		c.replan = true
	}
	runs, skew, err := c.lock(ctx, pc)
	if c.shares != nil {
		c.shares.hold(c.loop, runs)
	}
	c.keep(pc, runs)
	if err != nil {
		rollback(c.conn.Conn())
		c.conn.Release()
		c.conn = nil
		return nil, err
	}
	n := 0
	for _, run := range runs {
		n += len(run)
	}
	if n == 0 {
		rollback(c.conn.Conn())
		return nil, nil
	}
	if c.replan && n >= min(c.cfg.BatchSize, replanClaim) {
		// The claim statements run on generic plans (beginClaimSQL), made
		// at their first run on this connection, often while the table
		// was nearly empty: a sequential scan and a sort then cost nothing.
		// Kept through a backlog that came since, they read the whole
		// backlog for every batch until autovacuum's next ANALYZE. A large
		// claim says the backlog is here: the next statements are planned
		// for it, once per connection taken for a backlog. A plan made for
		// a large table stays cheap on a small one.
		c.replan = false
		if err := c.conn.Conn().DeallocateAll(ctx); err != nil {
			rollback(c.conn.Conn())
			c.conn.Release()
			c.conn = nil
			return nil, err
		}
	}
	c.m.batchSize.Observe(float64(n))
	c.m.claimed.Add(float64(n))
	c.claimed = n
	return &claim{pace: pc, runs: runs, events: n, at: time.Now(), skew: skew, tx: c}, nil
}

// hold keeps a batch's outcomes to commit with the next claim, and sizes
// that claim by them. Once claiming stops there is no next claim: they
// are committed at once.
func (c *claimer) hold(out *outcomes, pc pace) {
	out.claimed = c.claimed
	c.pending = out
	if pc.limit == 0 {
		c.size = c.nextSize(c.size, out)
	}
	if c.life.claiming.Err() != nil {
		c.settle()
	}
}

// settle commits the pending outcomes, if any, and gives the connection
// back to the pool.
func (c *claimer) settle() {
	if c.shares != nil {
		c.shares.hold(c.loop, nil)
	}
	if c.conn == nil {
		return
	}
	if c.pending != nil {
		ctx, cancel := context.WithTimeout(context.Background(), finishTimeout)
		b := &pgx.Batch{}
		q := c.fin.queue(b, c.pending)
		res := c.conn.Conn().SendBatch(ctx, b)
		err := q.read(res, c.pending)
		if cerr := res.Close(); err == nil {
			err = cerr
		}
		cancel()
		c.finished(c.conn.Conn(), c.pending, err)
		c.pending = nil
	}
	c.conn.Release()
	c.conn = nil
}

// finished accounts for a batch whose outcomes were written (err == nil)
// or lost (the transaction rolled back: the rows stay as they were and the
// published events will be published again, at least once).
func (c *claimer) finished(conn *pgx.Conn, out *outcomes, err error) {
	// Detached events stay claimed until their own outcome is written.
	c.m.claimed.Sub(float64(out.claimed - len(out.detached)))
	if err == nil && out.unmarked {
		// The relay's marker session ended as the batch committed (a
		// reconnect of its listener): the events were left as they were,
		// free for any relay while their publishes are still out.
		c.log.Warn("outbox relay marker gone as detached publishes were recorded; their events are free again and may be published twice",
			"events", len(out.detached))
	}
	if err == nil && !out.unmarked {
		c.done.track(out) // before settle: a hard stop may hand them back
	}
	out.settle(err == nil)
	if err != nil {
		rollback(conn)
		if c.life.hard.Err() == nil {
			c.log.Warn("outbox batch outcomes not recorded; its events will be published again",
				"events", out.claimed, "error", err)
		}
		return
	}
	c.rep.record(out)
}

// nextSize is how many events the loop claims after a batch that claimed
// size. A batch that detach_after cut short claimed more than the sink took
// in that time: the events it never started were read and locked for
// nothing, and handed back. So the next claim takes as many as this one
// started, at least one; a batch that finished doubles it again, up to
// batch_size. Only a sink slower than batch_size events per detach_after
// (or a hung call) makes batches smaller.
func (c *claimer) nextSize(size int, out *outcomes) int {
	if out.cutShort {
		return max(1, min(size, out.started))
	}
	return min(c.cfg.BatchSize, 2*size)
}

// claimSize is how many events a claim takes: what pc asks, or, for a
// sink-bound relay, a run for each slot of the loop's share of
// max_in_flight; else the loop's own size.
func (c *claimer) claimSize(pc pace) int {
	switch {
	case pc.limit > 0:
		return pc.limit
	case pc.sinkBound:
		slots := (c.cfg.MaxInFlight + c.cfg.Relays - 1) / c.cfg.Relays
		return min(c.cfg.BatchSize, slots*pc.runLen)
	}
	return c.size
}

// depth is the longest run of one aggregate a claim of n events takes: n
// spread over max_in_flight aggregates once n is below batch_size. An
// aggregate's events are published one after another, so a slow sink gets
// through a batch faster as many short runs than as a few long ones. With
// a sink-bound relay, what one slot publishes before detach_after
// (pace.runLen). Zero: no bound.
func (c *claimer) depth(pc pace, n int) int {
	if pc.sinkBound {
		return pc.runLen
	}
	if n >= c.cfg.BatchSize {
		return 0
	}
	return (n + c.cfg.MaxInFlight - 1) / c.cfg.MaxInFlight
}

// minWindow is the window a claim reads when nothing is congested. With
// several loops, one window read serves them all (see shares), and its
// oldest rows are mostly the siblings' batches being published, so it
// holds two batches per loop.
func (c *claimer) minWindow() int {
	if c.cfg.Relays == 1 {
		return c.cfg.BatchSize
	}
	return c.cfg.BatchSize * min(2*c.cfg.Relays, maxWindowFactor)
}

// maxWindowFactor bounds the window at this many batches.
const maxWindowFactor = 8

func rollback(conn *pgx.Conn) {
	// A connection left inside a transaction is destroyed by the pool on
	// release, which also rolls back; this is the cheaper path.
	ctx, cancel := context.WithTimeout(context.Background(), finishTimeout)
	defer cancel()
	if conn.PgConn().TxStatus() != 'I' {
		_, _ = conn.Exec(ctx, "ROLLBACK")
	}
}
