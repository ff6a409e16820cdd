package inbox

import (
	"context"
	"encoding/json"
	"errors"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker/internal/obs"
)

// Consumer runs one inbox source's deliveries through the inbox: claim,
// work, settle. It is the source's Handoff. Process may be called from
// several goroutines at once (webhook requests); each call owns its batch.
type Consumer struct {
	name    string
	pool    *pgxpool.Pool
	handler Handler
	key     KeySpec
	cfg     Config
	owner   string
	log     *slog.Logger
	m       *Metrics
	health  *health

	// hard ends the work in progress: at the end of the shutdown budget.
	// A source's own context ending (shutdown begins) stops retries and
	// waits, but lets a transaction under way commit.
	hard context.Context

	// afterCommit, when set, runs after a work commit and before its
	// deliveries are settled: the failpoint the exactly-once test kills
	// the process at.
	afterCommit func(unacked int)
}

// NewConsumer returns the consumer of source src, claiming as owner (the
// instance id).
func NewConsumer(pool *pgxpool.Pool, src SourceConfig, cfg Config, h Handler, owner string, log *slog.Logger, m *Metrics) *Consumer {
	key, _ := ParseKey(src.Key) // Config.Validate checked it
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	log = log.With("inbox_source", src.Name)
	m.initSource(src.Name)
	return &Consumer{
		name: src.Name, pool: pool, handler: h, key: key, cfg: cfg, owner: owner, log: log, m: m,
		health:      newHealth(src.Name, log, m),
		hard:        context.Background(),
		afterCommit: failpointAfterCommit(),
	}
}

// Up reports the source connected.
func (c *Consumer) Up() { c.health.up() }

// Down reports the source unreachable; nothing is counted against its
// messages.
func (c *Consumer) Down(err error) { c.health.down(err) }

// claim is one message this Process call holds: RECEIVED, PROCESSING or
// FAILED under the call's token.
type claim struct {
	d        *Delivery
	attempts int // failed tries so far
	twins    []*Delivery
	decided  bool // its source was told a final outcome: not Busy
}

// batchState is one Process call: its token, and its deliveries' fates.
type batchState struct {
	c       *Consumer
	token   int64
	started time.Time
}

// Process claims, works and settles batch. It returns when every delivery
// is settled, or when ctx ends (the rest come again from the source).
func (c *Consumer) Process(ctx context.Context, batch []*Delivery) {
	work, cancel := context.WithCancel(context.WithoutCancel(ctx))
	defer cancel()
	defer context.AfterFunc(c.hard, cancel)()
	b := &batchState{c: c, started: time.Now()}
	for _, d := range batch {
		d.Message.Consumer = c.name
		switch {
		case d.Invalid != nil:
		case d.Message.ID == "" && c.key == (KeySpec{}) && d.NativeID != "":
			d.Message.ID = d.NativeID
		default:
			d.Invalid = c.key.Apply(&d.Message)
		}
	}
	claims, err := b.receive(work, batch)
	if err != nil {
		c.databaseTrouble(err)
		for _, d := range batch {
			b.settle(work, d, Unavailable, c.cfg.BackoffBase)
		}
		return
	}
	// Claims still held when Process returns early (shutdown, a database
	// that did not come back in time) are let go: their work rolled back,
	// so the next delivery may take them over instead of finding an
	// expired processing lease.
	defer func() { b.letGo(claims) }()
	failures := 0
	fresh := true // claims from receive are PROCESSING already
	for len(claims) > 0 && ctx.Err() == nil {
		next, wait, err := b.round(work, claims, fresh)
		fresh = false
		if err != nil {
			// The database, not the messages: their work rolled back, and
			// no attempt is spent. Retry while the claim could still be ours.
			c.databaseTrouble(err)
			failures++
			wait = obs.FullJitter(c.cfg.BackoffBase, c.cfg.BackoffMax, failures)
			if time.Since(b.started)+wait > c.cfg.LeaseTTL*2/3 {
				for _, cl := range claims {
					b.settleClaim(work, cl, Unavailable, c.cfg.BackoffBase)
				}
				return
			}
			next = claims
		}
		claims = next
		if len(claims) > 0 && !obs.Sleep(ctx, wait) {
			return
		}
	}
}

