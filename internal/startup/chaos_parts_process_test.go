package startup_test

// The parts of TestChaos: the webhook receiver, the producer, the malformed
// rows, the sql job's tables, and the checks.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"net/http/httptest"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"testing"
	"time"
	"unicode"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker/internal/pgtest"
)

// receiver is the webhook endpoint. For producer events (ce-source chaos)
// it records each event's first delivery and, per aggregate, the order of
// first deliveries; other events are recorded by ce-id.
type receiver struct {
	url  string
	down atomic.Bool // answer 503 to everything: the sink is unavailable

	mu              sync.Mutex
	eventID         map[int]string    // by event number (see producer)
	firstAt         map[int]time.Time // by event number
	order           [chaosAggregates][]int
	chaosDeliveries int
	others          map[string]string // ce-id -> ce-time of events not from the producer
	invalid         []string          // what arrived in a form the contract does not allow
}

func newReceiver(t *testing.T) *receiver {
	r := &receiver{eventID: map[int]string{}, firstAt: map[int]time.Time{}, others: map[string]string{}}
	srv := httptest.NewServer(r)
	t.Cleanup(srv.Close) // registered before the workers start, so it runs after they are killed
	r.url = srv.URL
	return r
}

// receiverLatency is how long the receiver takes to answer, as a real
// endpoint would: it keeps the relays busy, so faults land on batches in
// flight.
const receiverLatency = 10 * time.Millisecond

func (r *receiver) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	if r.down.Load() {
		http.Error(w, "receiver down for maintenance", http.StatusServiceUnavailable)
		return
	}
	arrived := time.Now()
	time.Sleep(receiverLatency)
	body, err := io.ReadAll(req.Body)
	if err != nil {
		w.WriteHeader(http.StatusServiceUnavailable) // transient: the relay sends it again
		return
	}
	r.record(arrived, req.Header, body)
	// Answered once recorded: the relay sends an aggregate's next event only
	// after this answer, so first deliveries are recorded in the order sent.
	w.WriteHeader(http.StatusNoContent)
}

func (r *receiver) record(arrived time.Time, h http.Header, body []byte) {
	id, ceTime := h.Get("Ce-Id"), h.Get("Ce-Time")
	r.mu.Lock()
	defer r.mu.Unlock()
	if _, err := time.Parse(time.RFC3339Nano, ceTime); ceTime != "" && err != nil {
		r.invalid = append(r.invalid, fmt.Sprintf("event %s: ce-time %q is not RFC 3339", id, ceTime))
	}
	if h.Get("Ce-Source") != "chaos" {
		r.others[id] = ceTime
		return
	}
	var ev struct {
		A int `json:"a"`
		N int `json:"n"`
	}
	if json.Unmarshal(body, &ev) != nil || ev.A < 0 || ev.A >= chaosAggregates || ev.N < 0 {
		r.invalid = append(r.invalid, fmt.Sprintf("event %s: payload %q", id, body))
		return
	}
	r.chaosDeliveries++
	g := ev.N*chaosAggregates + ev.A
	switch first, seen := r.eventID[g]; {
	case !seen:
		r.eventID[g], r.firstAt[g] = id, arrived
		r.order[ev.A] = append(r.order[ev.A], ev.N)
	case first != id:
		r.invalid = append(r.invalid, fmt.Sprintf("agg-%d event %d arrived as event_id %s and %s", ev.A, ev.N, first, id))
	}
}

// firstCount is how many producer events have arrived at least once.
func (r *receiver) firstCount() int {
	r.mu.Lock()
	defer r.mu.Unlock()
	return len(r.eventID)
}

// other returns the ce-time of a non-producer event, and whether it arrived.
func (r *receiver) other(eventID string) (ceTime string, ok bool) {
	r.mu.Lock()
	defer r.mu.Unlock()
	ceTime, ok = r.others[eventID]
	return ceTime, ok
}

