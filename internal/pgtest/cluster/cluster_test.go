package cluster_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"

	"github.com/worker-dev/worker/internal/pgtest/cluster"
)

// The private server survives what the fault tests do to it: a session is
// ended by TerminateBackends, and a row committed before a fast restart
// and before a crash is there after each.
func TestClusterRestartsCrashesAndEndsSessions(t *testing.T) {
	t.Parallel()
	c := cluster.New(t)
	ctx := t.Context()
	if err := c.Exec(ctx, "postgres", "CREATE TABLE kept (n int)"); err != nil {
		t.Fatal(err)
	}
	cfg, err := pgx.ParseConfig(c.URL("postgres"))
	if err != nil {
		t.Fatal(err)
	}
	cfg.RuntimeParams["application_name"] = "victim"
	victim, err := pgx.ConnectConfig(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer victim.Close(context.Background())
	if n, err := c.TerminateBackends(ctx, "victim"); err != nil || n != 1 {
		t.Fatalf("TerminateBackends: %d sessions, %v; want 1", n, err)
	}
	if _, err := victim.Exec(ctx, "SELECT 1"); err == nil {
		t.Fatal("the ended session still answers")
	}
	count := func() int {
		conn, err := pgx.Connect(ctx, c.URL("postgres"))
		if err != nil {
			t.Fatal(err)
		}
		defer conn.Close(ctx)
		var n int
		if err := conn.QueryRow(ctx, "SELECT count(*) FROM kept").Scan(&n); err != nil {
			t.Fatal(err)
		}
		return n
	}
	if err := c.Exec(ctx, "postgres", "INSERT INTO kept VALUES (1)"); err != nil {
		t.Fatal(err)
	}
	if err := c.Restart(); err != nil {
		t.Fatal(err)
	}
	if n := count(); n != 1 {
		t.Fatalf("%d rows after a fast restart, want 1", n)
	}
	if err := c.Exec(ctx, "postgres", "INSERT INTO kept VALUES (2)"); err != nil {
		t.Fatal(err)
	}
	if err := c.StopImmediate(); err != nil {
		t.Fatal(err)
	}
	if err := c.Exec(ctx, "postgres", "SELECT 1"); err == nil {
		t.Fatal("the server answers after an immediate stop")
	}
	if err := c.Start(); err != nil {
		t.Fatal(err)
	}
	if n := count(); n != 2 {
		t.Fatalf("%d rows after crash recovery, want 2", n)
	}
}
