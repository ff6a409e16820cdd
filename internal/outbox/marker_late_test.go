package outbox

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/worker-dev/worker/internal/outbox/outboxtest"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// holdLockClass is the advisory lock class of the lock this test holds to
// stall an owner's detach halfway.
const holdLockClass = 7304599

// TestReclaimSeesALateDetach: a relay that dies right after sending its
// batch's outcomes has them run by the server after its marker is gone.
// The owner here is the real finishing statements (finishSQL) on a claim
// transaction of its own, under a marker held by another session, as a
// relay's; relay B watches the markers. Whether the detach statement runs
// only after the marker is gone, or sees the marker held and commits only
// after B looked for the dead owner's events, B publishes the event within
// 2 s of the owner's last commit, though its deadline is an hour away, and
// the aggregate's next event after it.
func TestReclaimSeesALateDetach(t *testing.T) {
	t.Parallel()
	for _, tc := range []struct {
		name string
		// stall holds the detach statement after it looked at the marker
		// (a trigger waiting on a lock the test holds) instead of sending
		// it only once the marker is gone.
		stall bool
	}{
		{name: "detach sent after the marker is gone"},
		{name: "detach saw the marker, commits after the reclaim looked", stall: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			t.Parallel()
			// The owner's marker and claim sessions, the test's lock, B's
			// pool and listener.
			pgtest.Need(t, pgtest.PoolConns+3+relayConns+1)
			db := pgtest.New(t)
			outboxtest.RecordPublishes(t, db.Pool)
			ctx := context.Background()
			markerConn := db.Conn(t)
			id, pid := takeMarker(t, markerConn)
			head, next := appendEvent(t, db.Pool, "late", "e1"), appendEvent(t, db.Pool, "late", "e2")

			// The owner's claim: its own transaction holds the head's
			// delivery row, as a batch does while its publish is out.
			claimConn := db.Conn(t)
			var tid pgtype.TID
			if _, err := claimConn.Exec(ctx, "BEGIN"); err != nil {
				t.Fatal(err)
			}
			if err := claimConn.QueryRow(ctx, `SELECT d.ctid FROM outbox_delivery d JOIN outbox_event e ON e.id = d.id
				WHERE e.event_id = $1 FOR UPDATE OF d`, head).Scan(&tid); err != nil {
				t.Fatal(err)
			}
			var hold *pgx.Conn
			if tc.stall {
				hold = db.Conn(t)
				exec(t, db.Pool, fmt.Sprintf(`CREATE FUNCTION test_stall() RETURNS trigger LANGUAGE plpgsql AS $$
					BEGIN
						PERFORM pg_advisory_lock_shared(%[1]d, 1);
						PERFORM pg_advisory_unlock_shared(%[1]d, 1);
						RETURN NEW;
					END $$`, holdLockClass))
				exec(t, db.Pool, `CREATE TRIGGER test_stall BEFORE UPDATE ON outbox_delivery FOR EACH ROW
					WHEN (NEW.status = 'IN_FLIGHT' AND NEW.claimed_by LIKE 'owner/%') EXECUTE FUNCTION test_stall()`)
				if _, err := hold.Exec(ctx, `SELECT pg_advisory_lock($1, 1)`, holdLockClass); err != nil {
					t.Fatal(err)
				}
			}

			sink := &recorder{}
			b, logs := startLoggedRelay(t, db.NewPool(t, relayConns), sink, testConfig(), "relay-b")
			awaitLooks(t, b, 2, "B to see the owner's marker")

			// The owner's outcomes: the head detached under its marker, with
			// an hour's deadline.
			fin := finishSQL{instanceID: "owner", inFlightTimeout: time.Hour, marker: &marker{}}
			fin.marker.held(id, uint32(pid), time.Now().Add(time.Hour))
			out := newOutcomes()
			out.token = "owner/0000000000000001"
			out.detached = []*claimedRow{{tid: tid}}
			batch := &pgx.Batch{}
			q := fin.queue(batch, out)
			sent := make(chan error, 1)
			send := func() {
				res := claimConn.SendBatch(ctx, batch)
				err := q.read(res, out)
				if cerr := res.Close(); err == nil {
					err = cerr
				}
				sent <- err
			}

			ownerDies := func() {
				t.Helper()
				if err := markerConn.Close(ctx); err != nil {
					t.Fatal(err)
				}
				testkit.Eventually(t, 10*time.Second, "the owner's marker to go", func() bool {
					var held bool
					if err := db.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1`+markerHolders+` AND l.objid::bigint = $1)`, id).Scan(&held); err != nil {
						t.Fatal(err)
					}
					return !held
				})
				// Past markerGrace: B has taken the owner for dead and
				// looked for its events.
				awaitLooks(t, b, 8, "B to look at the markers for 1.6 s more")
			}
			if tc.stall {
				go send()
				testkit.Eventually(t, 10*time.Second, "the owner's detach to stall after its look at the marker", func() bool {
					var waiting bool
					if err := db.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_locks WHERE pid = $1 AND NOT granted
						AND locktype = 'advisory' AND classid = $2)`, int32(claimConn.PgConn().PID()), holdLockClass).Scan(&waiting); err != nil {
						t.Fatal(err)
					}
					return waiting
				})
				ownerDies()
				if _, err := hold.Exec(ctx, `SELECT pg_advisory_unlock($1, 1)`, holdLockClass); err != nil {
					t.Fatal(err)
				}
			} else {
				ownerDies()
				go send()
			}
			if err := <-sent; err != nil {
				t.Fatal(err)
			}
			committed := time.Now()
			if want := !tc.stall; out.unmarked != want {
				t.Errorf("detach unmarked = %v, want %v", out.unmarked, want)
			}
			if err := claimConn.Close(ctx); err != nil {
				t.Fatal(err)
			}

			testkit.Eventually(t, 30*time.Second, "B to publish the owner's event", func() bool { return sink.has(head) })
			took := time.Since(committed)
			t.Logf("published %s after the owner's last commit", took.Round(time.Millisecond))
			if took > 2*time.Second {
				t.Errorf("published %s after the owner's last commit, want within 2s (its deadline is an hour away)", took)
			}
			testkit.Eventually(t, 10*time.Second, "the aggregate's next event published", func() bool { return sink.has(next) })
			pos := map[string]int{}
			for i, e := range sink.delivered() {
				pos[e.EventID] = i
			}
			if pos[head] > pos[next] {
				t.Error("the aggregate's next event was published before the owner's")
			}
			lines := logs.Lines(t, "outbox relay gone; its detached events reclaimed")
			switch {
			case tc.stall && (len(lines) != 1 || fmt.Sprint(lines[0]["events"]) != "1" || lines[0]["owner"] != "owner"):
				t.Errorf("want one reclaim line, events 1, owner owner; got %v", lines)
			case !tc.stall && len(lines) != 0:
				t.Errorf("nothing was IN_FLIGHT to reclaim, yet B logged %v", lines)
			}
		})
	}
}
