package tasks

import (
	"context"
	"encoding/json"
	"errors"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/riverqueue/river"
	"github.com/riverqueue/river/riverdriver/riverpgxv5"

	"github.com/worker-dev/worker/internal/obs"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/tasks/tasksconfig"
)

// worker_enqueue must insert the row and send the notification River's own
// InsertTx would, given the same inputs and the kind's configured defaults.
func TestEnqueueFunctionInsertsWhatRiverInserts(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := t.Context()
	cfg := testConfig(t, map[string]tasksconfig.Queue{"mail": queue(1, 10)},
		tasksconfig.Kind{Name: "send-receipt", Type: tasksconfig.TypeGo, Queue: "mail", MaxAttempts: 7})
	if err := publishConfig(ctx, db.Pool, &cfg); err != nil {
		t.Fatal(err)
	}
	// River's client-side limiter sends at most one insert notification per
	// queue a second; a fresh client sends its first.
	riverClient, err := river.NewClient(riverpgxv5.New(nil), &river.Config{})
	if err != nil {
		t.Fatal(err)
	}
	later := time.Now().Add(time.Hour).UTC().Truncate(time.Microsecond)
	cases := []struct {
		name     string
		sql      string
		sqlArgs  []any
		opts     river.InsertOpts
		notifies bool
	}{
		{"defaults of a configured kind",
			"SELECT worker_enqueue('send-receipt', '{\"order\": 42}', metadata => '{\"request_id\": \"r-1\"}')", nil,
			river.InsertOpts{Queue: "mail", MaxAttempts: 7, Metadata: []byte(`{"request_id": "r-1"}`)}, true},
		{"every option",
			"SELECT worker_enqueue('send-receipt', '{\"order\": 42}', queue => 'default', max_attempts => 2, priority => 3, scheduled_at => $1, tags => '{a-b,c_d}')",
			[]any{later},
			river.InsertOpts{Queue: "default", MaxAttempts: 2, Priority: 3, ScheduledAt: later, Tags: []string{"a-b", "c_d"}}, false},
	}
	for _, c := range cases {
		listener := db.Conn(t)
		if _, err := listener.Exec(ctx, `LISTEN "public.river_insert"`); err != nil {
			t.Fatal(err)
		}
		var viaRiver, viaSQL int64
		err = pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
			res, err := riverClient.InsertTx(ctx, tx, rawArgs{kind: "send-receipt", raw: json.RawMessage(`{"order": 42}`)}, &c.opts)
			if err != nil {
				return err
			}
			viaRiver = res.Job.ID
			return tx.QueryRow(ctx, c.sql, c.sqlArgs...).Scan(&viaSQL)
		})
		if err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		// Every column but the id and the insert's timestamps must be equal.
		// River stamps those with its process's clock, the function with the
		// database's; both stamp created_at, and scheduled_at unless given,
		// with one instant.
		const cols = `to_jsonb(j) - '{id,created_at,scheduled_at}'::text[] || jsonb_build_object(
			'due_at_insert', j.scheduled_at = j.created_at,
			'scheduled_at', CASE WHEN j.state = 'scheduled' THEN j.scheduled_at END)`
		var same bool
		var a, b string
		err = db.Pool.QueryRow(ctx, `SELECT r = s, r::text, s::text FROM
			(SELECT `+cols+` AS r FROM river_job j WHERE id = $1) x, (SELECT `+cols+` AS s FROM river_job j WHERE id = $2) y`,
			viaRiver, viaSQL).Scan(&same, &a, &b)
		if err != nil {
			t.Fatal(err)
		}
		if !same {
			t.Errorf("%s: rows differ\nRiver:          %s\nworker_enqueue: %s", c.name, a, b)
		}
		var payloads []string
		for {
			wctx, cancel := context.WithTimeout(ctx, 300*time.Millisecond)
			n, err := listener.WaitForNotification(wctx)
			cancel()
			if err != nil {
				break
			}
			payloads = append(payloads, n.Payload)
		}
		listener.Close(ctx)
		// PostgreSQL folds identical notifications of one transaction into
		// one: River's and the function's were byte for byte the same.
		want := []string{}
		if c.notifies {
			want = []string{`{"queue": "mail"}`}
		}
		if len(payloads) != len(want) || (len(want) == 1 && payloads[0] != want[0]) {
			t.Errorf("%s: notifications %q, want %q", c.name, payloads, want)
		}
		riverClient, _ = river.NewClient(riverpgxv5.New(nil), &river.Config{})
	}
}

// A queue whose available backlog is at max_backlog refuses enqueues from
// every producer: JOB_EXECUTOR_REJECTED.
func TestFullQueueRefusesEnqueue(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := t.Context()
	cfg := testConfig(t, map[string]tasksconfig.Queue{"small": queue(1, 2)}, tasksconfig.Kind{Name: "report", Type: tasksconfig.TypeGo, Queue: "small"})
	if err := publishConfig(ctx, db.Pool, &cfg); err != nil {
		t.Fatal(err)
	}
	enqueueGo(t, ctx, db.Pool, "report", `{}`)
	enqueueSQL(t, db.Pool, "report", `{}`, `{}`)

	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		_, err := EnqueueJSON(ctx, tx, "report", json.RawMessage(`{}`), nil)
		return err
	})
	var rej *RejectedError
	if !errors.As(err, &rej) || obs.CodeOf(err) != obs.CodeJobExecutorRejected {
		t.Fatalf("Go enqueue into a full queue: %v, want a JOB_EXECUTOR_REJECTED error", err)
	}
	_, err = db.Pool.Exec(ctx, "SELECT worker_enqueue('report', '{}')")
	var pg *pgconn.PgError
	if !errors.As(err, &pg) || pg.Code != "WK001" {
		t.Fatalf("SQL enqueue into a full queue: %v, want SQLSTATE WK001", err)
	}
	// Other queues are not affected.
	enqueueSQL(t, db.Pool, "other", `{}`, `{}`)
	var n int
	if err := db.Pool.QueryRow(ctx, "SELECT count(*) FROM river_job WHERE queue = 'small'").Scan(&n); err != nil || n != 2 {
		t.Fatalf("small queue holds %d tasks (%v), want 2", n, err)
	}
}

