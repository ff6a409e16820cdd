package worker

import (
	"encoding/csv"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/worker-dev/worker/internal/pgtest"
)

// scripts/bench at tiny sizes, every phase once, so that it stays
// runnable: it must finish, print its table and write a CSV with a row per
// phase and a plot. Its figures are not judged here.
func TestBenchScript(t *testing.T) {
	t.Parallel()
	// Two workers at once, each a pool of 3 (2 relays need more than 2), its
	// outbox and lease listeners and a lease pool of 2, without tasks; the
	// benchmark's own 3 sessions, and pgbench's 4.
	pgtest.Reserve(t, 2*(3+1+2+1)+3+4)
	admin, err := url.Parse(pgtest.AdminURL())
	if err != nil {
		t.Fatal(err)
	}
	out := t.TempDir()
	db := "bench_binary_" + strings.ToLower(strings.NewReplacer("/", "_").Replace(t.Name()))
	cmd := exec.Command("scripts/bench",
		"-db", db, "-events", "300", "-aggregates", "20", "-rates", "50", "-rate-for", "1s",
		"-slow", "20ms", "-slow-events", "40",
		"-worker-env", "APP_DATABASE_MAX_CONNS=3", "-worker-env", "APP_TASKS_ENABLED=false")
	pass, _ := admin.User.Password()
	cmd.Env = append(withoutAppEnv(os.Environ()),
		"ROUNDS=1", "PRODUCER=0", "OUT="+out, "GOFLAGS=-trimpath",
		"PGHOST="+admin.Hostname(), "PGPORT="+admin.Port(), "PGUSER="+admin.User.Username(), "PGPASSWORD="+pass)
	stdout, err := cmd.Output()
	if err != nil {
		var stderr []byte
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = ee.Stderr
		}
		t.Fatalf("scripts/bench: %v\n%s\n%s", err, stdout, stderr)
	}
	for _, want := range []string{"| figure | min | median | max | target |", "default (log-1x1) ÷ loop", "latency-50 p99 ms", "slow-20 from the commit"} {
		if !strings.Contains(string(stdout), want) {
			t.Errorf("the table lacks %q:\n%s", want, stdout)
		}
	}
	f, err := os.Open(filepath.Join(out, "bench.csv"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	rows, err := csv.NewReader(f).ReadAll()
	if err != nil {
		t.Fatal(err)
	}
	phases := map[string]bool{}
	for _, r := range rows[1:] {
		phases[r[2]] = true
	}
	for _, p := range []string{"loop", "log-1x1", "log-1x1-multi", "webhook-1x1", "webhook-1x1-multi", "log-1x2-multi", "log-2x2-multi", "webhook-2x1-multi", "latency-50", "slow-20"} {
		if !phases[p] {
			t.Errorf("bench.csv has no row of %s: %v", p, rows)
		}
	}
	if st, err := os.Stat(filepath.Join(out, "bench.png")); err != nil || st.Size() == 0 {
		t.Errorf("bench.png: %v", err)
	}
}