// producer inserts total events at chaosRate a second, producerStatement
// per INSERT, each its own transaction. Event number g is event g/100 of
// aggregate agg-(g%100), with payload {"a": g%100, "n": g/100}.
type producer struct {
	total     int
	committed atomic.Int64 // events 0..committed-1 are committed
	at        []time.Time  // commit time of each event; read after done
	err       error        // set before done closes
	done      chan struct{}
}

const producerStatement = 20

func startProducer(t *testing.T, pool *pgxpool.Pool, total int) *producer {
	p := &producer{total: total, at: make([]time.Time, total), done: make(chan struct{})}
	ctx, cancel := context.WithCancel(context.Background())
	go func() {
		defer close(p.done)
		p.err = p.run(ctx, pool)
	}()
	t.Cleanup(func() { cancel(); <-p.done })
	return p
}

func (p *producer) run(ctx context.Context, pool *pgxpool.Pool) error {
	pace := time.NewTicker(time.Second * producerStatement / chaosRate)
	defer pace.Stop()
	for g := 0; g < p.total; {
		n := min(producerStatement, p.total-g)
		aggs, seqs := make([]int32, n), make([]int32, n)
		for i := range n {
			aggs[i], seqs[i] = int32((g+i)%chaosAggregates), int32((g+i)/chaosAggregates)
		}
		_, err := pool.Exec(ctx, `INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
			SELECT 'chaos', 'agg-' || a, 'chaos.tick', jsonb_build_object('a', a, 'n', n)
			FROM unnest($1::int[], $2::int[]) AS e(a, n)`, aggs, seqs)
		if err != nil {
			return fmt.Errorf("producer: insert events %d to %d: %w", g, g+n-1, err)
		}
		for i := range n {
			p.at[g+i] = time.Now()
		}
		g += n
		p.committed.Store(int64(g))
		if g == p.total {
			return nil
		}
		select {
		case <-ctx.Done():
			return nil
		case <-pace.C:
		}
	}
	return nil
}

func (p *producer) finished() bool { return p.committed.Load() == int64(p.total) }

// malformed is a row of issue 9, section 2: column set to value (SQL).
type malformed struct {
	what, column, value string
	// unsendable: in the table, the row must go DEAD, because the relay
	// cannot read it or CloudEvents requires the attribute. The others may
	// also be published, in a valid form.
	unsendable bool
}

var malformedRows = []malformed{
	{"occurred_at infinity", "occurred_at", "'infinity'", true},
	{"occurred_at -infinity", "occurred_at", "'-infinity'", true},
	{"occurred_at 4000 BC", "occurred_at", "'4000-01-01 00:00:00+00 BC'", false},
	{"empty aggregate_type", "aggregate_type", "''", true},
	{"empty aggregate_id", "aggregate_id", "''", false},
	{"empty event_type", "event_type", "''", true},
	{"non-string header values", "headers", `'{"x":{"a":"b"},"n":5,"z":null}'`, false},
	{"control characters in event_type", "event_type", `E'order.paid\n\x1b[31m'`, false},
	{"control characters in aggregate_type", "aggregate_type", `E'order\x07'`, false},
}

// tooLong is an aggregate_id of 10,000 characters that do not compress:
// without a length rule, the index refuses it ("index row requires ...").
var tooLong = malformed{what: "10,000-character aggregate_id", column: "aggregate_id",
	value: `left((SELECT string_agg(md5(i::text), '') FROM generate_series(1, 313) i), 10000)`}

// producerInsert is the producer contract's INSERT of a valid event of
// aggregate bad/id, with m applied.
func producerInsert(m malformed, id string) string {
	cols := map[string]string{"aggregate_type": "'bad'", "aggregate_id": "'" + id + "'", "event_type": "'bad.row'", "payload": "'{}'"}
	if m.column != "" {
		cols[m.column] = m.value
	}
	names := slices.Sorted(maps.Keys(cols))
	values := make([]string, len(names))
	for i, n := range names {
		values[i] = cols[n]
	}
	return fmt.Sprintf("INSERT INTO outbox_event (%s) VALUES (%s) RETURNING event_id::text", strings.Join(names, ", "), strings.Join(values, ", "))
}

