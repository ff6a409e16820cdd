package sinktest

import (
	"context"
	"io"
	"log/slog"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"worker/internal/outbox"
	"worker/internal/pgtest"
	"worker/internal/testkit"
)

// DrainRate inserts events over aggregates into a fresh database, lets a
// relay with cfg publish them all through s, and returns events per second
// from the relay's start to the last PUBLISHED row. Benchmarks compare a
// broker sink with the log sink in the same round this way.
func DrainRate(t testing.TB, s outbox.Sink, cfg outbox.Config, events, aggregates int) float64 {
	db := pgtest.New(t)
	if _, err := db.Pool.Exec(t.Context(), `
INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload, headers)
SELECT 'Order', 'agg-' || (g % $2), 'order.updated', jsonb_build_object('n', g, 'note', 'a payload of a realistic size, about a hundred bytes'),
       jsonb_build_object('traceparent', '00-' || lpad(to_hex(g), 32, '0') || '-' || lpad(to_hex(g), 16, '0') || '-01')
FROM generate_series(1, $1) g ORDER BY g`, events, aggregates); err != nil {
		t.Fatal(err)
	}
	if _, err := db.Pool.Exec(t.Context(), `VACUUM ANALYZE outbox_event`); err != nil {
		t.Fatal(err)
	}
	r, err := outbox.NewRelay(db.Pool, s, cfg, "drain", slog.New(slog.DiscardHandler), prometheus.NewRegistry())
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	if err := r.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	defer func() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		_ = r.Shutdown(ctx)
	}()
	var done time.Duration
	testkit.Eventually(t, 10*time.Minute, "the drain", func() bool {
		var left bool
		if err := db.Pool.QueryRow(t.Context(), `SELECT EXISTS (SELECT 1 FROM outbox_event WHERE status <> 'PUBLISHED')`).Scan(&left); err != nil {
			t.Fatal(err)
		}
		if left {
			return false
		}
		done = time.Since(start)
		return true
	})
	return float64(events) / done.Seconds()
}

// LogSink is the reference sink of DrainRate comparisons: the log sink
// writing to nowhere.
func LogSink() outbox.Sink { return outbox.NewLogSink(io.Discard) }

// BenchDrain is the broker sinks' benchmark: per round, drain 100,000
// events over 1,000 aggregates through the log sink and then through the
// sink newSink builds, with one relay and batches of 500 (the relay's other
// settings at their defaults), and report both rates and their ratio.
func BenchDrain(b *testing.B, name string, newSink func(testing.TB) outbox.Sink) {
	const events, aggregates = 100_000, 1_000
	cfg := outbox.DefaultConfig()
	cfg.BatchSize = 500
	var logRate, rate float64
	for range b.N {
		logRate += DrainRate(b, LogSink(), cfg, events, aggregates)
		rate += DrainRate(b, newSink(b), cfg, events, aggregates)
	}
	b.ReportMetric(logRate/float64(b.N), "log-events/s")
	b.ReportMetric(rate/float64(b.N), name+"-events/s")
	b.ReportMetric(rate/logRate, name+"/log")
}
