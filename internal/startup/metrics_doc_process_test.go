package startup_test

import (
	"fmt"
	"maps"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// metricsDocRow is one row of docs/metrics.md's table.
type metricsDocRow struct {
	line   int      // in docs/metrics.md
	labels []string // sorted
}

// metricsDocRows reads docs/metrics.md's table: each metric with the
// rows that name it (more than one is a mistake the caller reports).
func metricsDocRows(t *testing.T) map[string][]metricsDocRow {
	t.Helper()
	b, err := os.ReadFile("../../docs/metrics.md")
	if err != nil {
		t.Fatal(err)
	}
	backticked := regexp.MustCompile("`([a-z_]+)`")
	rows := map[string][]metricsDocRow{}
	for i, line := range strings.Split(string(b), "\n") {
		cols := strings.Split(line, "|")
		if len(cols) < 4 || !strings.HasPrefix(strings.TrimSpace(cols[1]), "`") {
			continue
		}
		labels := []string{}
		for _, m := range backticked.FindAllStringSubmatch(cols[2], -1) {
			labels = append(labels, m[1])
		}
		slices.Sort(labels)
		name := strings.Trim(strings.TrimSpace(cols[1]), "`")
		rows[name] = append(rows[name], metricsDocRow{line: i + 1, labels: labels})
	}
	if len(rows) < 20 {
		t.Fatalf("read %d rows from docs/metrics.md's table", len(rows))
	}
	return rows
}

// docs/metrics.md's table is the worker's metrics: every family a worker
// with every part running exports (the Go, process and HTTP handler
// collectors' aside) has exactly one row, with exactly its labels, and
// every row is a metric it exports.
func TestMetricsDocMatchesTheWorker(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	cfg := writeConfig(t, `jobs:
  - {name: tick, kind: sql, sql: "SELECT 1", delay: 1h, initial_delay: 1h}
tasks:
  kinds:
    - {name: ping, type: sql, sql: "SELECT $1"}
    - {name: notify, type: http, url: "http://127.0.0.1:1/notify"}
`+inboxSourceYAML(t))
	p := startWorker(t, []string{"APP_DATABASE_URL=" + db.URL, cfg, "APP_MULTI_INSTANCE_ENABLED=true", "APP_LOCK_PROVIDER=postgres",
		"APP_OUTBOX_METRICS_INTERVAL=100ms", "APP_TASKS_METRICS_INTERVAL=100ms"})
	p.waitReady(t, 15*time.Second)
	// The outbox and task gauges appear with their first refresh.
	var families map[string][]string
	testkit.Eventually(t, 10*time.Second, "the refreshed gauges", func() bool {
		_, families = scrape(t, p)
		// A scrape may land between two gauges of one refresh.
		return families["outbox_pending_size"] != nil && families["outbox_publisher_lag_seconds"] != nil && families["tasks"] != nil
	})

	rows := metricsDocRows(t)
	var missing, wrong, extra, twice []string
	for _, name := range slices.Sorted(maps.Keys(families)) {
		if strings.HasPrefix(name, "go_") || strings.HasPrefix(name, "process_") || strings.HasPrefix(name, "promhttp_") {
			continue
		}
		labels := slices.Sorted(slices.Values(families[name]))
		doc, ok := rows[name]
		switch {
		case !ok:
			missing = append(missing, fmt.Sprintf("| `%s` | %s | ... |", name, backtickList(labels)))
		case len(doc) == 1 && !slices.Equal(doc[0].labels, labels):
			wrong = append(wrong, fmt.Sprintf("docs/metrics.md:%d: %s has the labels %v in the table, %v in /metrics", doc[0].line, name, doc[0].labels, labels))
		}
	}
	for _, name := range slices.Sorted(maps.Keys(rows)) {
		if _, ok := families[name]; !ok {
			extra = append(extra, fmt.Sprintf("docs/metrics.md:%d: %s", rows[name][0].line, name))
		}
		if len(rows[name]) > 1 {
			var lines []string
			for _, r := range rows[name] {
				lines = append(lines, fmt.Sprint(r.line))
			}
			twice = append(twice, fmt.Sprintf("%s on lines %s", name, strings.Join(lines, ", ")))
		}
	}
	for _, problem := range []struct {
		what string
		list []string
	}{
		{"metrics the worker exports without a row in docs/metrics.md's table (add these rows)", missing},
		{"rows of docs/metrics.md's table naming metrics the worker does not export (remove or rename them)", extra},
		{"metrics with more than one row in docs/metrics.md's table (keep one)", twice},
		{"rows whose labels differ from the exported ones", wrong},
	} {
		if len(problem.list) > 0 {
			t.Errorf("%s:\n\t%s", problem.what, strings.Join(problem.list, "\n\t"))
		}
	}
}

func backtickList(labels []string) string {
	quoted := make([]string, len(labels))
	for i, l := range labels {
		quoted[i] = "`" + l + "`"
	}
	return strings.Join(quoted, ", ")
}
