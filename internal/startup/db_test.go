package startup

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
)

// A wrong password cannot be provoked against the local server (it trusts
// 127.0.0.1), so the classification of PostgreSQL's answers is checked here
// on the errors it sends; the process test covers an unknown role for real.
func TestPermanentDBErrors(t *testing.T) {
	t.Parallel()
	const url = "postgres://app:hunter2@db.internal:5432/app"
	cases := []struct {
		code, msg string
		want      int
	}{
		{"28P01", `password authentication failed for user "app"`, ExitNoPerm},
		{"28000", `no pg_hba.conf entry for host "10.0.0.1", user "app", database "app", no encryption`, ExitNoPerm},
		{"3D000", `database "app" does not exist`, ExitNoInput},
		{"57P03", "the database system is starting up", -1}, // retried
	}
	for _, c := range cases {
		err := permanentDBError(fmt.Errorf("failed to connect: %w", &pgconn.PgError{Code: c.code, Message: c.msg}), url)
		if c.want == -1 {
			if err != nil {
				t.Errorf("%s: %v, want it retried", c.code, err)
			}
			continue
		}
		if ExitCode(err) != c.want || strings.Contains(err.Error(), "hunter2") || !strings.Contains(err.Error(), "xxxxx@db.internal") {
			t.Errorf("%s: %v (exit %d), want exit %d naming the masked URL", c.code, err, ExitCode(err), c.want)
		}
		var pgErr *pgconn.PgError
		if !errors.As(err, &pgErr) {
			t.Errorf("%s: the cause is lost", c.code)
		}
	}
	if err := permanentDBError(errors.New("dial tcp: connection refused"), url); err != nil {
		t.Errorf("a network error is an outage, retried: %v", err)
	}
}

// A server that accepts the connection but never answers (a listener that
// does not accept: the kernel completes the handshake) is an outage, exit
// 69, and the message says that it did not answer rather than only
// "context deadline exceeded".
func TestConnectToSilentServerSaysNoAnswer(t *testing.T) {
	t.Parallel()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	cfg, err := LoadConfig("", []string{"APP_DATABASE_URL=postgres://app:hunter2@" + ln.Addr().String() + "/app?sslmode=disable",
		"APP_DATABASE_CONNECT_TIMEOUT=1s"})
	if err != nil {
		t.Fatal(err)
	}
	pool, err := connectDB(context.Background(), cfg, slog.New(slog.DiscardHandler))
	if err == nil {
		pool.Close()
		t.Fatal("connected to a server that never answers")
	}
	if ExitCode(err) != ExitUnavailable || !strings.Contains(err.Error(), "no answer within 1s") ||
		!strings.Contains(err.Error(), ln.Addr().String()) || strings.Contains(err.Error(), "hunter2") {
		t.Errorf("%v (exit %d); want exit %d, the address, \"no answer within 1s\" and no password", err, ExitCode(err), ExitUnavailable)
	}
}
