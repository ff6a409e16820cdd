package lock

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

type row struct {
	token             int64
	owner             string
	acquired, expires time.Time
}

func readRow(t *testing.T, db *pgtest.DB, key string) (row, bool) {
	t.Helper()
	var r row
	err := db.Pool.QueryRow(testCtx(t), `SELECT token, owner, acquired_at, expires_at FROM worker_lock WHERE key = $1`, key).
		Scan(&r.token, &r.owner, &r.acquired, &r.expires)
	if errors.Is(err, pgx.ErrNoRows) {
		return r, false
	}
	if err != nil {
		t.Fatal(err)
	}
	return r, true
}

func dbNow(t *testing.T, db *pgtest.DB) time.Time {
	t.Helper()
	var ts time.Time
	if err := db.Pool.QueryRow(testCtx(t), `SELECT clock_timestamp()`).Scan(&ts); err != nil {
		t.Fatal(err)
	}
	return ts
}

// acquireBracketed acquires key and checks that the row's expiry is ttl
// after a database-clock instant taken during the call.
func acquireBracketed(t *testing.T, db *pgtest.DB, l Locker, key string, wait, ttl time.Duration) Lease {
	t.Helper()
	before := dbNow(t, db)
	lease, err := l.TryAcquire(testCtx(t), key, wait, ttl)
	if err != nil {
		t.Fatal(err)
	}
	after := dbNow(t, db)
	r, _ := readRow(t, db, key)
	if r.expires.Before(before.Add(ttl)) || r.expires.After(after.Add(ttl)) {
		t.Fatalf("expires_at %s is not ttl after the database clock during acquire [%s, %s]",
			r.expires, before.Add(ttl), after.Add(ttl))
	}
	return lease
}

// Expiry follows the database clock. The two replicas' clocks are an hour
// ahead and an hour behind; had either computed or judged expiry with its
// own clock, the lease would be stolen at once or held for an hour.
func TestPostgresDatabaseClock(t *testing.T) {
	ctx := testCtx(t)
	db := pgtest.New(t)
	log := new(testkit.LogBuffer).Logger()
	ahead := newPostgres(t, db, log, WithClock(func() time.Time { return time.Now().Add(time.Hour) }))
	behind := newPostgres(t, db, log, WithClock(func() time.Time { return time.Now().Add(-time.Hour) }), WithoutHeartbeat())
	const ttl = 2 * time.Second

	lb := acquireBracketed(t, db, behind, "k", 0, ttl)
	if _, err := ahead.TryAcquire(ctx, "k", 300*time.Millisecond, ttl); !IsTimeout(err) {
		t.Fatalf("replica with a fast clock took a live lease: %v", err)
	}
	if err := lb.Renew(ctx); err != nil {
		t.Fatalf("holder with a slow clock could not renew: %v", err)
	}
	renewed, _ := readRow(t, db, "k")

	la := acquireBracketed(t, db, ahead, "k", 10*time.Second, ttl)
	taken, _ := readRow(t, db, "k")
	if taken.acquired.Before(renewed.expires) {
		t.Errorf("taken over at %s, before the database expiry %s", taken.acquired, renewed.expires)
	}
	if la.Token() <= lb.Token() {
		t.Errorf("token %d not greater than %d", la.Token(), lb.Token())
	}
	if err := lb.Release(ctx); !errors.Is(err, ErrLeaseExpired) {
		t.Errorf("old holder's Release = %v, want ErrLeaseExpired", err)
	}
	if err := la.Release(ctx); err != nil {
		t.Errorf("Release = %v", err)
	}
}