// receive claims the batch's messages (new keys in one statement, the rest
// in one transaction) and settles, once that commits, the deliveries it
// decided: duplicates, dead letters, busy ones and those now waiting for
// an operator. It returns the rest, claimed and PROCESSING, in the
// source's order.
func (b *batchState) receive(ctx context.Context, batch []*Delivery) ([]*claim, error) {
	c := b.c
	// One claim per key: a key twice in one batch (the relay published it
	// twice) is settled like its first delivery.
	byKey := map[[2]string]*claim{}
	var claims []*claim
	var valid, invalid []*Delivery
	for _, d := range batch {
		if first, ok := byKey[d.keyPair()]; ok {
			first.twins = append(first.twins, d)
			continue
		}
		cl := &claim{d: d}
		byKey[d.keyPair()] = cl
		claims = append(claims, cl)
		if d.Invalid != nil {
			invalid = append(invalid, d)
		} else {
			valid = append(valid, d)
		}
	}

	type decided struct {
		cl      *claim
		outcome Outcome
		after   time.Duration
	}
	var settled []decided
	owned := map[*claim]bool{}
	var recovered []string

	// New keys, the usual case, are claimed by one statement of its own.
	inserted := map[[2]string]bool{}
	if len(valid) > 0 {
		s, i := keyArrays(valid)
		ok, ty, og, h, body := make([]string, len(valid)), make([]string, len(valid)), make([]string, len(valid)), make([]json.RawMessage, len(valid)), make([][]byte, len(valid))
		for n, d := range valid {
			ok[n], ty[n], og[n], h[n], body[n] = d.Message.OrderKey, d.Message.Type, d.Message.Origin, headersJSON(d.Message.Headers), d.Message.Body
		}
		tokens, err := collectKeyed[int64](c.pool.Query(ctx, insertClaimed, c.name, s, i, c.owner, c.cfg.LeaseTTL, ok, ty, og, h, body))
		if err != nil {
			return nil, err
		}
		for k, token := range tokens {
			inserted[k], b.token = true, token // one token for the statement
		}
	}
	for _, cl := range claims {
		if inserted[cl.d.keyPair()] {
			owned[cl] = true
		}
	}
	if len(owned) == len(claims) {
		return claims, nil
	}

	// The rest (dead letters, keys seen before) in a transaction.
	err := pgx.BeginFunc(ctx, c.pool, func(tx pgx.Tx) error {
		if b.token == 0 {
			if err := tx.QueryRow(ctx, `SELECT nextval('inbox_lease_token_seq')`).Scan(&b.token); err != nil {
				return err
			}
		}
		if len(invalid) > 0 {
			s, i := keyArrays(invalid)
			e, og, h, body := make([]string, len(invalid)), make([]string, len(invalid)), make([]json.RawMessage, len(invalid)), make([][]byte, len(invalid))
			for n, d := range invalid {
				e[n], og[n], h[n], body[n] = d.Invalid.Error(), d.Message.Origin, headersJSON(d.Message.Headers), d.Message.Body
			}
			dead, err := collectKeyed[struct{}](tx.Query(ctx, insertDead, c.name, s, i, e, og, h, body))
			if err != nil {
				return err
			}
			for k := range dead {
				inserted[k] = true
			}
		}
		var existing []*claim
		for _, cl := range claims {
			switch {
			case !inserted[cl.d.keyPair()]:
				existing = append(existing, cl)
			case cl.d.Invalid != nil:
				settled = append(settled, decided{cl, Dead, 0})
			}
		}
		if len(existing) == 0 {
			return nil
		}
		s, i := keyArrays(claimDeliveries(existing))
		rows, err := tx.Query(ctx, lockExisting, c.name, s, i)
		if err != nil {
			return err
		}
		type row struct {
			state   string
			expired bool
			left    float64
		}
		found := map[[2]string]row{}
		for rows.Next() {
			var k [2]string
			var r row
			var owner string
			var token int64
			if err := rows.Scan(&k[0], &k[1], &r.state, &owner, &token, &r.expired, &r.left); err != nil {
				rows.Close()
				return err
			}
			found[k] = r
		}
		if err := rows.Err(); err != nil {
			return err
		}
		var takeover, recover []*claim
		for _, cl := range existing {
			r, ok := found[cl.d.keyPair()]
			switch {
			case !ok: // its work is committing elsewhere now
				settled = append(settled, decided{cl, Busy, time.Second})
			case r.state == "PROCESSED" || r.state == "RESOLVED" || r.state == "DEAD" || r.state == "RECOVERY_REQUIRED":
				settled = append(settled, decided{cl, Duplicate, 0})
			case !r.expired:
				settled = append(settled, decided{cl, Busy, time.Duration(r.left*float64(time.Second)) + time.Second})
			case r.state == "PROCESSING":
				recover = append(recover, cl)
			default:
				takeover = append(takeover, cl)
			}
		}
		if len(takeover) > 0 {
			s, i := keyArrays(claimDeliveries(takeover))
			got, err := collectKeyed[int](tx.Query(ctx, takeOver, c.name, s, i, c.owner, b.token, c.cfg.LeaseTTL))
			if err != nil {
				return err
			}
			for _, cl := range takeover {
				if attempts, ok := got[cl.d.keyPair()]; ok {
					cl.attempts = attempts
					owned[cl] = true
				} else {
					settled = append(settled, decided{cl, Busy, time.Second})
				}
			}
		}
		if len(recover) > 0 {
			s, i := keyArrays(claimDeliveries(recover))
			reasons, err := collectKeyed[string](tx.Query(ctx, toRecovery, c.name, s, i))
			if err != nil {
				return err
			}
			for k, reason := range reasons {
				recovered = append(recovered, k[0]+"/"+k[1]+": "+reason)
			}
			for _, cl := range recover {
				settled = append(settled, decided{cl, Duplicate, 0})
			}
		}
		// A message behind a busy one of its order key must wait with it,
		// or it would overtake it. Its claim is let go at once, so that
		// its next delivery, here or elsewhere, takes it over.
		busyKeys := map[string]bool{}
		for _, d := range settled {
			if d.outcome == Busy && d.cl.d.Message.OrderKey != "" {
				busyKeys[d.cl.d.Message.OrderKey] = true
			}
		}
		var behind []*claim
		for _, cl := range claims {
			if owned[cl] && busyKeys[cl.d.Message.OrderKey] {
				behind = append(behind, cl)
				delete(owned, cl)
				settled = append(settled, decided{cl, Busy, time.Second})
			}
		}
		if len(behind) > 0 {
			s, i := keyArrays(claimDeliveries(behind))
			if _, err := tx.Exec(ctx, release, c.name, s, i, c.owner, b.token, time.Duration(0)); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		var mine []*claim
		for _, cl := range claims {
			if inserted[cl.d.keyPair()] && cl.d.Invalid == nil {
				mine = append(mine, cl)
			}
		}
		b.letGo(mine)
		return nil, err
	}
	for _, r := range recovered {
		c.log.Error("inbox message needs an operator: its processing lease expired before its work committed; it is not retried blindly (worker inbox recovery list)",
			"error.code", obs.CodeJobDeadLetter, "message", r)
	}
	if len(recovered) > 0 {
		c.m.recoveryFound.WithLabelValues(c.name).Add(float64(len(recovered)))
	}
	for _, s := range settled {
		if s.outcome == Dead {
			b.deadLettered(s.cl, s.cl.d.Invalid.Error())
		}
		b.settleClaim(ctx, s.cl, s.outcome, s.after)
	}
	var out []*claim
	for _, cl := range claims {
		if owned[cl] {
			out = append(out, cl)
		}
	}
	return out, nil
}

// letGo releases claims this call still holds without a final outcome:
// back to RECEIVED, the lease ended, no attempt spent. A row whose work
// did commit (a commit whose answer was lost) is PROCESSED and untouched.
func (b *batchState) letGo(claims []*claim) {
	var held []*claim
	for _, cl := range claims {
		if !cl.decided {
			held = append(held, cl)
		}
	}
	if len(held) == 0 {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Second)
	defer cancel()
	s, i := keyArrays(claimDeliveries(held))
	if _, err := b.c.pool.Exec(ctx, release, b.c.name, s, i, b.c.owner, b.token, time.Duration(0)); err != nil {
		b.c.log.Warn("inbox could not let go of its claims; they are taken over when their lease expires", "error", err)
	}
}

// collectKeyed maps the rows of a statement, (msg_source, msg_id, value),
// by key: the inbox's statements return their keys, so the caller learns
// which rows its compare-and-set matched. Its arguments are a Query's
// results; a T of struct{} reads the keys alone.
func collectKeyed[T any](rows pgx.Rows, err error) (map[[2]string]T, error) {
	if err != nil {
		return nil, err
	}
	out := map[[2]string]T{}
	var k [2]string
	var v T
	dest := []any{&k[0], &k[1]}
	if _, keysOnly := any(v).(struct{}); !keysOnly {
		dest = append(dest, &v)
	}
	_, err = pgx.ForEachRow(rows, dest, func() error {
		out[k] = v
		return nil
	})
	return out, err
}

func claimDeliveries(cls []*claim) []*Delivery {
	ds := make([]*Delivery, len(cls))
	for n, cl := range cls {
		ds[n] = cl.d
	}
	return ds
}

func keyArrays(ds []*Delivery) (sources, ids []string) {
	sources, ids = make([]string, len(ds)), make([]string, len(ds))
	for n, d := range ds {
		sources[n], ids[n] = d.key()
	}
	return sources, ids
}

func headersJSON(h map[string]string) json.RawMessage {
	if len(h) == 0 {
		return json.RawMessage(`{}`)
	}
	b, _ := json.Marshal(h) // a map of strings always marshals
	return b
}

// settleClaim settles a claim's delivery and its twins. A twin of a
// message processed now is a duplicate.
func (b *batchState) settleClaim(ctx context.Context, cl *claim, o Outcome, after time.Duration) {
	cl.decided = o.Final()
	b.settle(ctx, cl.d, o, after)
	if o == Processed {
		o = Duplicate
	}
	for _, t := range cl.twins {
		b.settle(ctx, t, o, after)
	}
}

// settle tells the source, and counts.
func (b *batchState) settle(ctx context.Context, d *Delivery, o Outcome, after time.Duration) {
	c := b.c
	if o.Final() {
		c.m.received.WithLabelValues(c.name, string(o)).Inc()
	}
	if o == Processed {
		c.m.latency.WithLabelValues(c.name).Observe(time.Since(b.started).Seconds())
	}
	if d.Settle == nil {
		return
	}
	// A failed ack is the source's trouble: the message comes again, and
	// is then a duplicate.
	if err := d.Settle(context.WithoutCancel(ctx), o, after); err != nil {
		c.log.Warn("inbox could not settle a delivery with its source; it will come again and be a duplicate",
			"event_id", d.Message.ID, "outcome", string(o), "error", err)
	}
}

func (b *batchState) deadLettered(cl *claim, reason string) {
	b.c.m.shared.DLQ.WithLabelValues(JobName(b.c.name)).Inc()
	b.c.log.Error("inbox message dead-lettered", "error.code", obs.CodeJobDeadLetter,
		"event_id", cl.d.Message.ID, "msg_source", cl.d.Message.Source, "reason", reason)
}

// databaseTrouble logs a failed inbox transaction: not the messages'
// failure, and no attempt is spent.
func (c *Consumer) databaseTrouble(err error) {
	c.m.dbErrors.WithLabelValues(c.name).Inc()
	c.log.Warn("inbox transaction failed; its messages wait with their attempts untouched", "error", err)
}

// errLost is returned by a work transaction that found some of its claims
// taken: it rolls back and runs again without them.
var errLost = errors.New("inbox claim lost")
