package main

import (
	"context"
	"encoding/csv"
	"fmt"
	"os"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker/internal/soak/load"
)

// row is one minute's sample.
type row struct {
	at         time.Duration // since the start
	rssMB      []float64     // per replica
	goroutines []float64
	conns      []float64
	started    []time.Duration // when each replica last started, since the start
	backlog    float64         // outbox events not yet published
	p99ms      float64         // first deliveries' latency over the minute
	partitions float64
	// sizes in MB: the outbox's and the inbox's tables and
	// their indexes
	tableMB, indexMB float64
	delivered        int
}

type recorder struct {
	began    time.Time
	replicas []*replica
	pool     *pgxpool.Pool
	recv     *load.Receiver
	rows     []row
	f        *os.File
	w        *csv.Writer
}

func (c *recorder) open(path string) error {
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	c.f, c.w = f, csv.NewWriter(f)
	head := []string{"minute"}
	for i := range c.replicas {
		head = append(head, fmt.Sprintf("rss_mb_%d", i), fmt.Sprintf("goroutines_%d", i), fmt.Sprintf("db_conns_%d", i))
	}
	head = append(head, "outbox_backlog", "delivery_p99_ms", "partitions", "tables_mb", "indexes_mb", "events_delivered")
	return c.w.Write(head)
}

func (c *recorder) close() {
	c.w.Flush()
	_ = c.f.Close()
}

func (c *recorder) sample(ctx context.Context) error {
	r := row{at: time.Since(c.began)}
	for _, rep := range c.replicas {
		rss, _ := rep.metric("process_resident_memory_bytes")
		r.rssMB = append(r.rssMB, rss/(1<<20))
		r.goroutines = append(r.goroutines, rep.floor())
		r.conns = append(r.conns, float64(rep.dbConns()))
		r.started = append(r.started, rep.startedAt.Sub(c.began))
	}
	p99, _ := c.recv.LatencyP99()
	r.p99ms = float64(p99.Milliseconds())
	r.delivered = c.recv.Firsts()
	qctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	var table, index int64
	err := c.pool.QueryRow(qctx, `SELECT
		(SELECT count(*) FROM outbox_event_state WHERE status <> 'PUBLISHED'),
		(SELECT count(*) FROM outbox_partition),
		(SELECT coalesce(sum(pg_table_size(c.oid)), 0) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
			WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p') AND c.relname ~ '^(outbox|inbox)_'),
		(SELECT coalesce(sum(pg_indexes_size(c.oid)), 0) FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace
			WHERE n.nspname = 'public' AND c.relkind IN ('r', 'p') AND c.relname ~ '^(outbox|inbox)_')`).
		Scan(&r.backlog, &r.partitions, &table, &index)
	if err != nil {
		return fmt.Errorf("sampling the database: %w", err)
	}
	r.tableMB, r.indexMB = float64(table)/(1<<20), float64(index)/(1<<20)
	c.rows = append(c.rows, r)
	rec := []string{strconv.Itoa(int(r.at.Round(time.Minute) / time.Minute))}
	for i := range c.replicas {
		rec = append(rec, ff(r.rssMB[i]), ff(r.goroutines[i]), ff(r.conns[i]))
	}
	rec = append(rec, ff(r.backlog), ff(r.p99ms), ff(r.partitions), ff(r.tableMB), ff(r.indexMB), strconv.Itoa(r.delivered))
	if err := c.w.Write(rec); err != nil {
		return err
	}
	c.w.Flush()
	fmt.Fprintf(os.Stderr, "soak: minute %s: %v\n", rec[0], rec[1:])
	return c.w.Error()
}

func ff(v float64) string { return strconv.FormatFloat(v, 'f', 1, 64) }

// growth is one resource's change over the judged window.
type growth struct {
	name       string
	from, to   float64
	fromMinute int
	judged     bool
	note       string // why not judged
}

func (g growth) grew() bool {
	return g.judged && g.to > g.from*(1+maxGrowth)+slack(g.name)
}

// slack is the change a resource may show without a leak. Goroutines
// follow the HTTP connections open at the moment (two or three each, in
// the webhook sink's pool and the inbox's server), whose number follows
// the publish concurrency of the last minutes: 80 to 190 in a 10-minute
// run without a leak. A connection or two comes and goes, and the backlog
// is whatever the last second's events are.
func slack(name string) float64 {
	switch name[:3] {
	case "gor":
		return 100
	case "db_":
		return 2
	case "out":
		return eventsPerSec
	}
	return 0
}

// growth compares, for each resource, its first samples in the window
// (from minute 10, or the midpoint of a run of 20 minutes or less) with
// its last ones. A replica's figures count from when its pools and
// caches have filled, a minute after the run's start or 3 after a restart; the table sizes and the partition
// count only once retention has come round (they grow until then by
// design).
func (c *recorder) growth(d time.Duration) []growth {
	from := 10 * time.Minute
	if d <= 20*time.Minute {
		from = d / 2
	}
	var out []growth
	judge := func(name string, start time.Duration, v func(row) float64, note string) {
		g := growth{name: name, note: note}
		var in []row
		for _, r := range c.rows {
			if r.at+time.Second >= start {
				in = append(in, r)
			}
		}
		// The least of the first k samples against the least of the last
		// k (k up to 3): a level that moves with the work of the moment
		// (idle connections of a client, a backlog) is not a leak, and a
		// leak raises the floor.
		floor := func(rows []row) float64 {
			least := v(rows[0])
			for _, r := range rows[1:] {
				least = min(least, v(r))
			}
			return least
		}
		if k := min(3, len(in)/2); k > 0 && note == "" {
			g.from, g.to, g.judged = floor(in[:k]), floor(in[len(in)-k:]), true
			g.fromMinute = int(in[0].at.Round(time.Minute) / time.Minute)
		} else if g.note == "" {
			g.note = fmt.Sprintf("not judged: fewer than two samples from minute %.0f on", start.Minutes())
		}
		out = append(out, g)
	}
	last := c.rows[len(c.rows)-1]
	for i := range c.replicas {
		// A replica restarted mid-run is judged from 3 minutes after its
		// start: a minute after it, it was still opening its connections
		// (25 goroutines and 46 MB, where it settles at 130-190 and 50-55
		// MB), so its first sample read as the floor of a growth.
		warm := time.Minute
		if last.started[i] > time.Minute {
			warm = 3 * time.Minute
		}
		start := max(from, last.started[i]+warm)
		judge(fmt.Sprintf("rss_mb_%d", i), start, func(r row) float64 { return r.rssMB[i] }, "")
		judge(fmt.Sprintf("goroutines_%d", i), start, func(r row) float64 { return r.goroutines[i] }, "")
		judge(fmt.Sprintf("db_conns_%d", i), start, func(r row) float64 { return r.conns[i] }, "")
	}
	judge("outbox_backlog", from, func(r row) float64 { return r.backlog }, "")
	steady := max(from, retention+2*partitionEvery)
	judge("partitions", steady, func(r row) float64 { return r.partitions }, "")
	judge("tables_mb", steady, func(r row) float64 { return r.tableMB }, "")
	judge("indexes_mb", steady, func(r row) float64 { return r.indexMB }, "")
	return out
}
