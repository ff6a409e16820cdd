package outbox

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgtype"

	"github.com/worker-dev/worker/internal/pgtest"
)

// TestStoreClaimPlansUsePartialIndexes: with 300,000 published envelopes,
// 3,000 DEAD events and a handful of live ones, the statements that search
// read the partial indexes of live delivery rows, the ones that lock go
// straight to the rows by ctid, the envelopes are read by their primary
// key, and none scans the envelopes. The plans checked are the generic
// plans of the prepared statements, which the relay forces in its claim
// transactions.
func TestStoreClaimPlansUsePartialIndexes(t *testing.T) {
	db := pgtest.New(t)
	ctx := context.Background()
	// Published history, loaded in bulk with the user triggers off (the
	// rows get their ids from the sequence as the trigger would, and no
	// delivery row), every hundredth DEAD; then a few live events through
	// the trigger.
	for _, q := range []string{
		"ALTER TABLE outbox_event DISABLE TRIGGER USER",
		`INSERT INTO outbox_event (id, event_id, aggregate_type, aggregate_id, event_type, payload)
		 SELECT nextval('outbox_event_id_seq'), gen_random_uuid(), 'order', 'agg-' || g % 1000, 'order.updated', '{"n": 1}'
		 FROM generate_series(1, 300000) g`,
		"ALTER TABLE outbox_event ENABLE TRIGGER USER",
		`INSERT INTO outbox_delivery (id, created_at, aggregate_type, aggregate_id, status, attempts, dead_at)
		 SELECT id, created_at, aggregate_type, aggregate_id, 'DEAD', 3, now() FROM outbox_event WHERE id % 100 = 0`,
		`INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
		 SELECT 'order', 'agg-' || g % 10, 'order.updated', '{}' FROM generate_series(1, 50) g`,
		"VACUUM ANALYZE outbox_event, outbox_delivery",
	} {
		exec(t, db.Pool, q)
	}
	const tids = `'{"(0,1)","(0,2)"}'`
	for name, c := range map[string]struct {
		sql, args, uses string
	}{
		"window":                {windowSQL, "800", "outbox_delivery_live_idx"},
		"lock":                  {lockSQL(false), tids + ", 10, " + tids + ", " + tids + ", 10", "Tid Scan"},
		"lock (block_on_dead)":  {lockSQL(true), tids + ", 10, " + tids + ", " + tids + ", 10", "Tid Scan"},
		"lock, its envelopes":   {lockSQL(false), tids + ", 10, " + tids + ", " + tids + ", 10", "envelope key"},
		"extend":                {extendSQL(true), "'{order}', '{agg-1}', '{1}', 10", "outbox_delivery_aggregate_idx"},
		"aggregate heads":       {aggregateHeadsSQL, "'', '', 800", "outbox_delivery_aggregate_idx"},
		"mark published":        {markPublishedSQL, tids, "Tid Scan"},
		"mark in flight, named": {markInFlightNamedSQL, tids + ", 1000, 'x', 1, 1", "Tid Scan"},
		"complete":              {completeSQL, "'{1}', '{t}', '{1}', '{PUBLISHED}', '{0}', '{NULL}', 'x'", "outbox_delivery_pkey"},
		"gauges":                {gaugesSQL, "", "outbox_delivery_live_idx"},
	} {
		conn, err := db.Pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		var plan string
		err = pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, "SET LOCAL plan_cache_mode = force_generic_plan"); err != nil {
				return err
			}
			if _, err := tx.Exec(ctx, "PREPARE plan_test AS "+c.sql); err != nil {
				return err
			}
			call := "EXECUTE plan_test"
			if c.args != "" {
				call += "(" + c.args + ")"
			}
			if err := tx.QueryRow(ctx, "EXPLAIN (FORMAT JSON) "+call).Scan(&plan); err != nil {
				return err
			}
			_, err := tx.Exec(ctx, "DEALLOCATE plan_test")
			return err
		})
		conn.Release()
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		scans := planScans(t, plan)
		if scans["Seq Scan"] > 0 {
			t.Errorf("%s: sequential scan of the envelopes\n%s", name, plan)
		}
		if scans[c.uses] == 0 {
			t.Errorf("%s: does not use %s\n%s", name, c.uses, plan)
		}
	}
}

