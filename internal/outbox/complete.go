package outbox

import (
	"context"
	"log/slog"
	"sync"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// completer records the outcomes of detached publishes: each once its
// batch has committed the event IN_FLIGHT, by compare-and-set
// (completeSQL). The outcomes of detached publishes that finish together
// are written in one statement: each waits while an earlier group is
// written, and the writer then takes everything that queued up meanwhile.
// A broker whose confirms take longer than detach_after detaches many
// publishes at once, and one transaction each would cost the database
// more than the publishes. At a hard stop it hands back the events whose
// publishes have not returned (handBackOutstanding).
//
// Detached publishes call complete from their worker goroutines; the
// claimers call track from their loops; the relay's wind-down calls
// handBackOutstanding. mu and detachedMu guard what they share.
type completer struct {
	store completionStore
	rep   *reporter
	m     *metrics
	log   *slog.Logger

	mu      sync.Mutex
	queue   []*completion // outcomes waiting to be written
	writing bool          // a publish is writing a group; the others wait for it

	detachedMu sync.Mutex
	detached   map[*claimedRow]string // committed IN_FLIGHT, outcome not recorded yet: event → owner token
}

// completionStore writes completions (pgCompletions; a fake in tests).
type completionStore interface {
	// complete writes a group's outcomes and returns the ids it changed.
	complete(ctx context.Context, group []*completion) (changed map[int64]bool, err error)
	// handBack hands back a group's events after a hard stop, by the same
	// compare-and-set, and returns the ids it changed.
	handBack(ctx context.Context, group []*completion) (changed []int64, err error)
}

func newCompleter(store completionStore, rep *reporter, m *metrics, log *slog.Logger) *completer {
	return &completer{store: store, rep: rep, m: m, log: log, detached: map[*claimedRow]string{}}
}

// completion is the outcome of one detached publish, waiting to be written.
type completion struct {
	ev    *claimedRow
	token string
	o     eventOutcome
	done  chan struct{} // closed once written or given up
}

// status is the event's state the completion writes.
func (c *completion) status() string {
	switch {
	case c.o.failed != nil:
		return c.o.failed.status
	case c.o.handBack:
		return StatusPending
	default:
		return StatusPublished
	}
}

// track notes the events a committed batch left IN_FLIGHT, until their
// publishes record their outcomes. The claimer calls it before it settles
// out.
func (c *completer) track(out *outcomes) {
	c.detachedMu.Lock()
	defer c.detachedMu.Unlock()
	for _, ev := range out.detached {
		c.detached[ev] = out.token
	}
}

func (c *completer) untrack(ev *claimedRow) {
	c.detachedMu.Lock()
	defer c.detachedMu.Unlock()
	delete(c.detached, ev)
}

// complete records the outcome o of ev, detached from the batch whose
// outcomes are out, once the claimer has settled them: an outcome
// written before the claim commits would find no IN_FLIGHT row, and a
// batch that rolled back never marked the event (it is published again).
func (c *completer) complete(out *outcomes, ev *claimedRow, o eventOutcome) {
	defer c.m.claimed.Dec()
	<-out.settled
	if !out.committed || out.unmarked {
		return // not IN_FLIGHT: nothing of this claim to complete
	}
	defer c.untrack(ev)
	cp := &completion{ev: ev, token: out.token, o: o, done: make(chan struct{})}
	c.mu.Lock()
	c.queue = append(c.queue, cp)
	if c.writing {
		c.mu.Unlock()
		<-cp.done
		return
	}
	c.writing = true
	for len(c.queue) > 0 {
		group := c.queue
		c.queue = nil
		c.mu.Unlock()
		c.write(group)
		c.mu.Lock()
	}
	c.writing = false
	c.mu.Unlock()
}

// write writes a group of completions and accounts for those it changed.
func (c *completer) write(group []*completion) {
	defer func() {
		for _, cp := range group {
			close(cp.done)
		}
	}()
	ctx, cancel := context.WithTimeout(context.Background(), finishTimeout)
	defer cancel()
	changed, err := c.store.complete(ctx, group)
	if err != nil {
		for _, cp := range group {
			c.log.Warn("outbox outcome of a detached publish not recorded; the event is published again after its visibility timeout",
				"event_id", cp.ev.EventID, "error", err)
		}
		return
	}
	var out outcomes
	for _, cp := range group {
		switch {
		case !changed[cp.ev.Seq]:
			c.log.Warn("outbox claim of a detached publish expired or was handed back before its outcome; the event may be published again",
				"event_id", cp.ev.EventID)
		case cp.o.failed != nil:
			out.failed = append(out.failed, *cp.o.failed)
		case !cp.o.handBack:
			out.published = append(out.published, cp.ev)
			out.at = append(out.at, cp.o.at)
		}
	}
	c.rep.record(&out)
}

// handBackOutstanding hands back, after a hard stop, the events whose
// detached publishes have not returned: PENDING, the attempt returned, as
// a cancelled publish would record it, and by the same compare-and-set, so
// if the publish records its own outcome first, or last, the other write
// changes nothing.
func (c *completer) handBackOutstanding() {
	c.detachedMu.Lock()
	outstanding := c.detached
	c.detached = map[*claimedRow]string{}
	c.detachedMu.Unlock()
	if len(outstanding) == 0 {
		return
	}
	group := make([]*completion, 0, len(outstanding))
	byID := map[int64]*claimedRow{}
	for ev, token := range outstanding {
		group = append(group, &completion{ev: ev, token: token, o: eventOutcome{handBack: true}})
		byID[ev.Seq] = ev
	}
	ctx, cancel := context.WithTimeout(context.Background(), finishTimeout)
	defer cancel()
	ids, err := c.store.handBack(ctx, group)
	for _, id := range ids {
		ev := byID[id]
		c.log.Warn("outbox detached publish still outstanding at stop; its event is handed back and will be published again",
			"event_id", ev.EventID, "aggregate_type", ev.AggregateType, "aggregate_id", ev.AggregateID)
	}
	if err != nil {
		c.log.Warn("outbox events of outstanding detached publishes not handed back; they are published again after their visibility timeout",
			"events", len(outstanding), "error", err)
	}
}

// pgCompletions writes completions to outbox_delivery.
type pgCompletions struct {
	pool       *pgxpool.Pool
	instanceID string
}

// complete writes group in one transaction. Losing its commit in a server
// crash only leaves the events IN_FLIGHT until their visibility deadline,
// then they are published again (at least once), so it does not wait for
// the WAL flush.
func (s pgCompletions) complete(ctx context.Context, group []*completion) (map[int64]bool, error) {
	changed := map[int64]bool{}
	b := &pgx.Batch{}
	b.Queue("BEGIN")
	b.Queue("SET LOCAL synchronous_commit = off")
	b.Queue(completeSQL, s.args(group)...).Query(func(rows pgx.Rows) error {
		var id int64
		_, err := pgx.ForEachRow(rows, []any{&id}, func() error {
			changed[id] = true
			return nil
		})
		return err
	})
	// The aggregates these events held are free again: tell the other
	// replicas' loops, which may be idle because every head was in flight.
	b.Queue("SELECT pg_notify($1, '')", NotifyChannel)
	b.Queue("COMMIT")
	if err := s.pool.SendBatch(ctx, b).Close(); err != nil {
		return nil, err
	}
	return changed, nil
}

func (s pgCompletions) handBack(ctx context.Context, group []*completion) ([]int64, error) {
	rows, _ := s.pool.Query(ctx, completeSQL, s.args(group)...)
	return pgx.CollectRows(rows, pgx.RowTo[int64])
}

// args are completeSQL's arguments for group: one array element per
// completion.
func (s pgCompletions) args(group []*completion) []any {
	n := len(group)
	ids, tokens, statuses, errs := make([]int64, n), make([]string, n), make([]string, n), make([]*string, n)
	attempts, delays := make([]int32, n), make([]int64, n)
	for i, c := range group {
		ids[i], tokens[i], statuses[i] = c.ev.Seq, c.token, c.status()
		attempts[i] = int32(c.ev.Attempts + 1) // the IN_FLIGHT write counted this attempt
		if f := c.o.failed; f != nil {
			delays[i] = f.delay.Milliseconds()
			e := errorText(f.err)
			errs[i] = &e
		}
	}
	return []any{ids, tokens, attempts, statuses, delays, errs, s.instanceID}
}