// insertMalformed tries every malformed row through the producer INSERT:
// each must be refused by a named constraint. It returns what refused
// them, and the event_id of a row in year 3000, which is valid.
func insertMalformed(t testing.TB, db *pgtest.DB) (refused []string, year3000 string) {
	t.Helper()
	ctx := context.Background()
	for i, m := range append(slices.Clone(malformedRows), tooLong) {
		_, err := db.Pool.Exec(ctx, producerInsert(m, "refused-"+strconv.Itoa(i)))
		var pgErr *pgconn.PgError
		if errors.As(err, &pgErr) && strings.HasPrefix(pgErr.Code, "23") && pgErr.ConstraintName != "" {
			refused = append(refused, m.what+" by "+pgErr.ConstraintName)
			continue
		}
		if err == nil {
			err = errors.New("accepted")
		}
		t.Errorf("producer INSERT with %s: %v; want it refused by a named constraint", m.what, err)
	}
	err := db.Pool.QueryRow(ctx, producerInsert(malformed{column: "occurred_at", value: "'3000-01-01 00:00:00+00'"}, "year-3000")).Scan(&year3000)
	if err != nil {
		t.Fatalf("producer INSERT with occurred_at in year 3000, which is valid: %v", err)
	}
	return refused, year3000
}

// insertPreexisting puts the malformed rows in outbox_event as rows from
// before the producer constraints: inserted valid, then changed while the
// table's CHECK constraints are dropped, which come back NOT VALID, as a
// migration adds them over old rows. Envelopes are immutable now (trigger
// outbox_event_immutable), so the trigger is off for the change too: such
// rows were written before it, and the V2 cutover carried them as they
// were, the aggregate copied into the delivery row, which is where the
// relay reads it. It runs before any worker starts and returns the rows'
// event_ids, in malformedRows order.
func insertPreexisting(t testing.TB, db *pgtest.DB) []string {
	t.Helper()
	ctx := context.Background()
	tx, err := db.Pool.Begin(ctx)
	if err != nil {
		t.Fatal(err)
	}
	defer tx.Rollback(ctx)
	rows, _ := tx.Query(ctx, `SELECT conname::text, pg_get_constraintdef(oid) FROM pg_constraint
		WHERE conrelid = 'outbox_event'::regclass AND contype = 'c'`)
	checks, err := pgx.CollectRows(rows, pgx.RowToStructByPos[struct{ Name, Def string }])
	if err != nil {
		t.Fatal(err)
	}
	exec := func(sql string, args ...any) {
		if _, err := tx.Exec(ctx, sql, args...); err != nil {
			t.Fatalf("%s: %v", sql, err)
		}
	}
	for _, c := range checks {
		exec("ALTER TABLE outbox_event DROP CONSTRAINT " + pgx.Identifier{c.Name}.Sanitize())
	}
	exec("ALTER TABLE outbox_event DISABLE TRIGGER outbox_event_immutable")
	ids := make([]string, len(malformedRows))
	for i, m := range malformedRows {
		if err := tx.QueryRow(ctx, producerInsert(malformed{}, "preexisting-"+strconv.Itoa(i))).Scan(&ids[i]); err != nil {
			t.Fatal(err)
		}
		exec(fmt.Sprintf("UPDATE outbox_event SET %s = %s WHERE event_id = $1", m.column, m.value), ids[i])
		if m.column == "aggregate_type" || m.column == "aggregate_id" {
			exec(fmt.Sprintf("UPDATE outbox_delivery SET %s = %s WHERE id = (SELECT id FROM outbox_event WHERE event_id = $1)",
				m.column, m.value), ids[i])
		}
	}
	exec("ALTER TABLE outbox_event ENABLE TRIGGER outbox_event_immutable")
	for _, c := range checks {
		exec(fmt.Sprintf("ALTER TABLE outbox_event ADD CONSTRAINT %s %s NOT VALID",
			pgx.Identifier{c.Name}.Sanitize(), strings.TrimSuffix(c.Def, " NOT VALID")))
	}
	if err := tx.Commit(ctx); err != nil {
		t.Fatal(err)
	}
	return ids
}