// planScans counts, in an EXPLAIN (FORMAT JSON) plan, the sequential scans
// of outbox_event and the uses of each index.
func planScans(t *testing.T, plan string) map[string]int {
	t.Helper()
	var doc []struct{ Plan map[string]any }
	if err := json.Unmarshal([]byte(plan), &doc); err != nil {
		t.Fatal(err)
	}
	out := map[string]int{}
	var walk func(n map[string]any)
	walk = func(n map[string]any) {
		// An empty partition (tomorrow's) costs nothing to scan, and runtime
		// pruning skips it anyway; only a scan with a cost counts.
		rel, _ := n["Relation Name"].(string)
		if cost, _ := n["Total Cost"].(float64); n["Node Type"] == "Seq Scan" && strings.HasPrefix(rel, "outbox_event") && cost > 0 {
			out["Seq Scan"]++
		}
		if n["Node Type"] == "Tid Scan" {
			out["Tid Scan"]++
		}
		if idx, ok := n["Index Name"].(string); ok {
			out[idx]++
			// The envelope partitions' primary keys, named after the
			// partitions.
			if strings.HasPrefix(idx, "outbox_event_") && strings.HasSuffix(idx, "_pkey") {
				out["envelope key"]++
			}
		}
		for _, key := range []string{"Plans"} {
			children, _ := n[key].([]any)
			for _, c := range children {
				walk(c.(map[string]any))
			}
		}
	}
	for _, d := range doc {
		walk(d.Plan)
	}
	return out
}

// TestStoreInsertTriggerOwnsRelayColumns: whatever a producer writes into
// the id, a new event gets one from the sequence and starts with a PENDING
// delivery row and no attempts.
func TestStoreInsertTriggerOwnsRelayColumns(t *testing.T) {
	db := pgtest.New(t)
	ctx := context.Background()
	var id, attempts int64
	var status string
	err := db.Pool.QueryRow(ctx, `
WITH e AS (INSERT INTO outbox_event (id, aggregate_type, aggregate_id, event_type, payload)
           VALUES (424242, 'order', '1', 'x', '{}') RETURNING id)
SELECT id FROM e`).Scan(&id)
	if err != nil {
		t.Fatal(err)
	}
	if err := db.Pool.QueryRow(ctx, `SELECT status, attempts FROM outbox_delivery WHERE id = $1`, id).Scan(&status, &attempts); err != nil {
		t.Fatal(err)
	}
	if id == 424242 || status != StatusPending || attempts != 0 {
		t.Errorf("new row: id %d status %s attempts %d", id, status, attempts)
	}
	// Headers must be a JSON object.
	if _, err := db.Pool.Exec(ctx, `INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload, headers)
		VALUES ('order', '1', 'x', '{}', '[1]')`); err == nil {
		t.Error("headers that are not an object were accepted")
	}
}

// TestStoreAppend: the helper's defaults and explicit values.
func TestStoreAppend(t *testing.T) {
	db := pgtest.New(t)
	ctx := context.Background()
	occurred := time.Date(2025, 5, 6, 7, 8, 9, 0, time.UTC)
	var ids [2]string
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		var err error
		if ids[0], err = Append(ctx, tx, NewEvent{AggregateType: "order", AggregateID: "1", EventType: "created",
			Payload: json.RawMessage(`{"a":1}`)}); err != nil {
			return err
		}
		ids[1], err = Append(ctx, tx, NewEvent{AggregateType: "order", AggregateID: "1", EventType: "paid",
			Payload: json.RawMessage(`[]`), EventID: "0b7d7b36-0d6e-4c59-9b54-8f7f4c35d0c1",
			Headers: map[string]string{"traceparent": "00-x-y-01"}, OccurredAt: occurred})
		return err
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(ids[0]) != 36 || ids[1] != "0b7d7b36-0d6e-4c59-9b54-8f7f4c35d0c1" {
		t.Fatalf("event ids %v", ids)
	}
	var headers string
	var at time.Time
	if err := db.Pool.QueryRow(ctx, `SELECT headers::text, occurred_at FROM outbox_event WHERE event_id = $1`, ids[1]).
		Scan(&headers, &at); err != nil {
		t.Fatal(err)
	}
	if headers != `{"traceparent": "00-x-y-01"}` || !at.Equal(occurred) {
		t.Errorf("explicit event: headers %s occurred_at %s", headers, at)
	}
	if err := db.Pool.QueryRow(ctx, `SELECT headers::text FROM outbox_event WHERE event_id = $1`, ids[0]).Scan(&headers); err != nil || headers != "{}" {
		t.Errorf("default headers %q (%v)", headers, err)
	}
	for _, bad := range []NewEvent{
		{AggregateID: "1", EventType: "x", Payload: json.RawMessage(`{}`)},
		{AggregateType: "order", EventType: "x", Payload: json.RawMessage(`{}`)},
		{AggregateType: "order", AggregateID: "1", Payload: json.RawMessage(`{}`)},
		{AggregateType: "order", AggregateID: "1", EventType: "x"},
	} {
		err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error { _, err := Append(ctx, tx, bad); return err })
		if err == nil {
			t.Errorf("Append(%+v) accepted", bad)
		}
	}
}

