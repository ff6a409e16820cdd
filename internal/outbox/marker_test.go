package outbox

import (
	"context"
	"fmt"
	"log/slog"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
	"github.com/worker-dev/worker/internal/outbox/outboxtest"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// takeMarker draws a marker id and holds it on conn, as a relay's listener
// does; it returns the id and the session's backend.
func takeMarker(t *testing.T, conn *pgx.Conn) (id int64, pid int32) {
	t.Helper()
	err := conn.QueryRow(context.Background(), `SELECT m.id, pg_backend_pid()
		FROM (SELECT nextval('outbox_relay_marker_seq') AS id) m, pg_advisory_lock_shared(`+markerLockClass+`, m.id::integer)`).
		Scan(&id, &pid)
	if err != nil {
		t.Fatal(err)
	}
	return id, pid
}

type inFlightRow struct {
	status, claimedBy string
	due               time.Time
}

func inFlightOf(t *testing.T, pool *pgxpool.Pool, eventID string) inFlightRow {
	t.Helper()
	var r inFlightRow
	if err := pool.QueryRow(context.Background(), `SELECT status, coalesce(claimed_by, ''), coalesce(next_attempt_at, 'epoch')
		FROM outbox_event_state WHERE event_id = $1`, eventID).Scan(&r.status, &r.claimedBy, &r.due); err != nil {
		t.Fatal(err)
	}
	return r
}

// TestMarkerStatements: a detach that names the relay's marker writes
// IN_FLIGHT only when this very statement sees the marker held by the
// session the relay says holds it, and otherwise changes nothing; a
// reclaim takes the not-yet-due IN_FLIGHT events that name a marker only
// once nobody holds it, and nothing else; and a completion still matches
// its token once the detach named a marker after it.
func TestMarkerStatements(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	owner := db.Conn(t)
	id, pid := takeMarker(t, owner)
	ev := map[string]string{}
	for _, name := range []string{"named", "other-pid", "other-marker", "unnamed", "due"} {
		ev[name] = appendEvent(t, db.Pool, name, "e")
	}
	detach := func(name, token string, marker int64, holder int32) {
		t.Helper()
		var tid pgtype.TID
		if err := db.Pool.QueryRow(ctx, `SELECT d.ctid FROM outbox_delivery d JOIN outbox_event e ON e.id = d.id WHERE e.event_id = $1`, ev[name]).Scan(&tid); err != nil {
			t.Fatal(err)
		}
		var err error
		if marker == 0 {
			_, err = db.Pool.Exec(ctx, markInFlightSQL, []pgtype.TID{tid}, int64(time.Hour/time.Millisecond), token)
		} else {
			_, err = db.Pool.Exec(ctx, markInFlightNamedSQL, []pgtype.TID{tid}, int64(time.Hour/time.Millisecond), token, marker, holder)
		}
		if err != nil {
			t.Fatal(err)
		}
	}
	detach("named", "relay/0000000000000001", id, pid)
	detach("other-pid", "relay/0000000000000002", id, pid+100000) // not the holder's backend
	detach("other-marker", "relay/0000000000000003", id+1, pid)   // a marker nobody holds
	detach("unnamed", "relay/0000000000000004", 0, 0)
	detach("due", "relay/0000000000000005", id, pid)
	setDelivery(t, db.Pool, ev["due"], "next_attempt_at = now() - interval '1 second'")
	want := map[string]string{
		"named": fmt.Sprintf("relay/0000000000000001@%d", id), "unnamed": "relay/0000000000000004",
		"due":       fmt.Sprintf("relay/0000000000000005@%d", id),
		"other-pid": "", "other-marker": "", // not held as named: left PENDING
	}
	for name, token := range want {
		status := StatusInFlight
		if token == "" {
			status = StatusPending
		}
		if got := inFlightOf(t, db.Pool, ev[name]); got.status != status || got.claimedBy != token {
			t.Errorf("%s: %s claimed by %q, want %s claimed by %q", name, got.status, got.claimedBy, status, token)
		}
	}

	reclaim := func() []string {
		t.Helper()
		rows, _ := db.Pool.Query(ctx, reclaimSQL, id)
		tokens, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			t.Fatal(err)
		}
		return tokens
	}
	if got := reclaim(); len(got) != 0 {
		t.Fatalf("reclaimed %v while the marker is held", got)
	}
	before := map[string]inFlightRow{}
	for name := range want {
		before[name] = inFlightOf(t, db.Pool, ev[name])
	}
	if err := owner.Close(ctx); err != nil { // the owner's session ends: the marker goes
		t.Fatal(err)
	}
	testkit.Eventually(t, 10*time.Second, "the marker's session to end", func() bool {
		var held bool
		if err := db.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1`+markerHolders+` AND l.objid::bigint = $1)`, id).Scan(&held); err != nil {
			t.Fatal(err)
		}
		return !held
	})
	if got := reclaim(); len(got) != 1 || got[0] != want["named"] {
		t.Fatalf("reclaimed %v once the marker is gone, want only [%s]", got, want["named"])
	}
	for name := range want {
		got := inFlightOf(t, db.Pool, ev[name])
		switch {
		case name == "named" && (got.due.After(time.Now().Add(time.Minute)) || got.claimedBy != want[name]):
			t.Errorf("reclaimed event: due %s, claimed by %q; want due now and its claim kept", got.due, got.claimedBy)
		case name != "named" && got != before[name]:
			t.Errorf("%s changed by the reclaim: %+v, was %+v", name, got, before[name])
		}
	}
	if got := reclaim(); len(got) != 0 {
		t.Errorf("reclaimed %v a second time", got)
	}

	// A completion matches the token with or without the marker after it,
	// and no other token.
	complete := func(name, token string) bool {
		t.Helper()
		var seq int64
		if err := db.Pool.QueryRow(ctx, `SELECT id FROM outbox_event_state WHERE event_id = $1`, ev[name]).Scan(&seq); err != nil {
			t.Fatal(err)
		}
		rows, _ := db.Pool.Query(ctx, completeSQL, []int64{seq}, []string{token}, []int32{1},
			[]string{StatusPublished}, []int64{0}, []*string{nil}, "relay")
		ids, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			t.Fatal(err)
		}
		return len(ids) == 1
	}
	if complete("named", "relay/000000000000000") || complete("other-pid", "relay/000000000000000") {
		t.Error("a completion matched a token that is only a prefix of the event's")
	}
	if !complete("named", "relay/0000000000000001") || !complete("unnamed", "relay/0000000000000004") {
		t.Error("a completion did not match its own token")
	}
}

// stuckSink never answers the first publish of an event of eventType,
// whatever its context says, like a sink call that hangs; every other
// publish succeeds and is recorded.
type stuckSink struct {
	recorder
	eventType string
	release   chan struct{}
	once      sync.Once
	stuck     sync.Once
}

func (s *stuckSink) Publish(ctx context.Context, e Event) error {
	hang := false
	if e.EventType == s.eventType {
		s.stuck.Do(func() { hang = true })
	}
	if hang {
		<-s.release
		return fmt.Errorf("the stuck call gave up")
	}
	return s.recorder.Publish(ctx, e)
}

func (s *stuckSink) free() { s.once.Do(func() { close(s.release) }) }

// startLoggedRelay is startRelay with JSON logs at INFO into a buffer.
func startLoggedRelay(t *testing.T, pool *pgxpool.Pool, sink Sink, cfg outboxconfig.Config, instance string) (*Relay, *testkit.LogBuffer) {
	t.Helper()
	logs := &testkit.LogBuffer{}
	r, err := NewRelay(pool, sink, cfg, instance, slog.New(slog.NewJSONHandler(logs, nil)), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	// Registered first, so it runs after the shutdown and shows its lines.
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("%s logs:\n%s", instance, logs.String())
		}
	})
	startBuilt(t, r, instance)
	return r, logs
}

// relayConns is the pool of a relay of one loop in these tests.
const relayConns = 2

// awaitLooks waits until r has looked at the markers n more times.
func awaitLooks(t *testing.T, r *Relay, n int64, what string) {
	t.Helper()
	want := r.listener.looks.Load() + n
	testkit.Eventually(t, 30*time.Second, what, func() bool { return r.listener.looks.Load() >= want })
}

// TestReclaimSparesALiveOwner: relay A detaches a publish that never
// returns; it holds its marker, so relay B, which watches the markers,
// leaves the event alone until in_flight_timeout, also across a reconnect
// of A's listener (its session ended from outside, A takes its marker
// again within the grace). Only after the deadline is the event published
// again, and its aggregate's next event after it.
func TestReclaimSparesALiveOwner(t *testing.T) {
	t.Parallel()
	pgtest.Need(t, pgtest.PoolConns+2*(relayConns+1)) // and each relay's listener
	db := pgtest.New(t)
	outboxtest.RecordPublishes(t, db.Pool)
	cfg := testConfig()
	cfg.DetachAfter = 50 * time.Millisecond
	cfg.InFlightTimeout = 8 * time.Second
	stuck := &stuckSink{eventType: "h1", release: make(chan struct{})}
	a, _ := startLoggedRelay(t, db.NewPool(t, relayConns), stuck, cfg, "relay-a")
	t.Cleanup(stuck.free) // before A's shutdown, which waits for the call
	// A detach names the marker only if A holds it by then. An event
	// detached before that waits for its deadline whatever happens to A,
	// which is not what this test is about.
	testkit.Eventually(t, 10*time.Second, "A to take its marker", func() bool {
		_, _, ok := a.listener.marker.current()
		return ok
	})
	held := appendEvent(t, db.Pool, "held", "h1")
	next := appendEvent(t, db.Pool, "held", "h2")

	var detached inFlightRow
	testkit.Eventually(t, 10*time.Second, "A to detach the stuck publish, naming its marker", func() bool {
		id, _ := a.listener.marker.snapshot()
		detached = inFlightOf(t, db.Pool, held)
		return id > 0 && detached.status == StatusInFlight && strings.HasSuffix(detached.claimedBy, fmt.Sprintf("@%d", id))
	})
	b, bLogs := startLoggedRelay(t, db.NewPool(t, relayConns), &recorder{}, cfg, "relay-b")
	awaitLooks(t, b, 2, "B to see A's marker")

	_, oldPID, ok := a.listener.marker.current()
	if !ok {
		t.Fatal("A holds no marker")
	}
	exec(t, db.Pool, `SELECT pg_terminate_backend($1)`, int32(oldPID))
	testkit.Eventually(t, 10*time.Second, "A to take its marker again on a new session", func() bool {
		_, pid, ok := a.listener.marker.current()
		return ok && pid != oldPID
	})
	awaitLooks(t, b, 10, "B to look at the markers for two seconds more")
	if time.Now().Add(time.Second).After(detached.due) {
		t.Fatalf("the checks ran until %s, past the visibility deadline %s: a machine this slow proves nothing", time.Now(), detached.due)
	}
	if got := inFlightOf(t, db.Pool, held); got != detached {
		t.Fatalf("a live owner's event changed before its deadline: %+v, was %+v", got, detached)
	}
	if s := statusOf(t, db.Pool, next); s != StatusPending {
		t.Fatalf("the next event of the held aggregate is %s before the deadline", s)
	}
	if lines := bLogs.Lines(t, "outbox relay gone; its detached events reclaimed"); len(lines) != 0 {
		t.Fatalf("B reclaimed a live owner's events: %v", lines)
	}

	// The backstop: once the deadline passes, the event goes out again.
	testkit.Eventually(t, cfg.InFlightTimeout+20*time.Second, "the held aggregate published after the deadline", func() bool {
		return statusOf(t, db.Pool, next) == StatusPublished
	})
	if publishedAt := publishedAt(t, db.Pool, held); publishedAt.Before(detached.due) {
		t.Errorf("the held event was published at %s, before its deadline %s", publishedAt, detached.due)
	}
}

// TestReclaimTakesADeadOwnersEvents: an owner (a session holding its
// marker) has detached events IN_FLIGHT with a deadline an hour away. When
// its session ends, a relay watching the markers publishes them within
// about a second, then their aggregates' next events, and logs one line.
// Events that name no marker wait for their deadline.
func TestReclaimTakesADeadOwnersEvents(t *testing.T) {
	t.Parallel()
	pgtest.Need(t, pgtest.PoolConns+1+relayConns+1) // the owner's session, the relay's pool and listener
	db := pgtest.New(t)
	owner := db.Conn(t)
	id, _ := takeMarker(t, owner)
	detached := func(agg, token string) (head, next string) {
		head, next = appendEvent(t, db.Pool, agg, "e1"), appendEvent(t, db.Pool, agg, "e2")
		setDelivery(t, db.Pool, head, "status = 'IN_FLIGHT', attempts = 1, claimed_by = $2, next_attempt_at = now() + interval '1 hour'", token)
		return head, next
	}
	var heads, nexts []string
	for i := range 3 {
		h, n := detached(fmt.Sprintf("dead-%d", i), fmt.Sprintf("dead-owner/%016x@%d", i, id))
		heads, nexts = append(heads, h), append(nexts, n)
	}
	unnamedHead, _ := detached("unnamed", "old-owner/0000000000000008")

	sink := &recorder{}
	b, logs := startLoggedRelay(t, db.NewPool(t, relayConns), sink, testConfig(), "relay-b")
	awaitLooks(t, b, 2, "B to see the owner's marker")
	if err := owner.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	gone := time.Now()
	published := func(ids []string) func() bool {
		return func() bool {
			for _, id := range ids {
				if !sink.has(id) {
					return false
				}
			}
			return true
		}
	}
	testkit.Eventually(t, 30*time.Second, "the dead owner's events published", published(heads))
	took := time.Since(gone)
	t.Logf("a dead owner's events published %s after its session ended", took.Round(time.Millisecond))
	if took > 2*time.Second {
		t.Errorf("published %s after the owner's session ended, want within 2s", took)
	}
	testkit.Eventually(t, 10*time.Second, "their aggregates' next events published", published(nexts))
	pos := map[string]int{}
	for i, e := range sink.delivered() {
		pos[e.EventID] = i
	}
	for i := range heads {
		if pos[heads[i]] > pos[nexts[i]] {
			t.Errorf("aggregate dead-%d: its next event was published before the reclaimed one", i)
		}
	}
	lines := logs.Lines(t, "outbox relay gone; its detached events reclaimed")
	if len(lines) != 1 || fmt.Sprint(lines[0]["events"]) != "3" || lines[0]["owner"] != "dead-owner" ||
		fmt.Sprint(lines[0]["marker"]) != fmt.Sprint(id) || lines[0]["level"] != "INFO" {
		t.Errorf("want one INFO line with events 3, owner dead-owner and marker %d; got %v", id, lines)
	}
	awaitLooks(t, b, 5, "B to look at the markers once more")
	if got := inFlightOf(t, db.Pool, unnamedHead); got.status != StatusInFlight || sink.has(unnamedHead) || !got.due.After(time.Now().Add(time.Minute)) {
		t.Errorf("event %s reclaimed: %+v; it names no marker", unnamedHead, got)
	}
}

// TestReclaimTakesTheEventsOfAnOwnerDeadBeforeTheRelayStarted: an owner
// detached events naming its marker and died before relay B's listener
// ever looked, so B never saw the marker held. B counts as seen the
// markers that IN_FLIGHT events detached since the server started name,
// and publishes the dead owner's events within about a second of its
// start, not at their deadline. (A replica restarted just before another
// is killed is this case; it held aggregates for in_flight_timeout.)
func TestReclaimTakesTheEventsOfAnOwnerDeadBeforeTheRelayStarted(t *testing.T) {
	t.Parallel()
	pgtest.Need(t, pgtest.PoolConns+1+relayConns+1)
	db := pgtest.New(t)
	owner := db.Conn(t)
	id, _ := takeMarker(t, owner)
	head, next := appendEvent(t, db.Pool, "dead-early", "e1"), appendEvent(t, db.Pool, "dead-early", "e2")
	setDelivery(t, db.Pool, head, "status = 'IN_FLIGHT', attempts = 1, claimed_by = $2, next_attempt_at = now() + interval '1 hour'",
		fmt.Sprintf("dead-owner/%016x@%d", 1, id))
	if err := owner.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
	started := time.Now()
	sink := &recorder{}
	startLoggedRelay(t, db.NewPool(t, relayConns), sink, testConfig(), "relay-b")
	testkit.Eventually(t, 30*time.Second, "the dead owner's event and the next one published", func() bool {
		return sink.has(head) && sink.has(next)
	})
	took := time.Since(started)
	t.Logf("published %s after the relay started", took.Round(time.Millisecond))
	if took > 5*time.Second {
		t.Errorf("published %s after the relay started, want within 5s (its deadline was an hour away)", took)
	}
}

// namedMarkersSQL counts a marker as seen only for events detached since
// the server started: after a restart every owner is reconnecting, and a
// marker missing then says nothing of its owner.
func TestNamedMarkersSinceTheServerStarted(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	head := appendEvent(t, db.Pool, "named", "e1")
	setDelivery(t, db.Pool, head, "status = 'IN_FLIGHT', attempts = 1, claimed_by = 'o/1@4242', next_attempt_at = now() + interval '1 hour'")
	named := func(timeout time.Duration) []int64 {
		rows, _ := db.Pool.Query(context.Background(), namedMarkersSQL, timeout.Milliseconds())
		ms, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			t.Fatal(err)
		}
		return ms
	}
	if got := named(30 * time.Second); len(got) != 1 || got[0] != 4242 {
		t.Errorf("an event detached a moment ago: markers %v, want [4242]", got)
	}
	// The same deadline under a timeout longer than the server has been
	// up: the detach would have come before the server started.
	if got := named(100 * 365 * 24 * time.Hour); len(got) != 0 {
		t.Errorf("an event detached before the server started: markers %v, want none", got)
	}
}