// checkMalformedRows waits until the rows of insertPreexisting and the
// year-3000 row are settled, and checks how: unsendable rows DEAD with a
// last_error and a JOB_DEAD_LETTER log line, published ones received, the
// year-3000 one with a valid ce-time. Every replica's metrics stay sane
// (dead rows counted, no latency out of range, no control character in a
// label) and the operator commands work. It returns how many went DEAD.
func (c *chaosCluster) checkMalformedRows(preexisting []string, year3000 string) (dead int) {
	c.t.Helper()
	ids := append(slices.Clone(preexisting), year3000)
	c.eventually(60*time.Second, "the malformed rows to be dead-lettered or published", atMostEvery(100*time.Millisecond, func() bool {
		return c.count(`SELECT count(*) FROM outbox_event_state WHERE event_id::text = ANY($1) AND status IN ('PUBLISHED', 'DEAD')`, ids) == len(ids)
	}))
	var (
		id, status, lastError string
		states                = map[string][2]string{}
	)
	rows, _ := c.db.Pool.Query(context.Background(), `SELECT event_id::text, status, coalesce(last_error, '')
		FROM outbox_event_state WHERE event_id::text = ANY($1)`, ids)
	if _, err := pgx.ForEachRow(rows, []any{&id, &status, &lastError}, func() error {
		states[id] = [2]string{status, lastError}
		return nil
	}); err != nil {
		c.t.Fatal(err)
	}
	var deadIDs []string
	for i, m := range malformedRows {
		id := preexisting[i]
		status, lastError := states[id][0], states[id][1]
		switch {
		case status == "DEAD":
			deadIDs = append(deadIDs, id)
			if lastError == "" {
				c.t.Errorf("row with %s: DEAD without a last_error", m.what)
			}
			if !c.deadLettered(id) {
				c.t.Errorf("row with %s: DEAD without a JOB_DEAD_LETTER log line naming event %s", m.what, id)
			}
		case m.unsendable:
			c.t.Errorf("row with %s: %s, want DEAD", m.what, status)
		default:
			if _, ok := c.recv.other(id); !ok {
				c.t.Errorf("row with %s: PUBLISHED but it never reached the receiver", m.what)
			}
		}
	}
	if status := states[year3000][0]; status != "PUBLISHED" {
		c.t.Errorf("row with occurred_at in year 3000: %s, want PUBLISHED", status)
	}
	if ceTime, _ := c.recv.other(year3000); ceTime != "3000-01-01T00:00:00Z" {
		c.t.Errorf("row with occurred_at in year 3000 arrived with ce-time %q", ceTime)
	}
	c.checkMetrics()
	c.deadIDs = deadIDs
	return len(deadIDs)
}

// deadLettered reports whether a replica logged JOB_DEAD_LETTER for event id.
func (c *chaosCluster) deadLettered(id string) bool {
	for _, p := range c.every {
		for _, l := range p.out.Lines(c.t, "") {
			if l["error.code"] == "JOB_DEAD_LETTER" && l["event_id"] == id {
				return true
			}
		}
	}
	return false
}

// checkMetrics checks every replica's /metrics: the refresh counts the
// DEAD rows (no row stops it), no latency is negative or overflows, and
// no label carries a control character.
func (c *chaosCluster) checkMetrics() {
	c.t.Helper()
	dead := c.count(`SELECT count(*) FROM outbox_event_state WHERE status = 'DEAD'`)
	for i, p := range c.replicas {
		var body string
		c.eventually(20*time.Second, fmt.Sprintf(`%s's outbox_pending_size{status="DEAD"} to read %d`, replicaID(i), dead),
			atMostEvery(200*time.Millisecond, func() bool {
				_, body = p.get("/metrics")
				v, ok := sample(body, `outbox_pending_size{status="DEAD"}`)
				return ok && v == float64(dead)
			}))
		if j := strings.IndexFunc(body, func(r rune) bool { return r != '\n' && unicode.IsControl(r) }); j >= 0 {
			c.t.Errorf("%s's /metrics carries a control character: %q", replicaID(i), body[max(0, j-60):min(len(body), j+20)])
		}
		sum, _ := sample(body, "outbox_publish_latency_seconds_sum")
		n, _ := sample(body, "outbox_publish_latency_seconds_count")
		if sum < 0 || sum > n*3600 {
			c.t.Errorf("%s: outbox_publish_latency_seconds_sum is %g over %g events: a negative or overflowing latency was counted", replicaID(i), sum, n)
		}
	}
}

