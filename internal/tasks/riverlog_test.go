package tasks

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"strings"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
)

// River's ERRORs about a lost database connection are WARNs (the worker
// says once that the database is unreachable); its other ERRORs stay.
func TestRiverConnectionErrorsAreWarnings(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name string
		err  any
		want string
	}{
		{"refused, as text", "failed to connect to `user=xxxxx database=worker`: dial error: connect: connection refused", "WARN"},
		{"sessions ended, as text", "FATAL: terminating connection due to administrator command (SQLSTATE 57P01)", "WARN"},
		{"server starting, as an error", fmt.Errorf("fetch: %w", &pgconn.PgError{Severity: "FATAL", Code: "57P03"}), "WARN"},
		{"a failing statement", &pgconn.PgError{Severity: "ERROR", Code: "42P01", Message: `relation "river_job" does not exist`}, "ERROR"},
		{"another error", errors.New("job args do not decode"), "ERROR"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			var out bytes.Buffer
			log := slog.New(warnAndAbove{slog.NewJSONHandler(&out, nil)})
			log.ErrorContext(context.Background(), "producer: Error fetching jobs", "err", c.err)
			if !strings.Contains(out.String(), `"level":"`+c.want+`"`) || !strings.Contains(out.String(), `"err":`) {
				t.Errorf("logged %s; want level %s with the error kept", out.String(), c.want)
			}
		})
	}
}
