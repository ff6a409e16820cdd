package inbox

import (
	"context"
	"encoding/json"
	"errors"
	"hash/fnv"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker/internal/inbox/inboxconfig"
	"github.com/worker-dev/worker/internal/obs"
)

// Consumer runs one inbox source's deliveries through the inbox: claim,
// work, settle. It is the source's Handoff. Process may be called from
// several goroutines at once (webhook requests); each call owns its batch.
type Consumer struct {
	name    string
	kind    string // the source's kind: nats, rabbitmq, kafka, webhook
	pool    *pgxpool.Pool
	handler Handler
	key     inboxconfig.KeySpec
	cfg     inboxconfig.Config
	owner   string
	log     *slog.Logger
	m       *Metrics
	health  *health
	// external is set for a handler declared to act outside the work
	// transaction (inbox.sources[].effects: external): its claim commits
	// before its work, so that a crash mid-work is found and handed to an
	// operator. Otherwise the claim, the work and PROCESSED commit in one
	// transaction, and a crash simply rolls all of it back.
	external bool
	// lanes is inbox.sources[].concurrency: the most transactions a batch
	// is worked in at once.
	lanes int

	// hard ends the work in progress: at the end of the shutdown budget.
	// A source's own context ending (shutdown begins) stops retries and
	// waits, but lets a transaction under way commit.
	hard context.Context

	// afterCommit, when set, runs after a work commit and before its
	// deliveries are settled: the failpoint the exactly-once test kills
	// the process at.
	afterCommit func(unacked int)
	// inWork, when set, runs in a work transaction after its handlers and
	// before its commit: the failpoint the crash tests kill the process at.
	inWork func(messages int)
}