// sample returns the value of series (name and labels as /metrics prints
// them) in a /metrics body.
func sample(body, series string) (float64, bool) {
	for line := range strings.SplitSeq(body, "\n") {
		if v, ok := strings.CutPrefix(line, series+" "); ok {
			f, err := strconv.ParseFloat(v, 64)
			return f, err == nil
		}
	}
	return 0, false
}

// checkOperatorCommands runs `outbox stats` and `outbox dead list` with the
// malformed rows in the table, once the run is over: the commands take the
// connections of a replica it stops first, so that the test stays within
// its share of the server (pgtest).
func (c *chaosCluster) checkOperatorCommands() {
	c.t.Helper()
	deadIDs := c.deadIDs
	last := c.replicas[len(c.replicas)-1]
	if err := last.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		c.t.Fatal(err)
	}
	last.exitCode(c.t, 30*time.Second)
	for _, args := range [][]string{{"outbox", "stats"}, {"outbox", "dead", "list"}} {
		p := startWorker(c.t.T, []string{"APP_DATABASE_URL=" + c.db.URL, "APP_DATABASE_MAX_CONNS=2"}, args...)
		if code := p.exitCode(c.t, 30*time.Second); code != 0 {
			c.t.Errorf("worker %s with the malformed rows in the table: exit %d\n%s", strings.Join(args, " "), code, p.out.String())
			continue
		}
		for _, id := range deadIDs {
			if args[1] == "dead" && !strings.Contains(p.out.String(), id) {
				c.t.Errorf("worker outbox dead list does not show DEAD event %s:\n%s", id, p.out.String())
			}
		}
	}
}

// createJobTables creates what the job writes. A DEFERRABLE INITIALLY
// DEFERRED constraint trigger fires inside COMMIT, after every statement of
// the transaction including the worker's own last checks, so the
// clock_timestamp() it records is the run's commit time.
func createJobTables(t testing.TB, db *pgtest.DB) {
	_, err := db.Pool.Exec(context.Background(), `
CREATE TABLE chaos_job_mark (
    token bigint      NOT NULL,
    phase text        NOT NULL,
    at    timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE TABLE chaos_job_commit (token bigint NOT NULL, committed_at timestamptz NOT NULL);
CREATE FUNCTION chaos_job_committing() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    INSERT INTO chaos_job_commit VALUES (NEW.token, clock_timestamp());
    RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER chaos_job_commit AFTER INSERT ON chaos_job_mark
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW WHEN (NEW.phase = 'end')
    EXECUTE FUNCTION chaos_job_committing();`)
	if err != nil {
		t.Fatal(err)
	}
}

// jobRun is a committed run of the sql job.
type jobRun struct {
	token         int64
	start, commit time.Time
}

// jobFigures is what checkJobRuns found.
type jobFigures struct {
	committed    map[int64]jobRun // by token
	late         int              // commits after a run with a later token started
	contradicted int              // runs logged success but not committed, or committed but not logged success
}

