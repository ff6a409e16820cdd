// Command shop is a worker binary of its own: the stock worker plus a Go
// job, a Go task kind, a custom outbox sink, and the shop's own HTTP API,
// whose handlers write a business row, an outbox event and a task in one
// transaction.
//
// It reads the worker's configuration (APP_* variables, configs/worker.yaml)
// and SHOP_ADDR, the address of the shop's API.
package main

import (
	"context"
	"fmt"
	"net"
	"net/http"
	"os"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker"
	"github.com/worker-dev/worker/outbox"
)

func main() { os.Exit(run()) }

func run() int {
	// pgxpool connects on first use, so the operator commands (`shop config
	// print`, `shop outbox stats`, ...) never reach the database through it.
	db, err := pgxpool.New(context.Background(), os.Getenv("APP_DATABASE_URL"))
	if err != nil {
		fmt.Fprintln(os.Stderr, "shop:", err)
		return 78
	}
	defer db.Close()

	return worker.Run(os.Args[1:],
		worker.WithJob(worker.Job{Name: "close-stale-orders", Delay: 200 * time.Millisecond, Run: closeStaleOrders}),
		worker.WithTaskKind(&ReceiptWorker{DB: db}),
		worker.WithSink("ledger", func(ctx context.Context) (outbox.Sink, error) {
			return newLedgerSink(ctx, os.Getenv("APP_DATABASE_URL"))
		}),
		// The shop's own API starts only when `run` is ready, and stops
		// when shutdown begins.
		worker.WithOnReady(func(ctx context.Context) { serveAPI(ctx, db) }),
	)
}

// serveAPI creates the shop's tables and serves its API until ctx is
// cancelled, then lets requests in progress finish.
func serveAPI(ctx context.Context, db *pgxpool.Pool) {
	if err := createTables(ctx, db); err != nil {
		fmt.Fprintln(os.Stderr, "shop:", err)
		return
	}
	schemaReady.Store(true)
	ln, err := net.Listen("tcp", envOr("SHOP_ADDR", "127.0.0.1:8080"))
	if err != nil {
		fmt.Fprintln(os.Stderr, "shop:", err)
		return
	}
	// The address, for whoever started the shop on port 0 (its test).
	fmt.Println("shop listening on", ln.Addr())
	srv := &http.Server{Handler: api(db), ReadHeaderTimeout: 5 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	<-ctx.Done()
	sctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = srv.Shutdown(sctx)
	fmt.Println("shop stopped")
}

// schemaReady is set once the shop's tables exist: the job has nothing to
// do before.
var schemaReady atomic.Bool

// createTables is the shop's own schema; the worker migrates its own.
func createTables(ctx context.Context, db *pgxpool.Pool) error {
	_, err := db.Exec(ctx, `
CREATE TABLE IF NOT EXISTS shop_order (id text PRIMARY KEY, placed_at timestamptz NOT NULL DEFAULT now(), closed boolean NOT NULL DEFAULT false);
CREATE TABLE IF NOT EXISTS shop_sweep (id bigserial PRIMARY KEY, fencing_token bigint NOT NULL, closed int NOT NULL);
CREATE TABLE IF NOT EXISTS shop_receipt (id bigserial PRIMARY KEY, order_id text NOT NULL, task_id bigint NOT NULL);
CREATE TABLE IF NOT EXISTS shop_ledger (id bigserial PRIMARY KEY, event_id uuid NOT NULL, aggregate_id text NOT NULL, event_type text NOT NULL);`)
	return err
}

func envOr(name, def string) string {
	if v := os.Getenv(name); v != "" {
		return v
	}
	return def
}
