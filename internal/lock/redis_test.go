package lock

import (
	"context"
	"encoding/json"
	"errors"
	"strconv"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/redis/go-redis/v9"

	"github.com/worker-dev/worker/internal/obs"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// redisFixture is one test's Redis (a key prefix of its own), database for
// the fence (nil unless asked for: the suite's connections are shared),
// and logs.
type redisFixture struct {
	db     *pgtest.DB
	prefix string
	admin  *redis.Client
	logs   *testkit.LogBuffer
}

func newRedisFixture(t *testing.T, withDB bool) *redisFixture {
	f := &redisFixture{prefix: testkit.RedisPrefix(t), admin: testkit.RedisClient(t), logs: &testkit.LogBuffer{}}
	if withDB {
		f.db = pgtest.New(t)
	}
	return f
}

func (f *redisFixture) replica(t *testing.T, opts ...Option) *Redis {
	return newRedis(t, f.prefix, f.logs.Logger(), opts...)
}

func (f *redisFixture) begin(t *testing.T) pgx.Tx {
	t.Helper()
	tx, err := f.db.Pool.Begin(testCtx(t))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = tx.Rollback(context.Background()) })
	return tx
}

// A later grant's commit wins: a lease whose grant Redis still shows (as
// after a failover that lost a takeover's writes) is refused at its fence
// once a higher token committed, and the refusal names both tokens. The
// key's counter is then raised, so the next grant commits again.
func TestRedisFenceRefusesLowerToken(t *testing.T) {
	t.Parallel()
	f := newRedisFixture(t, true)
	ctx := testCtx(t)
	l := f.replica(t, WithoutHeartbeat())
	lease, err := l.TryAcquire(ctx, "k", 0, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	// Far above any clock-based token, so only the raise can get past it.
	higher := lease.Token() + 1_000_000_000_000
	if _, err := f.db.Pool.Exec(ctx, `INSERT INTO lock_fence VALUES ('k', $1, 'another-replica')`, higher); err != nil {
		t.Fatal(err)
	}
	refused := f.begin(t)
	err = lease.Fence(ctx, refused)
	if !errors.Is(err, ErrLeaseLost) {
		t.Fatalf("Fence below a committed higher token = %v, want ErrLeaseLost", err)
	}
	// As jobs.InTx does: the refused transaction holds the key's row.
	if err := refused.Rollback(ctx); err != nil {
		t.Fatal(err)
	}
	waitClosed(t, lease.Lost(), time.Second, "Lost after a refused fence")
	lines := f.logs.Lines(t, "lock fence refused the commit: the lease is no longer held")
	if len(lines) != 1 {
		t.Fatalf("%d refusal log lines, want 1", len(lines))
	}
	if lines[0]["token"] != json.Number(strconv.FormatInt(lease.Token(), 10)) ||
		lines[0]["highest_token"] != json.Number(strconv.FormatInt(higher, 10)) {
		t.Errorf("refusal line does not name our token %d and the highest %d: %v", lease.Token(), higher, lines[0])
	}
	if err := lease.Release(ctx); !errors.Is(err, ErrLeaseExpired) {
		t.Errorf("Release of a lease refused at its fence = %v, want ErrLeaseExpired", err)
	}

	next, err := l.TryAcquire(ctx, "k", 0, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer next.Release(ctx)
	if next.Token() <= higher {
		t.Fatalf("next grant's token %d is not above the committed %d", next.Token(), higher)
	}
	tx := f.begin(t)
	if err := next.Fence(ctx, tx); err != nil {
		t.Fatalf("Fence of the next grant: %v", err)
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
}

// The same token from another owner (a failover that lost the counter's
// last increment handed it out twice) is refused; the same grant fences
// any number of transactions.
func TestRedisFenceRefusesSameTokenOfAnotherOwner(t *testing.T) {
	t.Parallel()
	f := newRedisFixture(t, true)
	ctx := testCtx(t)
	lease, err := f.replica(t, WithoutHeartbeat()).TryAcquire(ctx, "k", 0, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer lease.Release(ctx)
	for i := range 2 {
		tx := f.begin(t)
		if err := lease.Fence(ctx, tx); err != nil {
			t.Fatalf("fenced transaction %d of one grant: %v", i, err)
		}
		if err := tx.Commit(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := f.db.Pool.Exec(ctx, `UPDATE lock_fence SET owner = 'twin' WHERE key = 'k'`); err != nil {
		t.Fatal(err)
	}
	if err := lease.Fence(ctx, f.begin(t)); !errors.Is(err, ErrLeaseLost) {
		t.Fatalf("Fence with a token another owner committed = %v, want ErrLeaseLost", err)
	}
}

// Fenced commits of one key serialise on its lock_fence row: a lower
// token's fence waits for a higher token's open transaction and is refused
// once it commits. (Here the higher grant is staged in the table; in
// production it is a replica that took the key over.)
func TestRedisFenceWaitsForHigherTokenCommit(t *testing.T) {
	t.Parallel()
	f := newRedisFixture(t, true)
	ctx := testCtx(t)
	lease, err := f.replica(t, WithoutHeartbeat()).TryAcquire(ctx, "k", 0, 30*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer lease.Release(ctx)
	other := f.begin(t)
	if _, err := other.Exec(ctx, `INSERT INTO lock_fence VALUES ('k', $1, 'taker')`, lease.Token()+1); err != nil {
		t.Fatal(err)
	}
	fenced := make(chan error, 1)
	go func() { fenced <- lease.Fence(ctx, f.begin(t)) }()
	testkit.Eventually(t, 10*time.Second, "the fence blocked on the key's row", func() bool {
		var waiting bool
		err := f.db.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity
			WHERE datname = current_database() AND wait_event_type = 'Lock' AND query LIKE '%lock_fence%')`).Scan(&waiting)
		return err == nil && waiting
	})
	select {
	case err := <-fenced:
		t.Fatalf("the fence returned (%v) while a higher token's transaction was open", err)
	default:
	}
	if err := other.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	if err := <-fenced; !errors.Is(err, ErrLeaseLost) {
		t.Fatalf("Fence after a higher token committed = %v, want ErrLeaseLost", err)
	}
}

// A fenced transaction that then sits idle (its holder paused before
// sending COMMIT) is ended by the server before the grant's time in Redis
// runs out, so it cannot commit after another replica could take over.
func TestRedisFencedTransactionIdleIsBounded(t *testing.T) {
	t.Parallel()
	f := newRedisFixture(t, true)
	ctx := testCtx(t)
	const ttl = time.Second
	lease, err := f.replica(t, WithoutHeartbeat()).TryAcquire(ctx, "k", 0, ttl)
	if err != nil {
		t.Fatal(err)
	}
	defer lease.Release(ctx)
	tx := f.begin(t)
	fenced := time.Now()
	if err := lease.Fence(ctx, tx); err != nil {
		t.Fatal(err)
	}
	pid := tx.Conn().PgConn().PID()
	testkit.Eventually(t, 10*time.Second, "the server to end the idle fenced transaction", func() bool {
		var alive bool
		err := f.db.Pool.QueryRow(ctx, `SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = $1)`, pid).Scan(&alive)
		return err == nil && !alive
	})
	if d := time.Since(fenced); d > ttl+time.Second {
		t.Errorf("the idle fenced transaction lived %s, its grant %s", d, ttl)
	}
	if err := tx.Commit(ctx); err == nil {
		t.Error("a fenced transaction left idle past its grant still committed")
	}
}

// Tokens keep increasing when Redis loses every key (a restart without
// persistence): they never fall below Redis's clock in microseconds.
func TestRedisTokensSurviveLostKeys(t *testing.T) {
	t.Parallel()
	f := newRedisFixture(t, false)
	ctx := testCtx(t)
	l := f.replica(t)
	first, err := l.TryAcquire(ctx, "k", 0, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	if err := first.Release(ctx); err != nil {
		t.Fatal(err)
	}
	keys, err := f.admin.Keys(ctx, f.prefix+"*").Result()
	if err != nil || len(keys) == 0 {
		t.Fatalf("keys under the prefix: %v, %v", keys, err)
	}
	if err := f.admin.Del(ctx, keys...).Err(); err != nil {
		t.Fatal(err)
	}
	second, err := l.TryAcquire(ctx, "k", 0, time.Minute)
	if err != nil {
		t.Fatal(err)
	}
	defer second.Release(ctx)
	if second.Token() <= first.Token() {
		t.Errorf("token %d after Redis lost its keys; the grant before had %d", second.Token(), first.Token())
	}
}

// Expiry is Redis's: the lease key carries the ttl (PX), rounded up to
// whole milliseconds so that Redis never lets go before the holder's own
// estimate; a renewal resets it.
func TestRedisLeaseExpiryIsRedisTTL(t *testing.T) {
	t.Parallel()
	f := newRedisFixture(t, false)
	ctx := testCtx(t)
	lease, err := f.replica(t, WithoutHeartbeat()).TryAcquire(ctx, "k", 0, 10*time.Second+300*time.Microsecond)
	if err != nil {
		t.Fatal(err)
	}
	defer lease.Release(ctx)
	pttl := f.admin.PTTL(ctx, f.prefix+"{k}").Val()
	if pttl <= 9*time.Second || pttl > 10*time.Second+time.Millisecond {
		t.Errorf("PTTL %s after acquiring with ttl 10.0003s", pttl)
	}
	if err := f.admin.PExpire(ctx, f.prefix+"{k}", time.Second).Err(); err != nil {
		t.Fatal(err)
	}
	if err := lease.Renew(ctx); err != nil {
		t.Fatal(err)
	}
	if pttl := f.admin.PTTL(ctx, f.prefix+"{k}").Val(); pttl <= 9*time.Second {
		t.Errorf("PTTL %s after a renewal", pttl)
	}
}

// An unreachable Redis is an acquisition error, not a timeout, within the
// statement bound; the provider starts without Redis and Close returns.
func TestRedisUnreachable(t *testing.T) {
	t.Parallel()
	rdb := redis.NewClient(&redis.Options{Addr: "127.0.0.1:1", ContextTimeoutEnabled: true, MaxRetries: -1})
	defer rdb.Close()
	l, reg := metered(t, mustRedis(t, rdb))
	start := time.Now()
	_, err := l.TryAcquire(testCtx(t), "k", 0, time.Second)
	if err == nil || IsTimeout(err) {
		t.Fatalf("TryAcquire against an unreachable Redis = %v, want an error", err)
	}
	if code := obs.CodeOf(err); code != obs.CodeLockProviderUnavailable {
		t.Errorf("its code is %q, want %s: the job's log line names it", code, obs.CodeLockProviderUnavailable)
	}
	if d := time.Since(start); d > 2*minStatementBudget {
		t.Errorf("failed after %s", d)
	}
	if got := metricValue(t, reg, "lock_acquisition_total", "outcome", OutcomeError, "provider", "redis"); got != 1 {
		t.Errorf(`lock_acquisition_total{outcome="error",provider="redis"} = %v, want 1`, got)
	}
}

func mustRedis(t *testing.T, rdb redis.UniversalClient) *Redis {
	t.Helper()
	r, err := NewRedis(rdb, testkit.RedisPrefix(t), "replica", nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(r.Close)
	return r
}

func TestCheckFenceStore(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := testCtx(t)
	if err := CheckFenceStore(ctx, db.Pool); err != nil {
		t.Fatalf("migrated database: %v", err)
	}
	if _, err := db.Pool.Exec(ctx, `DROP TABLE lock_fence`); err != nil {
		t.Fatal(err)
	}
	if err := CheckFenceStore(ctx, db.Pool); err == nil {
		t.Fatal("no error without the lock_fence table")
	}
}
