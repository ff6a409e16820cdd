package outbox

import (
	"context"
	"fmt"
	"os"
	"testing"
	"text/tabwriter"
	"time"

	"github.com/worker-dev/worker/internal/pgtest"
)

// BenchmarkRetention compares, on the same 1,000,000 published events
// (1,000 aggregates, ~200-byte payloads, ten days old), what storage V2
// and V1 cost to keep and to get rid of:
//
//   - V2: the events in one day partition of outbox_event; each got a
//     delivery row that was deleted in batches of 500, as the relay
//     publishes. Retention drops the partition (Partitions.Maintain).
//   - V1: the same events in a table of V1's shape with V1's indexes,
//     inserted PENDING and updated to PUBLISHED in batches of 500, as the
//     V1 relay did. Retention is V1's reaper: DELETE in chunks of 1,000.
//
// Both are vacuumed after publishing. The bulk load skips the insert
// triggers (the rows are those the triggers would write) so that the
// benchmark measures storage, not the producer path. It prints the sizes
// after publishing, the time each retention takes and what it leaves.
func BenchmarkRetention(b *testing.B) {
	db := pgtest.New(b)
	ctx := context.Background()
	const events = 1_000_000
	var day time.Time
	if err := db.Pool.QueryRow(ctx, `SELECT date_trunc('day', now() - interval '10 days')`).Scan(&day); err != nil {
		b.Fatal(err)
	}
	var part string
	if err := db.Pool.QueryRow(ctx, `SELECT outbox_event_add_partition($1::timestamptz, $1::timestamptz + interval '1 day')`, day).Scan(&part); err != nil {
		b.Fatal(err)
	}
	row := `'order', 'order-' || (hashint4(g) & 2147483647) % 1000, 'order.updated',
	        jsonb_build_object('order_id', 'order-' || g, 'seq', g, 'customer', 'customer-' || g % 977,
	                           'status', 'PAID', 'amount_cents', g * 37 % 100000, 'currency', 'EUR', 'note', repeat('x', 80)),
	        '{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}'`
	exec(b, db.Pool, "ALTER TABLE outbox_event DISABLE TRIGGER USER")
	exec(b, db.Pool, fmt.Sprintf(`INSERT INTO outbox_event (id, event_id, aggregate_type, aggregate_id, event_type, payload, headers, occurred_at, created_at)
		 SELECT g, gen_random_uuid(), %s, $1::timestamptz + g * interval '80 milliseconds', $1::timestamptz + g * interval '80 milliseconds'
		 FROM generate_series(1, %d) g`, row, events), day)
	for _, q := range []string{
		"ALTER TABLE outbox_event ENABLE TRIGGER USER",
		`INSERT INTO outbox_delivery (id, created_at, aggregate_type, aggregate_id) SELECT id, created_at, aggregate_type, aggregate_id FROM outbox_event`,
		// V1: 00030's table and indexes (00100's in-flight index included).
		`CREATE TABLE v1_event (
		    id bigint PRIMARY KEY, event_id uuid NOT NULL UNIQUE,
		    aggregate_type text COLLATE "C" NOT NULL, aggregate_id text COLLATE "C" NOT NULL,
		    event_type text NOT NULL, payload jsonb NOT NULL, headers jsonb NOT NULL DEFAULT '{}',
		    occurred_at timestamptz NOT NULL DEFAULT now(), status text NOT NULL DEFAULT 'PENDING',
		    attempts integer NOT NULL DEFAULT 0, next_attempt_at timestamptz NOT NULL DEFAULT now(),
		    claimed_by text, last_error text, published_at timestamptz)`,
		`CREATE INDEX ON v1_event (id) WHERE status IN ('PENDING', 'FAILED', 'IN_FLIGHT')`,
		`CREATE INDEX ON v1_event (aggregate_type, aggregate_id, id) WHERE status IN ('PENDING', 'FAILED', 'IN_FLIGHT')`,
		`CREATE INDEX ON v1_event (aggregate_type, aggregate_id, id) WHERE status = 'DEAD'`,
		`CREATE INDEX ON v1_event (published_at) WHERE status = 'PUBLISHED'`,
		`CREATE INDEX ON v1_event (next_attempt_at) WHERE status = 'IN_FLIGHT'`,
		`INSERT INTO v1_event (id, event_id, aggregate_type, aggregate_id, event_type, payload, headers, occurred_at)
		 SELECT id, event_id, aggregate_type, aggregate_id, event_type, payload, headers, occurred_at FROM outbox_event`,
	} {
		exec(b, db.Pool, q)
	}
	// Publish both, batch by batch, as the relays write it.
	for {
		tag, err := db.Pool.Exec(ctx, `DELETE FROM outbox_delivery WHERE id IN (SELECT id FROM outbox_delivery ORDER BY id LIMIT 500)`)
		if err != nil {
			b.Fatal(err)
		}
		if tag.RowsAffected() == 0 {
			break
		}
	}
	for {
		tag, err := db.Pool.Exec(ctx, `UPDATE v1_event SET status = 'PUBLISHED', attempts = 1, published_at = $1
			WHERE id IN (SELECT id FROM v1_event WHERE status IN ('PENDING', 'FAILED', 'IN_FLIGHT') ORDER BY id LIMIT 500)`, day.Add(12*time.Hour))
		if err != nil {
			b.Fatal(err)
		}
		if tag.RowsAffected() == 0 {
			break
		}
	}
	exec(b, db.Pool, "VACUUM ANALYZE outbox_delivery, outbox_event, v1_event")
	size := func(q string) float64 {
		var n int64
		if err := db.Pool.QueryRow(ctx, q).Scan(&n); err != nil {
			b.Fatal(err)
		}
		return float64(n) / (1 << 20)
	}
	v2Heap := size(fmt.Sprintf(`SELECT pg_table_size('%s')`, part))
	v2Index := size(fmt.Sprintf(`SELECT pg_indexes_size('%s')`, part))
	v2Delivery := size(`SELECT pg_total_relation_size('outbox_delivery')`)
	v1Heap := size(`SELECT pg_table_size('v1_event')`)
	v1Index := size(`SELECT pg_indexes_size('v1_event')`)

	for range b.N {
		p := &Partitions{Pool: db.Pool, Interval: 24 * time.Hour, Ahead: 2, Retention: 7 * 24 * time.Hour}
		start := time.Now()
		_, dropped, err := p.Maintain(ctx)
		v2Took := time.Since(start)
		if err != nil || len(dropped) != 1 || dropped[0] != part {
			b.Fatalf("dropped %v (%v), want %s", dropped, err, part)
		}
		const reap = `DELETE FROM v1_event WHERE ctid = ANY (ARRAY(
		    SELECT ctid FROM v1_event WHERE status = 'PUBLISHED' AND published_at < now() - interval '7 days'
		    ORDER BY published_at LIMIT 1000 FOR UPDATE SKIP LOCKED))`
		start = time.Now()
		var reaped int64
		for {
			tag, err := db.Pool.Exec(ctx, reap)
			if err != nil {
				b.Fatal(err)
			}
			if tag.RowsAffected() == 0 {
				break
			}
			reaped += tag.RowsAffected()
		}
		v1Took := time.Since(start)
		if reaped != events {
			b.Fatalf("the reaper deleted %d rows, want %d", reaped, events)
		}
		v1After := size(`SELECT pg_total_relation_size('v1_event')`)

		w := tabwriter.NewWriter(os.Stdout, 0, 0, 2, ' ', tabwriter.AlignRight|tabwriter.Debug)
		fmt.Fprintf(w, "1,000,000 published events\ttable MB\tindexes MB\tdelivery MB\tretention took\tleft behind\t\n")
		fmt.Fprintf(w, "V2: a day partition, dropped\t%.0f\t%.0f\t%.1f\t%s\tnothing\t\n", v2Heap, v2Index, v2Delivery, v2Took.Round(time.Millisecond))
		fmt.Fprintf(w, "V1: one table, reaper (chunks of 1,000)\t%.0f\t%.0f\t-\t%s\t%.0f MB of dead rows and index entries for vacuum\t\n", v1Heap, v1Index, v1Took.Round(time.Millisecond), v1After)
		w.Flush()
		b.ReportMetric(v2Took.Seconds(), "v2_drop_s")
		b.ReportMetric(v1Took.Seconds(), "v1_reap_s")
		b.ReportMetric(v2Heap+v2Index+v2Delivery, "v2_MB")
		b.ReportMetric(v1Heap+v1Index, "v1_MB")
	}
}
