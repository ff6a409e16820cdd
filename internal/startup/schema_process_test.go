package startup_test

import (
	"context"
	"fmt"
	"net/http"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/migrate"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// schemaLines are the worker's log lines that carry SCHEMA_VERSION_MISMATCH.
func schemaLines(t *testing.T, p *proc) []map[string]any {
	t.Helper()
	var out []map[string]any
	for _, m := range p.out.Lines(t, "") {
		if m["error.code"] == "SCHEMA_VERSION_MISMATCH" {
			out = append(out, m)
		}
	}
	return out
}

// A database that a newer release migrated (its goose version ahead of
// this binary's, as a V1 replica finds after the V2 cutover, or any
// replica after a rollback of the image): `run` never becomes ready and
// exits 78 with one ERROR line that names the code and both versions;
// `worker migrate` refuses it the same way, and migrates nothing.
func TestStartRefusesADatabaseOfANewerRelease(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	want := migrate.Want()
	ahead := want + 10
	if _, err := db.Pool.Exec(context.Background(), `INSERT INTO goose_db_version (version_id, is_applied) VALUES ($1, true)`, ahead); err != nil {
		t.Fatal(err)
	}
	for _, args := range [][]string{nil, {"migrate"}} {
		t.Run(fmt.Sprint(append([]string{"worker"}, args...)), func(t *testing.T) {
			p := startWorker(t, append([]string{"APP_DATABASE_URL=" + db.URL}, replicaOnly...), args...)
			if code := p.exitCode(t, 60*time.Second); code != 78 {
				t.Fatalf("exit %d, want 78", code)
			}
			if code, _ := p.get("/readyz"); code == http.StatusOK {
				t.Error("/readyz answered 200")
			}
			lines := schemaLines(t, p)
			if len(lines) != 1 {
				t.Fatalf("%d lines with error.code SCHEMA_VERSION_MISMATCH, want 1", len(lines))
			}
			l := lines[0]
			msg := fmt.Sprint(l["error"])
			if l["level"] != "ERROR" || !strings.Contains(msg, fmt.Sprintf("schema version %d is newer than this worker's %d", ahead, want)) ||
				!strings.Contains(msg, "APP_DATABASE_URL") || fmt.Sprint(l["exit_code"]) != "78" {
				t.Errorf("the line does not say which version it found and which it needs, at ERROR with exit 78: %v", l)
			}
		})
	}
}

// A running replica whose database moves to another schema version, newer
// (another release migrated it) or older (someone rolled a migration
// back), turns not ready within a check period and logs one ERROR for the
// whole stretch, however many checks see it; it is ready again, with one
// INFO line, when the versions match again.
func TestRunningReplicaIsNotReadyOnAnotherSchemaVersion(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	ctx := context.Background()
	want := migrate.Want()
	p := startWorker(t, append([]string{"APP_DATABASE_URL=" + db.URL}, replicaOnly...))
	p.waitReady(t, 60*time.Second)

	// Long enough for the check period, the readiness cache and a loaded
	// machine; measured below.
	const within = 20 * time.Second
	const schemaCheckEvery = 5 * time.Second // startup.schemaCheckEvery
	for i, c := range []struct {
		name, change, undo string
	}{
		{"newer", `INSERT INTO goose_db_version (version_id, is_applied) VALUES ($1 + 1, true)`,
			`DELETE FROM goose_db_version WHERE version_id = $1 + 1`},
		{"older", `DELETE FROM goose_db_version WHERE version_id = $1`,
			`INSERT INTO goose_db_version (version_id, is_applied) VALUES ($1, true)`},
	} {
		if _, err := db.Pool.Exec(ctx, c.change, want); err != nil {
			t.Fatal(err)
		}
		found, err := migrate.Version(ctx, db.Pool)
		if err != nil {
			t.Fatal(err)
		}
		notReadyWords := fmt.Sprintf("schema version %d, this worker needs %d", found, want)
		changed := time.Now()
		testkit.Eventually(t, within, c.name+": /readyz to say not ready", func() bool {
			code, body := p.get("/readyz")
			return code == http.StatusServiceUnavailable && strings.Contains(body, notReadyWords)
		})
		t.Logf("%s: not ready %s after the change (check period %s)", c.name, time.Since(changed).Round(time.Millisecond), schemaCheckEvery)
		// Held for more than a check period: it stays not ready, and the
		// checks in between add no line.
		for hold := time.Now(); time.Since(hold) < schemaCheckEvery+time.Second; time.Sleep(100 * time.Millisecond) {
			if code, body := p.get("/readyz"); code != http.StatusServiceUnavailable {
				t.Fatalf("%s: /readyz %d %q while the schema is still another", c.name, code, body)
			}
		}
		if _, body := p.get("/metrics"); !strings.Contains(body, "\nworker_ready 0\n") {
			t.Errorf("%s: worker_ready is not 0", c.name)
		}
		if _, err := db.Pool.Exec(ctx, c.undo, want); err != nil {
			t.Fatal(err)
		}
		undone := time.Now()
		p.waitReady(t, within)
		t.Logf("%s: ready again %s after the undo", c.name, time.Since(undone).Round(time.Millisecond))

		lines := schemaLines(t, p)
		if len(lines) != i+1 {
			t.Fatalf("%s: %d lines with SCHEMA_VERSION_MISMATCH, want %d: one per mismatch", c.name, len(lines), i+1)
		}
		l := lines[i]
		if l["level"] != "ERROR" || fmt.Sprint(l["schema_version"]) != fmt.Sprint(found) || fmt.Sprint(l["schema_version_needed"]) != fmt.Sprint(want) {
			t.Errorf("%s: the line does not say which version it found (%d) and which it needs (%d), at ERROR: %v", c.name, found, want, l)
		}
		if n := len(p.out.Lines(t, "database schema version is this worker's again; ready")); n != i+1 {
			t.Errorf("%s: %d INFO lines for the recovery, want %d", c.name, n, i+1)
		}
	}
	if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if code := p.exitCode(t, 30*time.Second); code != 0 {
		t.Fatalf("exit %d after SIGTERM, want 0", code)
	}
}
