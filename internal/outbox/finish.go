package outbox

import (
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
)

// outcomes of a batch: what the publisher returns to the claimer, which
// commits them. The publisher's workers fill them in under the batch's
// mutex and no longer touch them once publish returned them; the loop
// goroutine owns them from then on, until settle. Detached publishes only
// wait on settled, then read committed and token.
type outcomes struct {
	claimed   int // events the batch's transaction locked, extensions included: the claimer's count
	published []*claimedRow
	at        []time.Time // when each was accepted, on the database clock
	failed    []failure
	handBack  []*claimedRow
	detached  []*claimedRow // still being published: written IN_FLIGHT under token
	token     string
	unmarked  bool          // the detach changed nothing: the relay's marker was gone (finishSQL.read)
	started   int           // events whose publish started
	cutShort  bool          // detach_after ended the batch before all its events were published
	settled   chan struct{} // closed once the outcomes are committed or rolled back
	committed bool          // written before settled is closed; read after
}

func newOutcomes() *outcomes { return &outcomes{settled: make(chan struct{})} }

// settle records whether the outcomes were committed and tells the
// detached publishes waiting for it.
func (o *outcomes) settle(committed bool) {
	o.committed = committed
	close(o.settled)
}

// failure is the outcome of a failed publish.
type failure struct {
	ev     claimedRow
	err    error
	status string // FAILED or DEAD
	delay  time.Duration
}

// finishSQL writes a batch's outcomes in its claim transaction.
type finishSQL struct {
	instanceID      string
	inFlightTimeout time.Duration
	marker          *marker // the listener's; its own mutex guards it
}

// queued is what queue put in a batch: n statements, the detach the
// detachAt-th of them (-1: none).
type queued struct{ n, detachAt int }

// queue queues the writes of a batch's outcomes and its COMMIT.
func (f finishSQL) queue(b *pgx.Batch, out *outcomes) queued {
	q := queued{detachAt: -1}
	if len(out.published) > 0 {
		tids := make([]pgtype.TID, len(out.published))
		for i, ev := range out.published {
			tids[i] = ev.tid
		}
		b.Queue(markPublishedSQL, tids)
	}
	if len(out.failed) > 0 {
		tids := make([]pgtype.TID, len(out.failed))
		statuses := make([]string, len(out.failed))
		delays := make([]int64, len(out.failed))
		errs := make([]string, len(out.failed))
		for i, fl := range out.failed {
			tids[i], statuses[i], delays[i] = fl.ev.tid, fl.status, fl.delay.Milliseconds()
			errs[i] = errorText(fl.err)
		}
		b.Queue(markFailedSQL, tids, statuses, delays, errs, f.instanceID)
	}
	if len(out.detached) > 0 {
		tids := make([]pgtype.TID, len(out.detached))
		for i, ev := range out.detached {
			tids[i] = ev.tid
		}
		if id, pid, ok := f.marker.current(); ok {
			b.Queue(detachLockSQL, int32(id))
			q.detachAt = b.Len()
			b.Queue(markInFlightNamedSQL, tids, f.inFlightTimeout.Milliseconds(), out.token, id, int32(pid))
		} else {
			b.Queue(markInFlightSQL, tids, f.inFlightTimeout.Milliseconds(), out.token)
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
	q.n = b.Len()
	return q
}

// read reads the results of what queue queued, up to the first error. A
// detach that changed fewer rows than it was given found the relay's
// marker gone (markInFlightNamedSQL): its events are not IN_FLIGHT, and
// the commit frees them for any relay.
func (q queued) read(res pgx.BatchResults, out *outcomes) error {
	for i := range q.n {
		tag, err := res.Exec()
		if err != nil {
			return err
		}
		if i == q.detachAt && tag.RowsAffected() < int64(len(out.detached)) {
			out.unmarked = true
		}
	}
	return nil
}
