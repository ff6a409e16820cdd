package inbox

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker/internal/inbox/inboxconfig"
	"github.com/worker-dev/worker/internal/obs"
)

// Runner runs every configured source's consumer, and the housekeeper.
type Runner struct {
	consumers []*Consumer
	sources   []Source
	hk        *Housekeeper
	pool      *pgxpool.Pool
	cfg       inboxconfig.Config
	log       *slog.Logger
	probeMax  time.Duration

	stop       context.CancelFunc // ends the sources' receiving: shutdown begins
	hardCancel context.CancelFunc // ends work in progress: the budget is spent
	wg         sync.WaitGroup
}

// Part is one source and what handles its messages.
type Part struct {
	Config  inboxconfig.SourceConfig
	Source  Source
	Handler Handler
}

// NewRunner returns the runner of parts, claiming as owner.
func NewRunner(pool *pgxpool.Pool, cfg inboxconfig.Config, parts []Part, owner string, log *slog.Logger, m *Metrics) *Runner {
	hard, hardCancel := context.WithCancel(context.Background())
	r := &Runner{
		hk:         newHousekeeper(pool, cfg, log, m),
		pool:       pool,
		cfg:        cfg,
		log:        log,
		probeMax:   cfg.ProbeBackoffMax,
		hardCancel: hardCancel,
	}
	for _, p := range parts {
		c := NewConsumer(pool, p.Config, cfg, p.Handler, owner, log, m)
		c.hard = hard
		r.consumers = append(r.consumers, c)
		r.sources = append(r.sources, p.Source)
	}
	return r
}

// Start starts every source and the housekeeper, and returns.
func (r *Runner) Start(ctx context.Context) error {
	ctx, r.stop = context.WithCancel(ctx)
	r.wg.Go(func() { r.hk.Run(ctx) })
	for n, src := range r.sources {
		c := r.consumers[n]
		r.wg.Go(func() { r.keep(ctx, c, src) })
	}
	r.wg.Go(func() { r.sweepLoop(ctx) })
	return nil
}

// sweepLoop runs orphaned claims every half lease: see orphans.
func (r *Runner) sweepLoop(ctx context.Context) {
	t := time.NewTicker(r.cfg.LeaseTTL / 2)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		if err := r.sweep(ctx); err != nil && ctx.Err() == nil {
			r.log.Warn("inbox sweep of expired claims failed; it runs again", "error", err)
		}
	}
}

// sweep runs one batch of orphaned claims through their consumers. It
func (r *Runner) sweep(ctx context.Context) error {
	rows, err := r.pool.Query(ctx, orphans, r.cfg.BatchSize)
	if err != nil {
		return err
	}
	byConsumer := map[string][]*Delivery{}
	for rows.Next() {
		var consumer string
		var m Message
		if err := rows.Scan(&consumer, &m.Source, &m.ID, &m.Type, &m.OrderKey, &m.Origin, &m.Headers, &m.Body); err != nil {
			rows.Close()
			return err
		}
		byConsumer[consumer] = append(byConsumer[consumer], &Delivery{Message: m})
	}
	if err := rows.Err(); err != nil {
		return err
	}
	for _, c := range r.consumers {
		if batch := byConsumer[c.name]; len(batch) > 0 {
			c.log.Info("inbox runs expired claims from their stored messages", "messages", len(batch))
			c.Process(ctx, batch)
		}
	}
	return nil
}

// keep runs src until ctx ends. A source that returns an error (its setup
// is wrong: a missing stream, a refused login) is down: it is logged and
// tried again with backoff, so that fixing the broker side is enough.
func (r *Runner) keep(ctx context.Context, c *Consumer, src Source) {
	for failures := 0; ctx.Err() == nil; {
		err := src.Run(ctx, c)
		if ctx.Err() != nil {
			return
		}
		if err == nil {
			err = fmt.Errorf("the source stopped without an error")
		}
		failures++
		c.Down(err)
		wait := obs.FullJitter(100*time.Millisecond, r.probeMax, failures)
		c.log.Error("inbox source stopped; retrying", "error", err, "retry_in", wait.String())
		if !obs.Sleep(ctx, wait) {
			return
		}
	}
}

// Shutdown stops receiving, and lets the work under way finish until ctx
// ends; what is left then comes again from the sources.
func (r *Runner) Shutdown(ctx context.Context) error {
	if r.stop != nil {
		r.stop()
	}
	done := make(chan struct{})
	go func() { r.wg.Wait(); close(done) }()
	select {
	case <-done:
		return nil
	case <-ctx.Done():
		r.hardCancel()
		select { // a source that ignores its context must not hold the exit
		case <-done:
		case <-time.After(time.Second):
		}
		return fmt.Errorf("inbox: work under way was cut off at the end of the shutdown budget")
	}
}
