package outbox

import (
	"cmp"
	"context"
	"errors"
	"fmt"
	"slices"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
)

// TxSink is a Sink that hands events over by writing them in the relay's
// own claim transaction instead of calling out: the same commit writes
// them and marks them PUBLISHED, so the hand-off has no duplicates, even
// across crashes. The relay detects it on the Sink once, when it is built
// (as pgx detects tracer capabilities), and then never calls Publish.
//
// PublishTx gets the batch's events, each aggregate's in order. It
// returns one error per event (nil: written), or err when the write failed
// as a whole: then the relay undoes whatever the call wrote and every
// event fails with err. An event it fails it must not write, nor any later
// event of the same aggregate: the relay hands those back, so they must
// not overtake the failed one. Errors are transient unless Permanent.
type TxSink interface {
	Sink
	PublishTx(ctx context.Context, tx pgx.Tx, events []Event) (failed []error, err error)
}

// txPublisher hands claims to a TxSink in the claim transaction. Nothing
// crosses a network, so there is nothing to run concurrently, to pace or
// to detach: the outcomes are committed with the next claim, like any
// batch's. It runs on the loop's goroutine and keeps no state.
type txPublisher struct {
	sink            TxSink
	policy          retryPolicy
	life            *lifetime
	inFlightTimeout time.Duration
}

// pace claims one event for a probe, else what the claimer sizes.
func (p *txPublisher) pace(_ context.Context, probe, _ bool) (pace, bool) {
	pc := pace{probe: probe, runLen: 1}
	if probe {
		pc.limit = 1
	}
	return pc, true
}

func (p *txPublisher) unreserve(pace) {}

func (p *txPublisher) wait() {}

// publish writes the claim's events through the sink in a savepoint of
// the claim transaction.
func (p *txPublisher) publish(cl *claim) *outcomes {
	out := newOutcomes()
	var events []Event
	var rows []*claimedRow
	for _, run := range cl.runs {
		for i := range run {
			ev := &run[i]
			if ev.unreadable != nil {
				f := p.policy.classify(*ev, ev.unreadable)
				out.failed = append(out.failed, f)
				handBack(out, run[i+1:])
				break
			}
			events = append(events, ev.Event)
			rows = append(rows, ev)
		}
	}
	if len(events) == 0 {
		return out
	}
	errs, err := p.write(cl.tx, events)
	if err != nil {
		errs = slices.Repeat([]error{err}, len(events))
	}
	at := time.Now().Add(cl.skew)
	failedAgg := map[aggregateKey]bool{}
	for i, ev := range rows {
		key := ev.key()
		switch {
		case failedAgg[key]:
			out.handBack = append(out.handBack, ev) // must not overtake the failed event
		case errs[i] != nil:
			failedAgg[key] = true
			if p.life.hard.Err() != nil { // cancelled by a hard stop: not the sink's fault
				out.handBack = append(out.handBack, ev)
				continue
			}
			out.failed = append(out.failed, p.policy.classify(*ev, errs[i]))
		default:
			out.published = append(out.published, ev)
			out.at = append(out.at, at)
		}
	}
	return out
}

// write calls the sink inside a savepoint, so that a failed call leaves
// the claim transaction usable for recording the failures.
func (p *txPublisher) write(tx claimTxn, events []Event) ([]error, error) {
	ctx, cancel := context.WithTimeout(p.life.hard, p.inFlightTimeout-p.inFlightTimeout/10)
	defer cancel()
	sp, err := tx.savepoint(ctx)
	if err != nil {
		return nil, err
	}
	errs, err := p.sink.PublishTx(ctx, sp, events)
	if err == nil && len(errs) != len(events) {
		err = fmt.Errorf("outbox: sink %s returned %d outcomes for %d events", p.sink.Name(), len(errs), len(events))
	}
	if err != nil {
		if rbErr := sp.Rollback(context.WithoutCancel(ctx)); rbErr != nil {
			return nil, errors.Join(err, rbErr)
		}
		return nil, err
	}
	return errs, sp.Commit(ctx)
}

func handBack(out *outcomes, rows []claimedRow) {
	for i := range rows {
		out.handBack = append(out.handBack, &rows[i])
	}
}

// claimTx is the relay's claim transaction as a pgx.Tx. The relay opened
// it and commits it with the batch's outcomes, so a sink can neither
// commit nor roll it back; Begin makes a savepoint, which it can.
type claimTx struct {
	conn      *pgx.Conn
	savepoint string // "" for the claim transaction itself
	nested    int
}

var errClaimTx = errors.New("outbox: the relay's claim transaction is committed by the relay")

func (t *claimTx) Begin(ctx context.Context) (pgx.Tx, error) {
	t.nested++
	sp := &claimTx{conn: t.conn, savepoint: fmt.Sprintf("%s_%d", cmp.Or(t.savepoint, "outbox_sink"), t.nested)}
	if _, err := t.conn.Exec(ctx, "SAVEPOINT "+sp.savepoint); err != nil {
		return nil, err
	}
	return sp, nil
}

func (t *claimTx) Commit(ctx context.Context) error {
	if t.savepoint == "" {
		return errClaimTx
	}
	_, err := t.conn.Exec(ctx, "RELEASE SAVEPOINT "+t.savepoint)
	return err
}

func (t *claimTx) Rollback(ctx context.Context) error {
	if t.savepoint == "" {
		return errClaimTx
	}
	_, err := t.conn.Exec(ctx, "ROLLBACK TO SAVEPOINT "+t.savepoint)
	return err
}

func (t *claimTx) CopyFrom(ctx context.Context, table pgx.Identifier, cols []string, src pgx.CopyFromSource) (int64, error) {
	return t.conn.CopyFrom(ctx, table, cols, src)
}

func (t *claimTx) SendBatch(ctx context.Context, b *pgx.Batch) pgx.BatchResults {
	return t.conn.SendBatch(ctx, b)
}

// LargeObjects is not offered: pgx builds them only on its own transactions.
func (t *claimTx) LargeObjects() pgx.LargeObjects { return pgx.LargeObjects{} }

func (t *claimTx) Prepare(ctx context.Context, name, sql string) (*pgconn.StatementDescription, error) {
	return t.conn.Prepare(ctx, name, sql)
}

func (t *claimTx) Exec(ctx context.Context, sql string, args ...any) (pgconn.CommandTag, error) {
	return t.conn.Exec(ctx, sql, args...)
}

func (t *claimTx) Query(ctx context.Context, sql string, args ...any) (pgx.Rows, error) {
	return t.conn.Query(ctx, sql, args...)
}

func (t *claimTx) QueryRow(ctx context.Context, sql string, args ...any) pgx.Row {
	return t.conn.QueryRow(ctx, sql, args...)
}

func (t *claimTx) Conn() *pgx.Conn { return t.conn }