// NewConsumer returns the consumer of source src, claiming as owner (the
// instance id).
func NewConsumer(pool *pgxpool.Pool, src inboxconfig.SourceConfig, cfg inboxconfig.Config, h Handler, owner string, log *slog.Logger, m *Metrics) *Consumer {
	key, _ := inboxconfig.ParseKey(src.Key) // inboxconfig.Config.Validate checked it
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	log = log.With("inbox_source", src.Name)
	m.initSource(src.Name)
	return &Consumer{
		name: src.Name, kind: src.Kind, pool: pool, handler: h, key: key, cfg: cfg, owner: owner, log: log, m: m,
		health:      newHealth(src.Name, log, m),
		external:    src.Effects == inboxconfig.EffectsExternal,
		lanes:       max(src.Concurrency, 1),
		hard:        context.Background(),
		afterCommit: failpointAfterCommit(),
		inWork:      failpointInWork(),
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
	decided  bool   // its source was told a final outcome: not Busy or Unavailable
	found    string // for a Duplicate, the state its row was found in
	// written: the round's claim wrote its row PROCESSED already
	// (insertProcessed); its work commits with that row or rolls back.
	written bool
}

// batchState is one lane of a Process call: its token, and its
// deliveries' fates.
type batchState struct {
	c       *Consumer
	token   int64
	started time.Time
}

// Process claims, works and settles batch. It returns when every delivery
// is settled, or when ctx ends (the rest come again from the source).
func (c *Consumer) Process(ctx context.Context, batch []*Delivery) {
	for _, d := range batch {
		c.prepare(d)
	}
	lanes := c.split(batch)
	if len(lanes) == 1 {
		c.processLane(ctx, lanes[0])
		return
	}
	var wg sync.WaitGroup
	for _, lane := range lanes {
		wg.Go(func() { c.processLane(ctx, lane) })
	}
	wg.Wait()
}

// prepare gives d its dedupe key, or the reason it cannot be processed:
// no key, or text the database cannot store (which is made storable, so
// that the dead letter itself can be written).
func (c *Consumer) prepare(d *Delivery) {
	d.Message.Consumer = c.name
	switch {
	case d.Invalid != nil:
	case d.Message.ID == "" && c.key == (inboxconfig.KeySpec{}) && d.NativeID != "":
		d.Message.ID = d.NativeID
	default:
		d.Invalid = ApplyKey(c.key, &d.Message)
	}
	if err := checkStorable(&d.Message); err != nil {
		if d.Invalid == nil {
			d.Invalid = err
		}
		makeStorable(&d.Message)
		c.m.unstorable.WithLabelValues(c.name).Inc()
	}
}

// laneMin is the fewest messages a lane is given: a lane costs a
// transaction, which a handful of messages does not repay.
const laneMin = 16

// split divides batch into lanes by a hash of the order key (of the dedupe
// key when it has none), each in the source's order: the messages of one
// order key share a lane, so they never run at once or out of order. The
// lanes of one Process call end before the next call's begin.
func (c *Consumer) split(batch []*Delivery) [][]*Delivery {
	n := min(c.lanes, len(batch)/laneMin)
	if n <= 1 {
		return [][]*Delivery{batch}
	}
	lanes := make([][]*Delivery, n)
	for _, d := range batch {
		h := fnv.New32a()
		if d.Message.OrderKey != "" {
			h.Write([]byte(d.Message.OrderKey))
		} else {
			s, i := d.key()
			h.Write([]byte(s + "\x00" + i))
		}
		l := h.Sum32() % uint32(n)
		lanes[l] = append(lanes[l], d)
	}
	out := lanes[:0]
	for _, l := range lanes {
		if len(l) > 0 {
			out = append(out, l)
		}
	}
	return out
}

// roundKind says what a work transaction does before its handlers.
type roundKind int

const (
	// claimInWork: claim the messages in the work transaction itself (a
	// transactional handler's first round).
	claimInWork roundKind = iota
	// claimed: the claims committed PROCESSING already (an external
	// handler's first round).
	claimed
	// retry: the claims are held, FAILED after a failed round.
	retry
)

// processLane claims, works and settles one lane of a batch.
func (c *Consumer) processLane(ctx context.Context, batch []*Delivery) {
	work, cancel := context.WithCancel(context.WithoutCancel(ctx))
	defer cancel()
	defer context.AfterFunc(c.hard, cancel)()
	b := &batchState{c: c, started: time.Now()}
	claims := group(batch)
	kind := claimInWork
	if c.external {
		var err error
		if claims, err = b.receive(work, claims); err != nil {
			c.databaseTrouble(err)
			for _, d := range batch {
				b.settle(work, d, Unavailable, c.cfg.BackoffBase)
			}
			return
		}
		kind = claimed
	}
	// Claims still held when Process returns early (shutdown, a database
	// that did not come back in time) are let go: their work rolled back,
	// so the next delivery may take them over instead of finding an
	// expired processing lease.
	defer func() { b.letGo(claims) }()
	failures := 0
	for len(claims) > 0 && ctx.Err() == nil {
		next, wait, err := b.round(work, claims, kind)
		if err == nil || kind == claimed {
			// A claim in the work transaction rolled back with it: the
			// next round claims again.
			kind = retry
		}
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

// group makes a claim of each key of batch, in the source's order: a key
// twice in one batch (the relay published it twice) is settled like its
// first delivery.
func group(batch []*Delivery) []*claim {
	byKey := map[[2]string]*claim{}
	var claims []*claim
	for _, d := range batch {
		if first, ok := byKey[d.keyPair()]; ok {
			first.twins = append(first.twins, d)
			continue
		}
		cl := &claim{d: d}
		byKey[d.keyPair()] = cl
		claims = append(claims, cl)
	}
	return claims
}

// decided is a delivery whose fate a claim decided: settled once the
// claim commits.
type decided struct {
	cl      *claim
	outcome Outcome
	after   time.Duration
}

// intake is what a claim decided: the claims to work now, in the source's
// order, and the deliveries to settle once it commits.
type intake struct {
	run       []*claim
	settled   []decided
	recovered []string // expired processing leases handed to an operator
}

// receive claims an external handler's messages in a commit of their own,
// before their work, and settles what it decided. It returns the claims
// to work, PROCESSING.
func (b *batchState) receive(ctx context.Context, claims []*claim) ([]*claim, error) {
	var in intake
	err := pgx.BeginFunc(ctx, b.c.pool, func(tx pgx.Tx) error {
		var err error
		in, err = b.claimIn(ctx, tx, claims, false)
		return err
	})
	if err != nil {
		return nil, err
	}
	b.afterClaim(ctx, in)
	return in.run, nil
}

// claimIn claims the messages of claims in tx: new keys inserted
// PROCESSING, or PROCESSED already when processed says the work commits
// in tx or not at all, and the rest (dead letters, keys seen before)
// looked at. It draws the transaction's token and bounds it on the server
// first.
func (b *batchState) claimIn(ctx context.Context, tx pgx.Tx, claims []*claim, processed bool) (in intake, err error) {
	c := b.c
	var valid, invalid []*Delivery
	for _, cl := range claims {
		cl.written = false
		if cl.d.Invalid != nil {
			invalid = append(invalid, cl.d)
		} else {
			valid = append(valid, cl.d)
		}
	}
	batch := &pgx.Batch{}
	batch.Queue(claimToken, b.bounds(ctx)...)
	if len(valid) > 0 {
		s, i := keyArrays(valid)
		ok, ty, og := make([]string, len(valid)), make([]string, len(valid)), make([]string, len(valid))
		for n, d := range valid {
			ok[n], ty[n], og[n] = d.Message.OrderKey, d.Message.Type, d.Message.Origin
		}
		if processed {
			batch.Queue(insertProcessed, c.name, s, i, ok, ty, og)
		} else {
			h, body := storedBodies(valid)
			batch.Queue(insertClaimed, c.name, s, i, c.owner, c.cfg.LeaseTTL, ok, ty, og, h, body)
		}
	}
	if len(invalid) > 0 {
		s, i := keyArrays(invalid)
		e, og := make([]string, len(invalid)), make([]string, len(invalid))
		for n, d := range invalid {
			e[n], og[n] = d.Invalid.Error(), d.Message.Origin
		}
		h, body := storedBodies(invalid)
		batch.Queue(insertDead, c.name, s, i, e, og, h, body)
	}
	inserted := map[[2]string]bool{}
	err = func() error {
		br := tx.SendBatch(ctx, batch)
		defer br.Close()
		if err := br.QueryRow().Scan(&b.token, nil, nil); err != nil {
			return err
		}
		for range len(batch.QueuedQueries) - 1 {
			got, err := collectKeyed[struct{}](br.Query())
			if err != nil {
				return err
			}
			for k := range got {
				inserted[k] = true
			}
		}
		return br.Close()
	}()
	if err != nil {
		return intake{}, err
	}

	owned := map[*claim]bool{}
	var existing []*claim
	for _, cl := range claims {
		switch {
		case !inserted[cl.d.keyPair()]:
			existing = append(existing, cl)
		case cl.d.Invalid != nil:
			in.settled = append(in.settled, decided{cl, Dead, 0})
		default:
			owned[cl] = true
			cl.written = processed
		}
	}
	if len(existing) > 0 {
		if err := b.claimExisting(ctx, tx, existing, owned, &in); err != nil {
			return intake{}, err
		}
	}
	// A message behind a busy one of its order key must wait with it,
	// or it would overtake it. Its claim is let go at once, so that
	// its next delivery, here or elsewhere, takes it over.
	busyKeys := map[string]bool{}
	for _, d := range in.settled {
		if d.outcome == Busy && d.cl.d.Message.OrderKey != "" {
			busyKeys[d.cl.d.Message.OrderKey] = true
		}
	}
	var behind, behindWritten []*Delivery
	for _, cl := range claims {
		if owned[cl] && busyKeys[cl.d.Message.OrderKey] {
			if cl.written {
				behindWritten = append(behindWritten, cl.d)
				cl.written = false
			} else {
				behind = append(behind, cl.d)
			}
			delete(owned, cl)
			in.settled = append(in.settled, decided{cl, Busy, time.Second})
		}
	}
	if len(behind) > 0 {
		s, i := keyArrays(behind)
		if _, err := tx.Exec(ctx, release, c.name, s, i, c.owner, b.token, time.Duration(0)); err != nil {
			return intake{}, err
		}
	}
	if len(behindWritten) > 0 {
		s, i := keyArrays(behindWritten)
		h, body := storedBodies(behindWritten)
		if _, err := tx.Exec(ctx, unprocess, c.name, s, i, c.owner, b.token, h, body); err != nil {
			return intake{}, err
		}
	}
	for _, cl := range claims {
		if owned[cl] {
			in.run = append(in.run, cl)
		}
	}
	return in, nil
}

// claimExisting looks at the rows of keys seen before: done ones are
// duplicates, live claims elsewhere are busy, expired ones are taken over
// (their work never started or rolled back) or handed to an operator
// (their work was running, with effects outside the database).
func (b *batchState) claimExisting(ctx context.Context, tx pgx.Tx, existing []*claim, owned map[*claim]bool, in *intake) error {
	c := b.c
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
			in.settled = append(in.settled, decided{cl, Busy, time.Second})
		case r.state == StateProcessed || r.state == StateResolved || r.state == StateDead || r.state == StateRecoveryRequired:
			cl.found = r.state
			in.settled = append(in.settled, decided{cl, Duplicate, 0})
		case !r.expired:
			in.settled = append(in.settled, decided{cl, Busy, time.Duration(r.left*float64(time.Second)) + time.Second})
		case r.state == StateProcessing:
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
				in.settled = append(in.settled, decided{cl, Busy, time.Second})
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
			in.recovered = append(in.recovered, k[0]+"/"+k[1]+": "+reason)
		}
		for _, cl := range recover {
			cl.found = StateRecoveryRequired
			in.settled = append(in.settled, decided{cl, Duplicate, 0})
		}
	}
	return nil
}

// afterClaim reports and settles, once its claim committed, what a claim
// decided.
func (b *batchState) afterClaim(ctx context.Context, in intake) {
	c := b.c
	for _, r := range in.recovered {
		c.log.Error("inbox message needs an operator: its processing lease expired before its work committed; it is not retried blindly (worker inbox recovery list)",
			"error.code", obs.CodeJobDeadLetter, "message", r)
	}
	if len(in.recovered) > 0 {
		c.m.recoveryFound.WithLabelValues(c.name).Add(float64(len(in.recovered)))
	}
	for _, s := range in.settled {
		if s.outcome == Dead {
			b.deadLettered(s.cl, s.cl.d.Invalid.Error())
		}
		b.settleClaim(ctx, s.cl, s.outcome, s.after)
	}
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

// storedBodies are the headers and bodies of ds as their rows keep them,
// for a retry or an operator.
func storedBodies(ds []*Delivery) (headers []json.RawMessage, bodies [][]byte) {
	headers, bodies = make([]json.RawMessage, len(ds)), make([][]byte, len(ds))
	for n, d := range ds {
		headers[n], bodies[n] = headersJSON(d.Message.Headers), d.Message.Body
	}
	return headers, bodies
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
	cl.d.Found = cl.found
	b.settle(ctx, cl.d, o, after)
	found := cl.found
	if o == Processed {
		o, found = Duplicate, StateProcessed
	}
	for _, t := range cl.twins {
		t.Found = found
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