// Killing every connection of the database does not drop or shorten a
// lease: no one gets it early, the heartbeat recovers on a new connection,
// and the listener reconnects.
func TestPostgresConnectionLoss(t *testing.T) {
	ctx := testCtx(t)
	db := pgtest.New(t)
	logs := &testkit.LogBuffer{}
	log := logs.Logger()
	holder := newPostgres(t, db, log)
	// other polls hourly, so below only its (reconnected) listener can wake
	// it early.
	parked := make(chan struct{}, 1)
	other := newPostgres(t, db, log, WithPollInterval(time.Hour), withWaitHook(func(string) {
		select {
		case parked <- struct{}{}:
		default:
		}
	}))
	testkit.Eventually(t, 10*time.Second, "listeners connected", func() bool {
		return holder.connects.Load() == 1 && other.connects.Load() == 1
	})
	const ttl = 3 * time.Second
	lease, err := holder.TryAcquire(ctx, "k", 0, ttl)
	if err != nil {
		t.Fatal(err)
	}

	terminateBackends(t, db)
	atKill, _ := readRow(t, db, "k")

	if _, err := other.TryAcquire(ctx, "k", time.Second, ttl); !IsTimeout(err) {
		t.Fatalf("another replica got the lease after the connections died: %v", err)
	}
	testkit.Eventually(t, 2*ttl, "heartbeat renews on a new connection", func() bool {
		r, _ := readRow(t, db, "k")
		return r.token == lease.Token() && r.expires.After(atKill.expires)
	})
	if isClosed(lease.Lost()) {
		t.Fatal("lease lost after a connection drop")
	}
	testkit.Eventually(t, 10*time.Second, "listeners reconnected", func() bool {
		return holder.connects.Load() >= 2 && other.connects.Load() >= 2
	})
	if len(logs.Lines(t, "lock listener disconnected; waiters fall back to polling until it reconnects")) == 0 {
		t.Error("listener loss not logged")
	}

	if err := lease.Release(ctx); err != nil {
		t.Fatalf("Release after the connection loss = %v", err)
	}

	// The reconnected listener still delivers releases: with an hour-long
	// poll and ttl, only the notification can end this wait early.
	long, err := holder.TryAcquire(ctx, "k", 0, time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	select {
	case <-parked: // from the wait above
	default:
	}
	got := make(chan error, 1)
	go func() {
		l, err := other.TryAcquire(ctx, "k", 30*time.Second, ttl)
		if err == nil {
			err = l.Release(ctx)
		}
		got <- err
	}()
	select {
	case <-parked:
	case <-time.After(10 * time.Second):
		t.Fatal("waiter did not park")
	}
	if err := long.Release(ctx); err != nil {
		t.Fatalf("Release = %v", err)
	}
	released := time.Now()
	if err := <-got; err != nil {
		t.Fatalf("waiter: %v", err)
	}
	if d := time.Since(released); d > wakeBound {
		t.Errorf("waiter got the key %s after the release: the reconnected listener did not wake it", d)
	}
}

func terminateBackends(t *testing.T, db *pgtest.DB) {
	t.Helper()
	ctx := testCtx(t)
	admin := pgtest.AdminConn(t)
	var n int
	err := admin.QueryRow(ctx, `SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity
	                            WHERE datname = $1 AND pid <> pg_backend_pid()`, db.Name).Scan(&n)
	if err != nil {
		t.Fatal(err)
	}
	if n == 0 {
		t.Fatal("no backends to terminate")
	}
	// The test's own reading pool lost its connections too; it is not under
	// test, so give it fresh ones instead of a failing first query.
	db.Pool.Reset()
}

// When every renewal fails (here: the pool is gone), the lease is declared
// lost once the holder's own estimate of its ttl runs out.
func TestPostgresRenewalFailsUntilTTL(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	db := pgtest.New(t)
	logs := &testkit.LogBuffer{}
	log := logs.Logger()
	pool := db.NewPool(t, 0)
	p, err := NewPostgres(pool, "replica", log)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	l, reg := metered(t, p)
	lease, err := l.TryAcquire(ctx, "k", 0, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	pool.Close()
	waitClosed(t, lease.Lost(), 5*time.Second, "Lost after failing renewals")
	if len(logs.Lines(t, "lock lease renewal failed; retrying within the ttl")) == 0 {
		t.Error("failed renewals were not logged")
	}
	testkit.Eventually(t, 5*time.Second, "lock_lease_lost_total = 1", func() bool {
		return metricValue(t, reg, "lock_lease_lost_total") == 1
	})
	if err := lease.Renew(ctx); !errors.Is(err, ErrLeaseLost) {
		t.Errorf("Renew of a lost lease = %v, want ErrLeaseLost", err)
	}
}

// Fencing tokens keep growing across a provider restart and after the
// reaper deleted the key's row.
func TestPostgresTokensSurviveRestartAndReap(t *testing.T) {
	ctx := testCtx(t)
	db := pgtest.New(t)
	grant := func(p *Postgres) int64 {
		t.Helper()
		l, err := p.TryAcquire(ctx, "k", 0, time.Minute)
		if err != nil {
			t.Fatal(err)
		}
		if err := l.Release(ctx); err != nil {
			t.Fatal(err)
		}
		return l.Token()
	}
	first := newPostgres(t, db, nil)
	t1 := grant(first)
	first.Close()

	restarted := newPostgres(t, db, nil)
	t2 := grant(restarted)
	if t2 <= t1 {
		t.Fatalf("token after restart %d, not greater than %d", t2, t1)
	}

	if n, err := restarted.Reap(ctx, time.Hour); err != nil || n != 0 {
		t.Fatalf("Reap(1h) = %d, %v; want 0 (the row expired just now)", n, err)
	}
	if n, err := restarted.Reap(ctx, 0); err != nil || n != 1 {
		t.Fatalf("Reap(0) = %d, %v; want 1", n, err)
	}
	if _, ok := readRow(t, db, "k"); ok {
		t.Fatal("reaped row still there")
	}
	t3 := grant(restarted)
	if t3 <= t2 {
		t.Fatalf("token after reaping %d, not greater than %d", t3, t2)
	}

	live, err := restarted.TryAcquire(ctx, "k", 0, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	defer live.Release(ctx)
	if n, err := restarted.Reap(ctx, 0); err != nil || n != 0 {
		t.Fatalf("Reap with a live lease = %d, %v; want 0", n, err)
	}
}

// Reap deletes in bounded batches until nothing old is left.
func TestPostgresReapBatches(t *testing.T) {
	ctx := testCtx(t)
	db := pgtest.New(t)
	const old = 2*reapBatch + 500
	_, err := db.Pool.Exec(ctx, `
INSERT INTO worker_lock (key, token, owner, acquired_at, expires_at)
SELECT 'old-' || g, nextval('worker_lock_token_seq'), 'gone', now() - interval '2 hours', now() - interval '1 hour'
  FROM generate_series(1, $1) g`, old)
	if err != nil {
		t.Fatal(err)
	}
	p := newPostgres(t, db, nil)
	keep, err := p.TryAcquire(ctx, "live", 0, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	defer keep.Release(ctx)
	if n, err := p.Reap(ctx, 2*time.Hour); err != nil || n != 0 {
		t.Fatalf("Reap(2h) = %d, %v; want 0", n, err)
	}
	if n, err := p.Reap(ctx, 30*time.Minute); err != nil || n != old {
		t.Fatalf("Reap(30m) = %d, %v; want %d", n, err, old)
	}
	if _, ok := readRow(t, db, "live"); !ok {
		t.Fatal("Reap deleted a live lease")
	}
}

func TestCheckStore(t *testing.T) {
	ctx := testCtx(t)
	if err := CheckStore(ctx, pgtest.New(t).Pool); err != nil {
		t.Errorf("migrated database: %v", err)
	}
	if err := CheckStore(ctx, pgtest.NewEmpty(t).Pool); err == nil {
		t.Error("database without migrations passed CheckStore")
	}
}

// Close stops the listener; a second Close is harmless.
func TestPostgresClose(t *testing.T) {
	db := pgtest.New(t)
	p, err := NewPostgres(db.Pool, "", nil)
	if err != nil {
		t.Fatal(err)
	}
	p.Close()
	p.Close()
	// Leases still work without the listener, through the poll.
	l, err := p.TryAcquire(context.Background(), "k", 0, time.Second)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Release(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, err := NewPostgres(nil, "x", nil); err == nil {
		t.Error("NewPostgres(nil pool) succeeded")
	}
}

// A release commits without waiting for its WAL flush, and that setting
// must not outlive the release's own transaction: behind a pooler (or on
// the next use of a pooled connection) a leaked synchronous_commit=off
// would make acquires and renewals non-durable, and a crash could then hand
// out a token twice.
func TestPostgresReleaseIsAsyncForItsTransactionOnly(t *testing.T) {
	ctx := testCtx(t)
	db := pgtest.New(t)
	var serverDefault string
	if err := db.Pool.QueryRow(ctx, `SHOW synchronous_commit`).Scan(&serverDefault); err != nil {
		t.Fatal(err)
	}
	if serverDefault == "off" {
		t.Fatal("the test server runs with synchronous_commit=off; this test needs it on")
	}

	// One connection, so the check below runs on the session that released.
	p, err := NewPostgres(db.NewPool(t, 1), "replica", nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	lease, err := p.TryAcquire(ctx, "k", 0, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := lease.Release(ctx); err != nil {
		t.Fatal(err)
	}
	var after string
	if err := p.pool.QueryRow(ctx, `SHOW synchronous_commit`).Scan(&after); err != nil {
		t.Fatal(err)
	}
	if after != serverDefault {
		t.Fatalf("synchronous_commit after a release = %q, want the server default %q", after, serverDefault)
	}

	// Inside the release's transaction the commit is asynchronous.
	lease, err = p.TryAcquire(ctx, "k", 0, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, releaseSQL, "k", lease.Token(), p.Owner()); err != nil {
		t.Fatal(err)
	}
	var during string
	if err := tx.QueryRow(ctx, `SHOW synchronous_commit`).Scan(&during); err != nil {
		t.Fatal(err)
	}
	if during != "off" {
		t.Fatalf("synchronous_commit in the release's transaction = %q, want off", during)
	}
}

// A release that commits while a waiter's acquireSlowSQL runs (after its
// snapshot, before its "marked" UPDATE reaches the row) notifies nobody,
// since nobody had marked the grant, and the snapshot still shows the old
// holder's remaining time. The waiter must look again at once rather than
// sleep a poll interval (here an hour, so: until its deadline).
func TestPostgresWaiterSeesReleaseDuringItsStatement(t *testing.T) {
	ctx := testCtx(t)
	db := pgtest.New(t)
	holder := newPostgres(t, db, nil)
	waiter := newPostgres(t, db, nil, WithPollInterval(time.Hour))
	lease, err := holder.TryAcquire(ctx, "k", 0, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 10*time.Second, "listener", func() bool { return waiter.connects.Load() == 1 })

	// The holder's release, caught between its UPDATE and its commit.
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	if _, err := tx.Exec(ctx, releaseSQL, "k", lease.Token(), holder.Owner()); err != nil {
		t.Fatal(err)
	}

	const wait = 5 * time.Second
	done := make(chan error, 1)
	go func() {
		l, err := waiter.TryAcquire(ctx, "k", wait, time.Second)
		if err == nil {
			l.Release(ctx)
		}
		done <- err
	}()
	// The waiter's acquireSlowSQL is now blocked behind the release's row lock.
	testkit.Eventually(t, 10*time.Second, "waiter blocked in acquireSlowSQL", func() bool {
		var n int
		_ = db.Pool.QueryRow(ctx, `SELECT count(*) FROM pg_stat_activity
		                            WHERE datname = current_database() AND wait_event_type = 'Lock'
		                              AND query LIKE '%WITH created AS%'`).Scan(&n)
		return n == 1
	})
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	released := time.Now()
	if err := <-done; err != nil {
		t.Fatalf("waiter: %v", err)
	}
	if d := time.Since(released); d > time.Second {
		t.Fatalf("waiter took the free key %s after the release (wait %s): the release was missed", d.Round(time.Millisecond), wait)
	}
}

// A Release whose statement failed leaves the lease held (the caller may
// retry) but stops the heartbeat; its Lost channel must still fire when the
// ttl runs out.
func TestPostgresFailedReleaseStillReportsLoss(t *testing.T) {
	t.Parallel()
	ctx := testCtx(t)
	db := pgtest.New(t)
	pool := db.NewPool(t, 0)
	p, err := NewPostgres(pool, "r", nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	m, reg := metered(t, p)
	l, err := m.TryAcquire(ctx, "k", 0, 300*time.Millisecond)
	if err != nil {
		t.Fatal(err)
	}
	pool.Close()
	if err := l.Release(ctx); err == nil {
		t.Fatal("release on a closed pool succeeded")
	}
	// The grant lives on in the store until its ttl: still held, then lost.
	if got := metricValue(t, reg, "lock_held"); got != 1 {
		t.Errorf("lock_held = %v right after the failed release, want 1", got)
	}
	waitClosed(t, l.Lost(), 5*time.Second, "the lost signal of a lease whose release failed")
	testkit.Eventually(t, 5*time.Second, "the loss to be counted", func() bool {
		return metricValue(t, reg, "lock_lease_lost_total") == 1 && metricValue(t, reg, "lock_held") == 0
	})
}

// fencedTx takes key "k" with a 1s ttl from l and opens a transaction on
// db that has passed the lease's fence.
func fencedTx(t *testing.T, db *pgtest.DB, l Locker, ttl time.Duration) (Lease, pgx.Tx) {
	t.Helper()
	ctx := testCtx(t)
	lease, err := l.TryAcquire(ctx, "k", 0, ttl)
	if err != nil {
		t.Fatal(err)
	}
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	if err := lease.Fence(ctx, tx); err != nil {
		t.Fatal(err)
	}
	return lease, tx
}

type grant struct {
	lease Lease
	err   error
}

// newTaker is another replica, its connections open before the test's
// fenced transaction starts: on a busy machine opening them may take
// longer than the fence lets the transaction sit idle.
func newTaker(t *testing.T, db *pgtest.DB) Locker {
	t.Helper()
	ctx := testCtx(t)
	taker := newPostgres(t, db, nil)
	l, err := taker.TryAcquire(ctx, "warm-up", time.Second, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := l.Release(ctx); err != nil {
		t.Fatal(err)
	}
	return taker
}

// blockedTaker has taker acquire key "k" (waiting up to wait) while a
// fenced transaction is open, waits until its statement is blocked on the
// lease row, and checks it has not returned. The grant comes on the
// channel once the fenced transaction ended.
func blockedTaker(t *testing.T, db *pgtest.DB, taker Locker, wait time.Duration) <-chan grant {
	t.Helper()
	ctx := testCtx(t)
	taken := make(chan grant, 1)
	go func() {
		l, err := taker.TryAcquire(ctx, "k", wait, time.Minute)
		taken <- grant{l, err}
	}()
	testkit.Eventually(t, 10*time.Second, "the taker blocked on the lease row", func() bool {
		var waiting bool
		err := db.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%worker_lock%')`).Scan(&waiting)
		return err == nil && waiting
	})
	select {
	case g := <-taken:
		t.Fatalf("the taker returned (%v) while the fenced transaction was open", g.err)
	default:
	}
	return taken
}

// A fenced transaction keeps its lease until it ends: a replica waiting for
// the key blocks on the row lock until the COMMIT, so it cannot slip in
// between the fence and the commit. The grant it makes once the old one
// expired starts after that commit.
func TestPostgresFenceHoldsOffTakeoverUntilCommit(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := testCtx(t)
	taker := newTaker(t, db)
	lease, tx := fencedTx(t, db, newPostgres(t, db, nil, WithoutHeartbeat()), 3*time.Second)
	// The taker waits for the key: marking the held grant awaited is an
	// UPDATE of its row, which waits for the fenced transaction's row lock.
	taken := blockedTaker(t, db, taker, 30*time.Second)
	var committedAt time.Time
	if err := tx.QueryRow(ctx, `SELECT clock_timestamp()`).Scan(&committedAt); err != nil {
		t.Fatal(err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatalf("commit of the fenced transaction: %v", err)
	}
	g := <-taken
	if g.err != nil {
		t.Fatalf("takeover after the commit: %v", g.err)
	}
	defer g.lease.Release(ctx)
	if g.lease.Token() <= lease.Token() {
		t.Errorf("taker token %d not greater than %d", g.lease.Token(), lease.Token())
	}
	r, _ := readRow(t, db, "k")
	if !r.acquired.After(committedAt) {
		t.Errorf("takeover granted at %s, before the fenced transaction committed (after %s)", r.acquired, committedAt)
	}
}

// The case the fence exists for: the grant expired while the fenced
// transaction was still open (its holder was slow), and another replica's
// try finds the key free. The try's UPDATE waits for the COMMIT, so
// it cannot take the key between the fence and the commit.
func TestPostgresFenceHoldsOffTryOnExpiredGrant(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := testCtx(t)
	taker := newTaker(t, db)
	lease, tx := fencedTx(t, db, newPostgres(t, db, nil, WithoutHeartbeat()), 3*time.Second)
	// Busy, not idle (the fence bounds idleness to the ttl), until the
	// grant has expired on the server's clock.
	if _, err := tx.Exec(ctx, `SELECT pg_sleep(greatest(0, extract(epoch FROM expires_at - clock_timestamp())) + 0.01)
		FROM worker_lock WHERE key = 'k'`); err != nil {
		t.Fatal(err)
	}
	// The grant has expired, so the taker's first statement takes the key:
	// it is that statement that must wait for the COMMIT. Its budget is
	// generous (a single try's would be a second), so that a busy machine
	// seeing it blocked and committing is not a race against it.
	taken := blockedTaker(t, db, taker, 10*time.Second)
	if err := tx.Commit(ctx); err != nil {
		t.Fatalf("commit of the fenced transaction: %v", err)
	}
	// (The new grant's acquired_at is not compared with the commit: the
	// UPDATE computed it before it waited for the row lock.)
	g := <-taken
	if g.err != nil {
		t.Fatalf("the try after the commit: %v", g.err)
	}
	defer g.lease.Release(ctx)
	if g.lease.Token() <= lease.Token() {
		t.Errorf("taken with token %d; want one above the fenced holder's %d", g.lease.Token(), lease.Token())
	}
}

// A fenced transaction that then sits idle (its holder paused before
// sending COMMIT) is ended by the server after one ttl, so it cannot keep
// the lease from being taken over forever.
func TestPostgresFencedTransactionIdleIsBounded(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := testCtx(t)
	lease, tx := fencedTx(t, db, newPostgres(t, db, nil), time.Second)
	defer lease.Release(ctx)
	pid := tx.Conn().PgConn().PID()
	testkit.Eventually(t, 10*time.Second, "the server to end the idle fenced transaction", func() bool {
		var alive bool
		err := db.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)`, pid).Scan(&alive)
		return err == nil && !alive
	})
	if err := tx.Commit(ctx); err == nil {
		t.Error("a fenced transaction left idle past the ttl still committed")
	}
}
