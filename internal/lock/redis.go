package lock

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/redis/go-redis/v9"
)

// DefaultRedisKeyPrefix starts every key the Redis provider writes.
const DefaultRedisKeyPrefix = "worker:lock:"

// Each operation is one Lua script, so it runs atomically on the server,
// and expiry is set and judged only by Redis (PX, PEXPIRE, PTTL): Go never
// sends a time, only a duration. KEYS[1] is the lease, whose value is
// "<token> <owner>"; KEYS[2] is the key's token counter; KEYS[3] marks
// that a replica waits for the lease. All carry the lock key as a hash
// tag, so they sit in one slot of a cluster.
var (
	// acquireScript takes the lease if it does not exist (released, or
	// expired by Redis's clock) and returns {token, 0}; otherwise {0, the
	// holder's remaining ms} (-1: a lease without expiry, which only a
	// hand-made key can be), and if the caller will wait (ARGV[3] = 1),
	// marks the lease awaited for as long as it has left, so that its
	// release notifies. (A renewal outlives the mark; the waiter then
	// wakes at the remaining time it was told, and marks again.) The token comes from the key's counter
	// (INCR), raised to Redis's clock in microseconds when it is behind:
	// the counter alone would start again at 1 if Redis lost it (a restart
	// without persistence, a failover to a replica that missed the last
	// writes, eviction), and the clock keeps tokens increasing across
	// that. string.format, because Lua would write a large number as
	// 1.7e+15.
	acquireScript = redis.NewScript(`
local left = redis.call('PTTL', KEYS[1])
if left ~= -2 then
  if ARGV[3] == '1' and left > 0 then redis.call('SET', KEYS[3], '1', 'PX', left) end
  return {0, left}
end
local now = redis.call('TIME')
local floor = tonumber(now[1]) * 1000000 + tonumber(now[2])
local token = redis.call('INCR', KEYS[2])
if token < floor then
  token = floor
  redis.call('SET', KEYS[2], string.format('%d', token))
end
redis.call('SET', KEYS[1], string.format('%d', token) .. ' ' .. ARGV[1], 'PX', ARGV[2])
return {token, 0}`)

	// renewScript extends the lease by ARGV[2] ms, from now on Redis's
	// clock, only if it is still this grant (token and owner): {1, 0}.
	// Otherwise {0, the key's latest token}, so a refusal can name it. An
	// expired lease no longer exists, so it cannot be renewed.
	renewScript = redis.NewScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return {1, 0}
end
return {0, tonumber(redis.call('GET', KEYS[2]) or '0')}`)

	// releaseScript deletes the lease only if it is still this grant, and
	// then, if a replica marked it awaited, wakes the waiters of every
	// replica (ARGV[2] is the channel, ARGV[3] the lock key): {1, 0}. The
	// releases of keys nobody waits for (the common case: jobs try once)
	// publish nothing. Deleting someone else's lease, the classic Redis
	// lock bug, cannot happen: the check and the delete are atomic.
	// Otherwise {0, the key's latest token}, for the warning.
	releaseScript = redis.NewScript(`
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  if redis.call('DEL', KEYS[3]) == 1 then redis.call('PUBLISH', ARGV[2], ARGV[3]) end
  return {1, 0}
end
return {0, tonumber(redis.call('GET', KEYS[2]) or '0')}`)

	// raiseScript lifts the key's counter to ARGV[1] if it is below: after
	// PostgreSQL refused a commit because it had seen a higher token, the
	// next grant gets a higher one.
	raiseScript = redis.NewScript(`
local last = tonumber(redis.call('GET', KEYS[1]) or '0')
if last < tonumber(ARGV[1]) then redis.call('SET', KEYS[1], ARGV[1]) end
return 0`)
)

// redisFenceSQL records the grant's token for key in the caller's
// transaction and locks the key's row until it ends. It returns a row only
// if no higher token has committed (or is committing: the row lock makes
// this wait for it, then re-checks) and no other owner committed with the
// same token. ON CONFLICT locks the row even when its WHERE refuses.
//
// Like the PostgreSQL fence, it bounds how long the transaction may then
// sit idle ($4 ms), here to the time left of the grant in Redis: a holder
// paused before its COMMIT is rolled back by the server, not committed
// after its lease lapsed.
const redisFenceSQL = `
INSERT INTO lock_fence AS f (key, token, owner) VALUES ($1, $2, $3)
ON CONFLICT (key) DO UPDATE SET token = GREATEST(f.token, EXCLUDED.token), owner = EXCLUDED.owner
 WHERE f.token < EXCLUDED.token OR (f.token = EXCLUDED.token AND f.owner = EXCLUDED.owner)
RETURNING set_config('idle_in_transaction_session_timeout', $4, true)`

// Redis is the shared lease provider over Redis. Leases live in Redis;
// fenced commits are checked in PostgreSQL against the lock_fence table
// (see docs/lock.md, "Redis provider").
type Redis struct {
	shared
	rdb     redis.UniversalClient
	prefix  string
	channel string
}

var _ Locker = (*Redis)(nil)

// NewRedis returns the Redis provider. instance names this replica in
// owner ids (a random part is appended); log may be nil. keyPrefix starts
// every key it writes ("" means DefaultRedisKeyPrefix), so deployments can
// share a Redis database. rdb should have ContextTimeoutEnabled, so that
// an acquire on a hung server is bounded like the PostgreSQL provider's.
// It subscribes to release notifications in the background; Close stops
// that (the client is the caller's to close). Leases keep working without
// it, through the fallback poll.
func NewRedis(rdb redis.UniversalClient, keyPrefix, instance string, log *slog.Logger, opts ...Option) (*Redis, error) {
	if rdb == nil {
		return nil, errors.New("lock: nil redis client")
	}
	if keyPrefix == "" {
		keyPrefix = DefaultRedisKeyPrefix
	}
	r := &Redis{rdb: rdb, prefix: keyPrefix, channel: keyPrefix + "released"}
	go r.listen(r.init(instance, log, opts))
	return r, nil
}

// Provider names the provider in metrics.
func (r *Redis) Provider() string { return "redis" }

// keys are the lease, the token counter and the awaited mark of key.
func (r *Redis) keys(key string) []string {
	lease := r.prefix + "{" + key + "}"
	return []string{lease, lease + ":token", lease + ":awaited"}
}

func grantValue(token int64, owner string) string {
	return strconv.FormatInt(token, 10) + " " + owner
}

// millis rounds ttl up to Redis's unit: the store's expiry must never come
// before the holder's own estimate, which counts the exact ttl.
func millis(ttl time.Duration) int64 {
	return int64((ttl + time.Millisecond - 1) / time.Millisecond)
}

// TryAcquire implements Locker.
func (r *Redis) TryAcquire(ctx context.Context, key string, wait, ttl time.Duration) (Lease, error) {
	return r.tryAcquire(ctx, key, wait, ttl, r, r.attempt)
}

func (r *Redis) attempt(ctx context.Context, key string, ttl time.Duration, deadline time.Time, willWait bool) (int64, time.Time, time.Duration, error) {
	// As for PostgreSQL, and with its one shared timer: a hung server
	// stretches the call by at most one script, capped at max(time left,
	// minStatementBudget).
	sctx, done := r.budgets.start(ctx, maxTime(deadline, time.Now().Add(minStatementBudget)))
	defer done()
	sent := r.opts.now()
	wait := "0"
	if willWait {
		wait = "1"
	}
	res, err := acquireScript.Run(sctx, r.rdb, r.keys(key), r.owner, millis(ttl), wait).Int64Slice()
	switch {
	case err != nil && ctx.Err() != nil:
		return 0, sent, 0, ctx.Err()
	case err != nil && errors.Is(context.Cause(sctx), errOverBudget):
		return 0, sent, 0, fmt.Errorf("lock: acquire %q: %w", key, errOverBudget)
	case err != nil:
		return 0, sent, 0, fmt.Errorf("lock: acquire %q: %w", key, err)
	case len(res) != 2:
		return 0, sent, 0, fmt.Errorf("lock: acquire %q: unexpected reply %v", key, res)
	case res[0] > 0:
		return res[0], sent, 0, nil
	case res[1] < 0:
		return 0, sent, -1, nil
	}
	return 0, sent, time.Duration(res[1]) * time.Millisecond, nil
}

func maxTime(a, b time.Time) time.Time {
	if a.After(b) {
		return a
	}
	return b
}

func (r *Redis) renew(ctx context.Context, key string, token int64, owner string, ttl time.Duration) (bool, error) {
	held, _, err := r.renewGrant(ctx, key, token, owner, ttl)
	return held, err
}

// renewGrant runs renewScript: held, or else the key's latest token.
func (r *Redis) renewGrant(ctx context.Context, key string, token int64, owner string, ttl time.Duration) (held bool, latest int64, err error) {
	res, err := renewScript.Run(ctx, r.rdb, r.keys(key), grantValue(token, owner), millis(ttl)).Int64Slice()
	if err != nil {
		return false, 0, err
	}
	if len(res) != 2 {
		return false, 0, fmt.Errorf("unexpected reply %v", res)
	}
	return res[0] == 1, res[1], nil
}

func (r *Redis) release(ctx context.Context, key string, token int64, owner string) (int64, bool, error) {
	res, err := releaseScript.Run(ctx, r.rdb, r.keys(key), grantValue(token, owner), r.channel, key).Int64Slice()
	switch {
	case err != nil:
		return 0, false, err
	case len(res) != 2:
		return 0, false, fmt.Errorf("unexpected reply %v", res)
	}
	return res[1], res[0] == 1, nil
}

// fence proves the grant in Redis and records its token in PostgreSQL, in
// tx. Redis cannot hold the lease for the length of a transaction, so the
// proof is bounded in time instead:
//
//  1. renewScript: the grant is still ours, and now runs for a full ttl
//     from sent (Redis's clock counts from when it ran, later still).
//  2. redisFenceSQL, sent with the grant's time left minus a margin as the
//     transaction's idle limit: no later grant has committed, and none can
//     until tx ends; and if tx is not committed before the grant lapses,
//     the server rolls it back. The margin (ttl/10) covers the round trip
//     of this statement, whose idle clock starts when it completes.
//  3. If the holder was paused during either step past that point, it
//     refuses rather than send a COMMIT that might land after the grant.
//
// The token check in 2 is what catches what Redis alone cannot: a lease
// lost in a failover or to an early expiry, where two holders think they
// hold the key; the later grant's commits win, the earlier's are refused.
func (r *Redis) fence(ctx context.Context, tx pgx.Tx, key string, token int64, owner string, ttl time.Duration) (int64, bool, error) {
	margin := ttl / 10
	sent := r.opts.now()
	held, latest, err := r.renewGrant(ctx, key, token, owner, ttl)
	if err != nil {
		return 0, false, err
	}
	if !held {
		return max(latest, token), false, nil
	}
	left := ttl - margin - r.opts.now().Sub(sent)
	if left <= 0 {
		return token, false, nil
	}
	var set string
	err = tx.QueryRow(ctx, redisFenceSQL, key, token, owner, strconv.FormatInt(max(left.Milliseconds(), 1), 10)).Scan(&set)
	if errors.Is(err, pgx.ErrNoRows) {
		return r.refused(ctx, tx, key, token)
	}
	if err != nil {
		return 0, false, err
	}
	if r.opts.now().Sub(sent) >= ttl-margin {
		return token, false, nil
	}
	return 0, true, nil
}

// refused reads the token that beat ours (tx rolls back anyway, and the
// row is locked, so this reads what refused us) and raises the key's
// counter in Redis above it: if Redis lost the counter, its next grant
// then commits again instead of being refused too.
func (r *Redis) refused(ctx context.Context, tx pgx.Tx, key string, token int64) (int64, bool, error) {
	var highest int64
	if err := tx.QueryRow(ctx, `SELECT token FROM lock_fence WHERE key = $1`, key).Scan(&highest); err != nil {
		return 0, false, err
	}
	if err := raiseScript.Run(ctx, r.rdb, r.keys(key)[1:2], strconv.FormatInt(highest, 10)).Err(); err != nil {
		r.log.Warn("lock could not raise the token counter in Redis after a refused commit",
			"key", key, "token", token, "highest_token", highest, "error", err)
	}
	return highest, false, nil
}

// listen subscribes to release notifications and wakes the local waiters
// of each released key. go-redis resubscribes by itself after a dropped
// connection; every (re)subscription wakes all waiters, in case a release
// went by unheard. A lost notification costs one poll interval, never
// correctness.
func (r *Redis) listen(ctx context.Context) {
	defer close(r.done)
	ps := r.rdb.Subscribe(ctx, r.channel)
	defer ps.Close()
	ch := ps.ChannelWithSubscriptions()
	for {
		select {
		case <-ctx.Done():
			return
		case m, ok := <-ch:
			if !ok {
				return
			}
			switch m := m.(type) {
			case *redis.Subscription:
				r.room.wakeAll()
			case *redis.Message:
				r.room.wake(m.Payload)
			}
		}
	}
}

// CheckFenceStore reports whether the Redis provider's fenced commits can
// work on pool: the lock_fence table exists, has the expected columns, and
// this role may read, insert and update it. It writes nothing, so startup
// can run it when migrations are off (a failure there means exit 72).
func CheckFenceStore(ctx context.Context, pool *pgxpool.Pool) error {
	var ok bool
	if err := pool.QueryRow(ctx, `SELECT to_regclass('lock_fence') IS NOT NULL`).Scan(&ok); err != nil {
		return fmt.Errorf("lock fence store: %w", err)
	}
	if !ok {
		return errors.New("lock fence store: table lock_fence is missing (apply the migrations)")
	}
	if _, err := pool.Exec(ctx, `SELECT key, token, owner FROM lock_fence LIMIT 0`); err != nil {
		return fmt.Errorf("lock fence store: lock_fence is not usable: %w", err)
	}
	err := pool.QueryRow(ctx, `SELECT has_table_privilege('lock_fence', 'SELECT')
	                              AND has_table_privilege('lock_fence', 'INSERT')
	                              AND has_table_privilege('lock_fence', 'UPDATE')`).Scan(&ok)
	if err != nil {
		return fmt.Errorf("lock fence store: %w", err)
	}
	if !ok {
		return errors.New("lock fence store: this role lacks SELECT/INSERT/UPDATE on lock_fence")
	}
	return nil
}