// The Go helper copies the caller's Meta into the task's metadata, keeping
// keys the caller set explicitly.
func TestEnqueueCopiesMetaFromContext(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := WithMeta(t.Context(), Meta{RequestID: "req-9", Traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
		CorrelationID: "corr-3", TenantID: "tenant-a"})
	var id int64
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		res, err := EnqueueJSON(ctx, tx, "meta-kind", json.RawMessage(`{}`), &river.InsertOpts{Metadata: []byte(`{"tenant_id": "explicit"}`)})
		if err == nil {
			id = res.Job.ID
		}
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	var md []byte
	if err := db.Pool.QueryRow(ctx, "SELECT metadata FROM river_job WHERE id = $1", id).Scan(&md); err != nil {
		t.Fatal(err)
	}
	got := metaFromJob(md)
	want := Meta{RequestID: "req-9", Traceparent: "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
		TraceID: "4bf92f3577b34da6a3ce929d0e0e4736", CorrelationID: "corr-3", TenantID: "explicit"}
	if got != want {
		t.Fatalf("metadata %s, want %+v", md, want)
	}
}

// A replica starting with a new configuration removes the kinds and queues
// it no longer has, so a dropped kind's tasks stop going to its old queue.
func TestPublishConfigForgetsDroppedKindsAndQueues(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	old := testConfig(t, map[string]tasksconfig.Queue{"mail": queue(1, 10)}, tasksconfig.Kind{Name: "send-receipt", Type: tasksconfig.TypeSQL, SQL: "SELECT $1", Queue: "mail"})
	if err := publishConfig(ctx, db.Pool, &old); err != nil {
		t.Fatal(err)
	}
	current := testConfig(t, nil)
	if err := publishConfig(ctx, db.Pool, &current); err != nil {
		t.Fatal(err)
	}
	var routed string
	if err := db.Pool.QueryRow(ctx, "SELECT queue FROM worker_task_admit('send-receipt', NULL, NULL)").Scan(&routed); err != nil {
		t.Fatal(err)
	}
	var queues []string
	if err := db.Pool.QueryRow(ctx, "SELECT array_agg(queue ORDER BY queue) FROM worker_task_queue").Scan(&queues); err != nil {
		t.Fatal(err)
	}
	if routed != tasksconfig.DefaultQueue || !slices.Equal(queues, []string{tasksconfig.DefaultQueue}) {
		t.Fatalf("after dropping kind send-receipt and queue mail: the kind goes to %q, queues %v; want default and [default]", routed, queues)
	}
}

// A kind that no replica publishes (configured or registered in Go) is
// still enqueued, for a producer deployed before its workers, but
// worker_enqueue raises a NOTICE saying its task waits; KnownKind, which
// the CLI asks, says the same.
func TestUnknownKindRaisesANotice(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	cfg := testConfig(t, nil, tasksconfig.Kind{Name: "configured", Type: tasksconfig.TypeSQL, SQL: "SELECT $1"})
	if err := publishConfig(ctx, db.Pool, &cfg, "registered-in-go", "configured"); err != nil {
		t.Fatal(err)
	}
	var notices []string
	conn := db.Conn(t, func(c *pgx.ConnConfig) {
		c.OnNotice = func(_ *pgconn.PgConn, n *pgconn.Notice) { notices = append(notices, n.Message) }
	})
	for _, c := range []struct {
		kind  string
		known bool
	}{{"configured", true}, {"registered-in-go", true}, {"nobody-runs-this", false}} {
		notices = nil
		var id int64
		if err := conn.QueryRow(ctx, "SELECT worker_enqueue($1)", c.kind).Scan(&id); err != nil || id == 0 {
			t.Fatalf("%s: enqueue: %v", c.kind, err)
		}
		if gotNotice := len(notices) == 1 && strings.Contains(notices[0], c.kind+" is not known"); gotNotice == c.known {
			t.Errorf("%s: notices %q; want one only for a kind no replica knows", c.kind, notices)
		}
		if known, err := KnownKind(ctx, conn, c.kind); err != nil || known != c.known {
			t.Errorf("KnownKind(%s) = %v, %v; want %v", c.kind, known, err, c.known)
		}
	}
}

// A kind name River would refuse to run (one letter, empty, too long, a
// space) is refused at enqueue with River's rule, not stored to wait for
// ever.
func TestEnqueueRefusesAKindNameRiverRejects(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	for _, kind := range []string{"", "k", strings.Repeat("k", 128), "send receipt", "*"} {
		err := pgx.BeginFunc(t.Context(), db.Pool, func(tx pgx.Tx) error {
			_, err := EnqueueJSON(t.Context(), tx, kind, json.RawMessage(`{}`), nil)
			return err
		})
		var kne *tasksconfig.KindNameError
		if !errors.As(err, &kne) || !strings.Contains(err.Error(), tasksconfig.KindNameRule) {
			t.Errorf("kind %q: %v; want a tasksconfig.KindNameError naming the rule", kind, err)
		}
	}
	for _, kind := range []string{"kk", "send-receipt", "billing.v2/charge", strings.Repeat("k", 127)} {
		if err := tasksconfig.CheckKindName(kind); err != nil {
			t.Errorf("kind %q refused: %v", kind, err)
		}
	}
}
