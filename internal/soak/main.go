// Command soak runs two worker replicas at a steady load for a while and
// judges whether they leak: scripts/soak DURATION (docs/testing.md).
//
// A private PostgreSQL server (pgtest/cluster) holds the database. The
// replicas run in multi-instance mode with every part busy (the load
// package: a sql job every 500 ms, 300 outbox events a second over 100
// aggregates to a webhook receiver, 20 inbox webhooks and 20 sql tasks a
// second), with outbox partitions of a minute kept 5 minutes and inbox
// dedupe records kept a minute, so partitions and records are created and
// dropped all along. One replica is restarted (SIGTERM, then started
// again) every 10 minutes, the two in turn. Every minute it records each
// replica's RSS, goroutines and open database connections, the outbox's
// backlog, delivery latency p99 and partition count, and the tables' and
// indexes' sizes, to soak.csv, and at the end plots them to soak.png.
//
// The verdict: no event lost, nothing applied twice (inbox, tasks, a
// job's fencing token), and no resource grown by more than 10% from minute
// 10 to the end (for runs of 20 minutes or less, from the midpoint).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker/internal/pgtest/cluster"
	"github.com/worker-dev/worker/internal/soak/load"
)

const (
	aggregates     = 100
	eventsPerSec   = 300
	inboxPerSec    = 20
	tasksPerSec    = 20
	sampleEvery    = time.Minute
	restartEvery   = 10 * time.Minute
	maxGrowth      = 0.10
	drainLimit     = 3 * time.Minute
	partitionEvery = time.Minute
	retention      = 5 * time.Minute
)

func main() {
	out := flag.String("out", "", "directory for soak.csv, soak.png and the replicas' logs (default: a new temporary directory)")
	flag.Usage = func() {
		fmt.Fprintln(os.Stderr, "usage: scripts/soak [-out DIR] DURATION   (for example 2m, 60m)")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() != 1 {
		flag.Usage()
		os.Exit(64)
	}
	d, err := time.ParseDuration(flag.Arg(0))
	if err != nil || d < 2*sampleEvery {
		fmt.Fprintf(os.Stderr, "soak: DURATION %q: want a duration of at least 2m\n", flag.Arg(0))
		os.Exit(64)
	}
	if *out == "" {
		if *out, err = os.MkdirTemp("", "worker-soak-"); err != nil {
			log.Fatal(err)
		}
	} else if err := os.MkdirAll(*out, 0o755); err != nil {
		log.Fatal(err)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	passed, err := run(ctx, d, *out)
	if err != nil {
		fmt.Fprintln(os.Stderr, "soak:", err)
		os.Exit(1)
	}
	if !passed {
		os.Exit(1)
	}
}

func run(ctx context.Context, d time.Duration, out string) (bool, error) {
	bin := filepath.Join(out, "worker")
	build := exec.Command("go", "build", "-o", bin, "./cmd/worker")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		return false, fmt.Errorf("building the worker: %w", err)
	}
	db, err := cluster.Start()
	if err != nil {
		return false, fmt.Errorf("a private PostgreSQL server (scripts/services.sh ensure_postgres installs PostgreSQL): %w", err)
	}
	defer db.Close()
	if err := db.Exec(ctx, "postgres", "CREATE DATABASE worker"); err != nil {
		return false, err
	}
	pool, err := pgxpool.New(ctx, db.URL("worker")+"&pool_max_conns=4&application_name=soak")
	if err != nil {
		return false, err
	}
	defer pool.Close()
	if _, err := pool.Exec(ctx, load.Schema); err != nil {
		return false, err
	}
	recv := load.NewReceiver(aggregates)
	defer recv.Close()

	key := []byte("a-soak-webhook-secret-32-bytes!!")
	rs := make([]*replica, 2)
	var hooks []string
	for i := range rs {
		r, err := newReplica(i, bin, out, db.URL("worker"), recv.URL, key)
		if err != nil {
			return false, err
		}
		rs[i] = r
		hooks = append(hooks, "http://"+r.inboxAddr+"/hooks")
		// One after the other: the first applies the migrations.
		if err := r.start(); err != nil {
			return false, err
		}
		defer r.kill()
		stopWatch := make(chan struct{})
		defer close(stopWatch)
		go r.watchGoroutines(stopWatch)
	}
	prod := load.StartProducer(pool, aggregates, eventsPerSec)
	send := load.StartSender(hooks, key, inboxPerSec)
	enq := load.StartEnqueuer(pool, tasksPerSec)
	stopLoad := func() (int, int, int) { return prod.Stop(), send.Stop(), enq.Stop() }
	defer stopLoad()
	fmt.Fprintf(os.Stderr, "soak: %s, replicas' logs and figures in %s\n", d, out)

	began := time.Now()
	rec := &recorder{began: began, replicas: rs, pool: pool, recv: recv}
	if err := rec.open(filepath.Join(out, "soak.csv")); err != nil {
		return false, err
	}
	defer rec.close()
	sample := time.NewTicker(sampleEvery)
	defer sample.Stop()
	end := time.NewTimer(d)
	defer end.Stop()
	nextRestart, turn := began.Add(restartEvery), 0
loop:
	for {
		select {
		case <-ctx.Done():
			return false, errors.New("interrupted")
		case <-end.C:
			break loop
		case <-sample.C:
			if err := rec.sample(ctx); err != nil {
				return false, err
			}
			for _, r := range rs {
				if r.exited() {
					return false, fmt.Errorf("replica-%d exited by itself (see %s)", r.i, r.logPath)
				}
			}
			// Not in the last minute: a replica restarted then would be
			// judged on no sample.
			if time.Now().After(nextRestart) && time.Until(began.Add(d)) > sampleEvery {
				r := rs[turn%len(rs)]
				fmt.Fprintf(os.Stderr, "soak: %s: restarting replica-%d\n", time.Since(began).Round(time.Second), r.i)
				if err := r.restart(); err != nil {
					return false, err
				}
				nextRestart, turn = nextRestart.Add(restartEvery), turn+1
			}
		}
	}

	produced, taken, enqueued := stopLoad()
	v := verdict{duration: d, produced: produced, inboxTaken: taken, tasksEnqueued: enqueued}
	drainCtx, cancel := context.WithTimeout(ctx, drainLimit)
	defer cancel()
	for v.lost = recv.Lost(produced, aggregates); v.lost > 0 && drainCtx.Err() == nil; v.lost = recv.Lost(produced, aggregates) {
		time.Sleep(100 * time.Millisecond)
	}
	for {
		v.counts, err = load.Applied(ctx, pool, taken, enqueued)
		if err == nil && v.counts.TaskMissing == 0 || drainCtx.Err() != nil {
			break
		}
		time.Sleep(time.Second)
	}
	if err != nil {
		return false, err
	}
	if err := load.Jobs(ctx, pool, &v.counts); err != nil {
		return false, err
	}
	v.dups, v.outOfOrder = recv.Outcome()
	v.growth = rec.growth(d)
	if err := plotSamples(filepath.Join(out, "soak.png"), rec.rows, len(rs)); err != nil {
		return false, err
	}
	passed := v.print(os.Stdout)
	fmt.Printf("figures: %s, plot: %s\n", filepath.Join(out, "soak.csv"), filepath.Join(out, "soak.png"))
	return passed, nil
}
