package outbox

import (
	"context"
	"slices"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
)

// lock commits the previous batch's outcomes, opens the batch transaction
// and locks a batch: heads from the window and their runs, topped up by
// heads from behind the window when it is blocked: as many events as
// claimSize says. It returns the runs to publish, oldest head first, and
// the database clock minus ours.
func (c *claimer) lock(ctx context.Context, pc pace) ([][]claimedRow, time.Duration, error) {
	if c.size == 0 {
		c.size = c.cfg.BatchSize
	}
	n := c.claimSize(pc)
	depth := c.depth(pc, n)
	c.window = max(c.window, c.minWindow())
	// A share left from a sibling's window needs no window of its own. A
	// probe reads one: it picks among the whole window's aggregates.
	var cands []*candidate
	var gen uint64 // of the share cands come from
	if c.shares != nil && !pc.probe {
		cands, gen = c.shares.take(c.loop, n, depth, pc.spares())
	}
	fromShare := len(cands) > 0
	// One loop's window is all its own and holds the kept heads when they
	// are among the oldest: offering them too lowered one loop over 200
	// aggregates at 20 ms from 0.87 to 0.77 of the ideal. A sink slower
	// than detach_after detaches every publish, so the kept heads are
	// IN_FLIGHT, not due.
	keeping := c.shares != nil && !pc.probe && len(c.kept) > 0 && pc.sinkBound && !pc.slow
	op, err := c.open(ctx, keeping, !fromShare, depth)
	if err != nil {
		return nil, 0, err
	}
	var all []*candidate // the whole window's, for all loops
	if !fromShare {
		all = candidates(op.win)
		switch {
		case pc.probe:
			cands = c.brk.unprobed(all)
		case c.shares != nil:
			cands, gen = c.shares.split(all, c.loop, n, depth, pc.spares())
		default:
			cands = all
		}
	}
	if err := ctx.Err(); err != nil {
		return nil, 0, err // stopping: lock nothing only to hand it back
	}
	cands = withKept(cands, op.kept)

	conn := c.conn.Conn()
	runs, rest, err := c.lockWindow(ctx, conn, cands, n, depth)
	if err == nil && pc.probe && len(runs) == 0 && len(all) > 0 {
		// Every due aggregate of the window failed as unavailable since
		// the sink last answered: probe one behind the window, or, when
		// there is none, the oldest again.
		if runs, err = c.lockBehind(ctx, conn, pc, nil, 1); err == nil && len(runs) == 0 {
			c.brk.forgetFailed()
			runs, _, err = c.lockWindow(ctx, conn, all, 1, 0)
		}
	}
	if err != nil {
		return nil, 0, err
	}
	if c.shares != nil && !pc.probe {
		c.shares.giveBack(c.loop, gen, rest)
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
	congested := !fromShare && got < (n+1)/2 && len(op.win) >= c.window
	blocked := len(all) < (n+1)/2
	// A share whose heads others took meanwhile says nothing about the
	// backlog: read a window at once rather than sleep.
	c.again = fromShare && got == 0
	// A window that was not full read every live event, and a claim that
	// took them all leaves none behind: the next events come after it,
	// and their inserts' notifications say so (loop).
	c.drained = !fromShare && len(op.win) < c.window && got == len(op.win)
	switch {
	case congested && c.window < maxWindowFactor*c.cfg.BatchSize:
		c.window *= 2
		c.again = true
	case congested && blocked && time.Since(c.lookedBehind) >= c.cfg.PollInterval:
		c.lookedBehind = time.Now()
		more, err := c.lockBehind(ctx, conn, pc, runs, n-got)
		if err != nil {
			return nil, 0, err
		}
		runs = append(runs, more...)
	case !fromShare && got >= n && c.window > c.minWindow():
		c.window /= 2
	}
	return runs, op.skew, nil
}

// opened is what the claim's opening round trip read.
type opened struct {
	skew time.Duration // database clock minus ours
	kept []*candidate  // the kept aggregates' current heads and runs
	win  []windowRow   // the window, when one was read
}

// open sends the claim's first round trip: the previous batch's outcomes
// and COMMIT, BEGIN, and the kept heads and the window when asked.
func (c *claimer) open(ctx context.Context, keeping, window bool, depth int) (opened, error) {
	var op opened
	conn := c.conn.Conn()
	b := &pgx.Batch{}
	fin := c.pending
	c.pending = nil
	var finishing queued
	sendCtx := ctx
	if fin != nil {
		finishing = c.fin.queue(b, fin)
		// The previous batch's outcomes must be written even if claiming
		// stops meanwhile. Only this round trip is bound by the finish
		// timeout; the locks after it may take longer.
		var cancel context.CancelFunc
		sendCtx, cancel = context.WithTimeout(context.WithoutCancel(ctx), finishTimeout)
		defer cancel()
	}
	b.Queue("BEGIN")
	// If the relay stalls (process frozen, network gone) while holding its
	// claims, the server ends the session after the visibility timeout,
	// which releases them.
	b.Queue(beginClaimSQL, strconv.FormatInt(c.cfg.InFlightTimeout.Milliseconds(), 10))
	if keeping {
		types, ids := make([]string, len(c.kept)), make([]string, len(c.kept))
		for i, k := range c.kept {
			types[i], ids[i] = k.typ, k.id
		}
		b.Queue(keptHeadsSQL, types, ids, depth)
	}
	if window {
		b.Queue(windowSQL, c.window)
	}
	res := conn.SendBatch(sendCtx, b)
	defer res.Close()
	if fin != nil {
		err := finishing.read(res, fin)
		if err != nil {
			_ = res.Close() // the connection must be idle before the rollback
			c.finished(conn, fin, err)
			return op, err
		}
		c.finished(conn, fin, nil)
	}
	if _, err := res.Exec(); err != nil {
		return op, err
	}
	var dbNow time.Time
	if err := res.QueryRow().Scan(nil, nil, &dbNow); err != nil {
		return op, err
	}
	op.skew = time.Until(dbNow)
	if keeping {
		heads, err := readWindow(res.Query())
		if err != nil {
			return op, err
		}
		op.kept = candidates(heads)
	}
	if window {
		var err error
		if op.win, err = readWindow(res.Query()); err != nil {
			return op, err
		}
	}
	return op, res.Close()
}

// lockBehind locks up to n heads of aggregates anywhere in the backlog,
// visiting at most maxWindowFactor*batch_size aggregates from where the
// last look ended, so successive looks cover every aggregate in turn. The
// aggregates of runs, which this transaction already holds, are left out:
// their heads would lock again (a transaction's own locks never skip).
func (c *claimer) lockBehind(ctx context.Context, conn *pgx.Conn, pc pace, runs [][]claimedRow, n int) ([][]claimedRow, error) {
	visit := maxWindowFactor * c.cfg.BatchSize
	heads, err := readWindow(conn.Query(ctx, aggregateHeadsSQL, c.behind.typ, c.behind.id, visit))
	if err != nil {
		return nil, err
	}
	c.behind = aggregateKey{}
	if len(heads) == visit {
		c.behind = heads[len(heads)-1].key
	}
	held := make(map[aggregateKey]bool, len(runs))
	for _, run := range runs {
		held[run[0].key()] = true
	}
	heads = slices.DeleteFunc(heads, func(h windowRow) bool { return held[h.key] })
	cands := candidates(heads)
	if pc.probe {
		cands = c.brk.unprobed(cands)
	}
	locked, _, err := c.lockWindow(ctx, conn, cands, n, c.depth(pc, n))
	return locked, err
}

// lockWindow locks heads and their runs, up to n events, in one statement.
// Runs are cut to depth events (0: no bound). It returns one run per locked
// head: the head, then as much of its run as came back locked, in order;
// and the candidates the statement never came to, because it had its heads
// before them.
func (c *claimer) lockWindow(ctx context.Context, conn *pgx.Conn, cands []*candidate, n, depth int) (runs [][]claimedRow, rest []*candidate, err error) {
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
	for i, cd := range cands {
		heads[i] = cd.head.tid
		events += 1 + len(runOf(cd))
		for _, w := range runOf(cd) {
			runTIDs = append(runTIDs, w.tid)
			runHeads = append(runHeads, cd.head.tid)
		}
	}
	want := min(len(cands), (n*len(cands)+events-1)/events)
	lockedHeads, lockedRuns, err := readEvents(conn.Query(ctx, c.sql.lock, heads, want, runTIDs, runHeads, n))
	if err != nil || len(lockedHeads) == 0 {
		return nil, nil, err
	}
	if len(lockedHeads) == want {
		// Heads are locked oldest first: the statement stopped at the last.
		last := lockedHeads[len(lockedHeads)-1].Seq
		for _, cd := range cands {
			if cd.head.id > last {
				rest = append(rest, cd)
			}
		}
	}
	byTID := make(map[pgtype.TID]*candidate, len(cands))
	for _, cd := range cands {
		byTID[cd.head.tid] = cd
	}
	locked := make(map[pgtype.TID]claimedRow, len(lockedRuns))
	for _, row := range lockedRuns {
		locked[row.tid] = row
	}
	// Heads came back oldest first.
	runs = make([][]claimedRow, 0, len(lockedHeads))
	for _, h := range lockedHeads {
		cd := byTID[h.tid]
		if cd == nil || cd.head.id != h.Seq {
			continue // not the row the window saw there: not a head we know
		}
		run := []claimedRow{h}
		for _, w := range runOf(cd) {
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
