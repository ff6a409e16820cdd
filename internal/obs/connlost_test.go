package obs

import (
	"context"
	"errors"
	"fmt"
	"io"
	"testing"

	"github.com/jackc/pgx/v5/pgconn"
)

func TestConnectionLost(t *testing.T) {
	t.Parallel()
	cases := []struct {
		err  error
		want bool
	}{
		{fmt.Errorf("claim: %w", &pgconn.PgError{Code: "57P01"}), true}, // pg_terminate_backend, a fast shutdown
		{&pgconn.PgError{Code: "57P03"}, true},                          // starting up, shutting down
		{&pgconn.PgError{Code: "08006"}, true},
		{fmt.Errorf("renew: %w", io.ErrUnexpectedEOF), true},
		{errors.New("failed to connect to `user=xxxxx database=app`: dial error: connection refused"), true},
		{&pgconn.PgError{Code: "23505"}, false}, // a statement's own failure
		{errors.New("job args do not decode"), false},
		{fmt.Errorf("run: %w", context.DeadlineExceeded), false}, // a job's own timeout
		{nil, false},
	}
	for _, c := range cases {
		if got := ConnectionLost(c.err); got != c.want {
			t.Errorf("ConnectionLost(%v) = %v, want %v", c.err, got, c.want)
		}
	}
}
