package outbox_test

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// TestContractOutOfOrderCommit: a producer appends event k of aggregate X
// and keeps its transaction open; a second producer appends event k+1 of X.
// The insert trigger serializes producers of one aggregate, so the second
// one blocks until the first commits, and k+1 can never become visible (and
// be published) before k. Other aggregates flow meanwhile.
func TestContractOutOfOrderCommit(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	rec := newContractRecordingSink(nil)
	contractStartRelay(t, db.Pool, rec, contractConfig(), "relay", nil, prometheus.NewRegistry())

	// X already has published history: k is not X's first event.
	var history []string
	for i := range 3 {
		history = append(history, contractAppend(t, db.Pool, "X", fmt.Sprintf("x.%d", i)))
	}
	testkit.Eventually(t, 10*time.Second, "X's earlier events published", func() bool {
		return rec.deliveredCount(history[len(history)-1]) == 1
	})

	// tx1: event k of X, left open.
	conn1 := db.Conn(t)
	tx1, err := conn1.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	k, err := outbox.Append(ctx, tx1, contractNewEvent("X", "x.k"))
	if err != nil {
		t.Fatal(err)
	}

	// tx2, on another connection: event k+1 of X, then commit.
	conn2 := db.Conn(t)
	pid2 := conn2.PgConn().PID()
	type result struct {
		id  string
		err error
	}
	tx2Done := make(chan result, 1)
	tx2Exited := make(chan struct{})
	go func() {
		defer close(tx2Exited)
		var id string
		err := pgx.BeginFunc(ctx, conn2, func(tx pgx.Tx) error {
			var err error
			id, err = outbox.Append(ctx, tx, contractNewEvent("X", "x.k+1"))
			return err
		})
		tx2Done <- result{id, err}
	}()
	// If the test fails while tx2 waits, end tx1 first so tx2's goroutine
	// is done with conn2 before conn2 is closed.
	t.Cleanup(func() {
		_ = conn1.Close(context.Background())
		<-tx2Exited
	})
	testkit.Eventually(t, 10*time.Second, "tx2 to block on X's aggregate lock", func() bool {
		return contractBackendWaitingOnLock(t, db.Pool, pid2)
	})

	// While tx1 is open, other aggregates are published promptly.
	var others []string
	for i := range 20 {
		others = append(others, contractAppend(t, db.Pool, fmt.Sprintf("other-%d", i%5), "other"))
	}
	testkit.Eventually(t, 10*time.Second, "other aggregates published while tx1 is open", func() bool {
		for _, id := range others {
			if rec.deliveredCount(id) == 0 {
				return false
			}
		}
		return true
	})
	select {
	case r := <-tx2Done:
		t.Fatalf("tx2 finished while tx1 was open (event %s, err %v): producers of one aggregate must serialize", r.id, r.err)
	default:
	}
	if !contractBackendWaitingOnLock(t, db.Pool, pid2) {
		t.Fatal("tx2 stopped waiting on the aggregate lock while tx1 is open")
	}
	if n := rec.callCount(k); n != 0 {
		t.Fatalf("uncommitted event k was handed to the sink %d times", n)
	}

	if err := tx1.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	var k1 string
	select {
	case r := <-tx2Done:
		if r.err != nil {
			t.Fatalf("tx2: %v", r.err)
		}
		k1 = r.id
	case <-time.After(10 * time.Second):
		t.Fatal("tx2 still blocked 10s after tx1 committed")
	}
	testkit.Eventually(t, 10*time.Second, "k and k+1 published", func() bool {
		return contractStatusOf(t, db.Pool, k) == outbox.StatusPublished &&
			contractStatusOf(t, db.Pool, k1) == outbox.StatusPublished &&
			rec.deliveredCount(k1) == 1
	})

	if rk, rk1 := contractRowOf(t, db.Pool, k), contractRowOf(t, db.Pool, k1); rk.ID >= rk1.ID {
		t.Errorf("id of k (%d) is not below id of k+1 (%d)", rk.ID, rk1.ID)
	}
	var gotX []string
	for _, d := range rec.deliveries() {
		if d.Event.AggregateID == "X" {
			gotX = append(gotX, d.Event.EventID)
		}
	}
	wantX := append(append([]string(nil), history...), k, k1)
	if fmt.Sprint(gotX) != fmt.Sprint(wantX) {
		t.Errorf("X's arrival order\n got %v\nwant %v (history, k, k+1)", gotX, wantX)
	}
}