// checkJobRuns checks the committed runs of the sql job: none committed
// after a run with a later fencing token started (so none overlapped, and
// none committed after losing its lease), and each replica logged a run as
// success exactly when it committed.
func (c *chaosCluster) checkJobRuns() jobFigures {
	c.t.Helper()
	if n := c.count(`SELECT count(*) FROM chaos_job_mark m WHERE phase = 'start'
		AND NOT EXISTS (SELECT 1 FROM chaos_job_commit c WHERE c.token = m.token)`); n > 0 {
		c.t.Errorf("%d committed runs have no commit time", n)
	}
	rows, _ := c.db.Pool.Query(context.Background(), `SELECT m.token, m.at, c.committed_at
		FROM chaos_job_mark m JOIN chaos_job_commit c USING (token) WHERE m.phase = 'start' ORDER BY m.token`)
	var r jobRun
	var runs []jobRun
	if _, err := pgx.ForEachRow(rows, []any{&r.token, &r.start, &r.commit}, func() error {
		runs = append(runs, r)
		return nil
	}); err != nil {
		c.t.Fatal(err)
	}
	if len(runs) < 5 {
		c.t.Errorf("only %d committed runs of the job", len(runs))
	}
	f := jobFigures{committed: map[int64]jobRun{}}
	for i, a := range runs {
		f.committed[a.token] = a
		for _, b := range runs[i+1:] {
			if b.token > a.token && !a.commit.Before(b.start) {
				f.late++
				c.t.Errorf("the run with token %d committed %s after the run with token %d started",
					a.token, a.commit.Sub(b.start), b.token)
			}
		}
	}
	for _, p := range c.every {
		for token, outcome := range jobOutcomes(c.t, p) {
			if _, ok := f.committed[token]; ok != (outcome == "success") {
				f.contradicted++
				c.t.Errorf("the run with token %d was logged %s; committed: %v", token, outcome, ok)
			}
		}
	}
	return f
}

// jobOutcomes returns the outcome p logged for each run of the sql job, by
// fencing token; an outcome other than success or lease_lost comes with its
// error, for the figures.
func jobOutcomes(t testing.TB, p *proc) map[int64]string {
	t.Helper()
	out := map[int64]string{}
	for _, l := range p.out.Lines(t, "job run finished") {
		if l["job"] != chaosJob {
			continue
		}
		n, _ := l["fencing_token"].(json.Number)
		token, err := n.Int64()
		if err != nil {
			t.Fatalf("job run finished without a fencing token: %v", l)
		}
		outcome, _ := l["outcome"].(string)
		if outcome != "success" && outcome != "lease_lost" {
			outcome = fmt.Sprintf("%s (%v)", outcome, l["error"])
		}
		out[token] = outcome
	}
	return out
}

// deliveryFigures is what checkDeliveries found.
type deliveryFigures struct {
	arrived, dups, outOfOrder int
	maxGap                    time.Duration // longest time without a first delivery
	maxLatency                time.Duration // longest from a producer's commit to the event's first delivery
}

// checkDeliveries checks what the receiver got once every event arrived:
// nothing in a form the contract does not allow, first deliveries in order
// per aggregate, and duplicates within the bound.
func (c *chaosCluster) checkDeliveries(total int) deliveryFigures {
	c.t.Helper()
	<-c.prod.done // every event arrived, so the producer has returned
	r := c.recv
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, v := range r.invalid {
		c.t.Errorf("receiver: %s", v)
	}
	f := deliveryFigures{arrived: len(r.eventID), dups: r.chaosDeliveries - len(r.eventID)}
	for a, got := range r.order {
		for i, n := range got {
			if n != i {
				f.outOfOrder++
				c.t.Errorf("agg-%d: first deliveries out of order: %v", a, got[max(0, i-5):min(len(got), i+5)])
				break
			}
		}
	}
	if f.dups > c.dupBound() {
		c.t.Errorf("%d duplicate deliveries, more than the bound of %d", f.dups, c.dupBound())
	}
	firsts := make([]time.Time, 0, total)
	for g, at := range r.firstAt {
		firsts = append(firsts, at)
		f.maxLatency = max(f.maxLatency, at.Sub(c.prod.at[g]))
	}
	slices.SortFunc(firsts, time.Time.Compare)
	for i := 1; i < len(firsts); i++ {
		f.maxGap = max(f.maxGap, firsts[i].Sub(firsts[i-1]))
	}
	return f
}