// TestAdminPurgeAndMisuse: purging, and the errors an operator can hit.
func TestAdminPurgeAndMisuse(t *testing.T) {
	db := pgtest.New(t)
	ctx := context.Background()
	a := appendEvent(t, db.Pool, "a", "x")
	b := appendEvent(t, db.Pool, "b", "x")
	live := appendEvent(t, db.Pool, "c", "x")
	markDead(t, db.Pool, a, b)
	log := slog.New(slog.DiscardHandler)

	if _, err := PurgeDead(ctx, db.Pool, a, "", log); err == nil {
		t.Error("purge without an actor accepted")
	}
	if _, err := RetryDead(ctx, db.Pool, "not-a-uuid", "ops", log); err == nil || !strings.Contains(err.Error(), "not a uuid") {
		t.Errorf("retry of a malformed id: %v", err)
	}
	if _, err := RetryDead(ctx, db.Pool, live, "ops", log); !errors.Is(err, ErrNotDead) {
		t.Errorf("retry of a live event: %v, want ErrNotDead", err)
	}
	if n, err := PurgeDead(ctx, db.Pool, a, "ops", log); err != nil || n != 1 {
		t.Fatalf("purge one: %d %v", n, err)
	}
	if n, err := PurgeDead(ctx, db.Pool, "", "ops", log); err != nil || n != 1 {
		t.Fatalf("purge all: %d %v", n, err)
	}
	st, err := ReadStats(ctx, db.Pool)
	if err != nil {
		t.Fatal(err)
	}
	if st.ByStatus[StatusDead] != 0 || st.ByStatus[StatusPending] != 1 || len(st.ByStatus) != 5 {
		t.Errorf("after purging: %v", st.ByStatus)
	}
	if dead, _, err := ListDead(ctx, db.Pool, 0); err == nil {
		t.Errorf("ListDead with limit 0: %v", dead)
	}
}

// TestDeliveryUpdatesAreHOT: the relay's writes to a delivery row short of
// DEAD (a failure, a hand-back, a detach, a completion) change no indexed
// column, so PostgreSQL makes them heap-only: no index entry is written.
// pg_stat_get_xact_tuples_hot_updated counts them in the transaction that
// made them.
func TestDeliveryUpdatesAreHOT(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	for i := range 4 {
		appendEvent(t, db.Pool, "a", fmt.Sprint("e", i))
	}
	err := pgx.BeginFunc(ctx, db.Pool, func(tx pgx.Tx) error {
		rows, err := tx.Query(ctx, `SELECT ctid, id FROM outbox_delivery ORDER BY id`)
		if err != nil {
			return err
		}
		type row struct {
			tid pgtype.TID
			id  int64
		}
		got, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (row, error) {
			var x row
			return x, r.Scan(&x.tid, &x.id)
		})
		if err != nil {
			return err
		}
		for _, s := range []struct {
			sql  string
			args []any
		}{
			{markFailedSQL, []any{[]pgtype.TID{got[0].tid}, []string{StatusFailed}, []int64{1000}, []string{"boom"}, "relay"}},
			{handBackSQL, []any{[]pgtype.TID{got[1].tid}}},
			{markInFlightSQL, []any{[]pgtype.TID{got[2].tid}, int64(30000), "token"}},
			{completeSQL, []any{[]int64{got[2].id}, []string{"token"}, []int32{1}, []string{StatusFailed}, []int64{1000}, []*string{nil}, "relay"}},
		} {
			if _, err := tx.Exec(ctx, s.sql, s.args...); err != nil {
				return err
			}
		}
		var updated, hot int64
		if err := tx.QueryRow(ctx, `SELECT pg_stat_get_xact_tuples_updated('outbox_delivery'::regclass),
			pg_stat_get_xact_tuples_hot_updated('outbox_delivery'::regclass)`).Scan(&updated, &hot); err != nil {
			return err
		}
		if updated != 4 || hot != updated {
			t.Errorf("%d updates, %d of them HOT; want 4, all HOT", updated, hot)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
}
