package pgtest

import (
	"context"
	"fmt"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
)

// A test that asks for more than the share has free waits until another
// gives its slots back.
func TestReserveWaitsForFreeSlots(t *testing.T) {
	// A server URL of its own gives this test slots of its own.
	t.Setenv("WORKER_TEST_DATABASE_URL", AdminURL()+"&application_name=slots-test")
	t.Setenv("WORKER_TEST_MAX_CONNS", "5")
	taken := make(chan int)
	t.Run("holder", func(h *testing.T) {
		Reserve(h, 3)
		go func() {
			files, _ := admit(t, maxConns(t), 3)
			for _, f := range files {
				f.Close()
			}
			taken <- len(files)
		}()
		select {
		case n := <-taken:
			h.Fatalf("took %d slots while 3 of 5 were held", n)
		case <-time.After(300 * time.Millisecond):
		}
	}) // the holder's slots are given back here
	select {
	case n := <-taken:
		if n != 3 {
			t.Fatalf("took %d slots, want 3", n)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("3 slots still not taken 10s after the holder gave its back")
	}
}

// A test never holds more than the whole share, so it cannot wait for itself.
func TestReserveStopsAtTheShare(t *testing.T) {
	t.Setenv("WORKER_TEST_DATABASE_URL", AdminURL()+"&application_name=slots-test-2")
	t.Setenv("WORKER_TEST_MAX_CONNS", "5")
	Reserve(t, 4)
	Reserve(t, 4) // would wait for ever if it asked for 4 more
	heldMu.Lock()
	defer heldMu.Unlock()
	if held[t.Name()] != 5 {
		t.Fatalf("holds %d, want the share of 5", held[t.Name()])
	}
}

// A server with no free connection is reported as that, not as a server
// that is not running. A role's connection limit gets the same refusal
// (SQLSTATE 53300) as max_connections without exhausting the server.
func TestNoFreeConnectionIsReportedAsSuch(t *testing.T) {
	ctx := context.Background()
	admin := connect(t, ctx, AdminURL())
	role := "worker_test_full_" + randHex(4)
	if _, err := admin.Exec(ctx, fmt.Sprintf("CREATE ROLE %s LOGIN CONNECTION LIMIT 0", role)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := admin.Exec(ctx, "DROP ROLE "+role); err != nil {
			t.Errorf("drop role %s: %v", role, err)
		}
		admin.Close(ctx)
	})
	u, err := url.Parse(AdminURL())
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User(role)
	_, err = pgx.Connect(ctx, u.String())
	if !tooManyClients(err) {
		t.Fatalf("want SQLSTATE 53300, got %v", err)
	}
	msg := connectFailure(u.String(), err)
	if !strings.Contains(msg, "no free connection (too many clients, SQLSTATE 53300)") || strings.Contains(msg, "is required") {
		t.Errorf("message: %s", msg)
	}
}
