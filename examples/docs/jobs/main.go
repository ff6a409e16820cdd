// Command jobs is the Go job of docs/jobs.md: the stock worker plus one job
// that writes through worker.InTx, so that its transaction commits only
// while the job's lease is held.
package main

import (
	"context"
	"os"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/worker-dev/worker"
)

func refreshCache(ctx context.Context) error {
	return worker.InTx(ctx, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `UPDATE report_cache SET orders = (SELECT count(*) FROM orders), refreshed_at = now()`)
		return err
	})
}

func main() {
	os.Exit(worker.Run(os.Args[1:],
		worker.WithJob(worker.Job{Name: "refresh-report-cache", Delay: time.Minute, Timeout: 30 * time.Second, Run: refreshCache}),
	))
}
