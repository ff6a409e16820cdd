package lock

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/obs"
)

// Health watches whether a shared provider's store (Redis, or the
// PostgreSQL lease pool) answers. While it does not, no replica can take a
// lease, so no job runs anywhere; each attempt fails on its own, and
// without Health that is a WARN per attempt and nothing else. Health
// turns it into one signal:
//
//	lock_provider_up{provider}   1, or 0 once the store has not answered for downAfter
//
// with one ERROR line (error.code=LOCK_PROVIDER_UNAVAILABLE) when an
// outage starts and one INFO line when it ends, and Ready for /readyz. It
// pings the store every downAfter/10 (100ms to 1s), each ping bounded by
// that period, so a hung store counts as down like one that refuses. An
// in-process provider has no store: it is always up.
//
// downAfter is the lease ttl: a holder keeps its lease through a shorter
// outage (its renewals retry within the ttl), so only a longer one costs
// runs.
type Health struct {
	ping      func(ctx context.Context) error
	provider  string
	downAfter time.Duration
	every     time.Duration
	log       *slog.Logger
	gauge     prometheus.Gauge
	up        atomic.Bool

	stop context.CancelFunc
	done chan struct{}
	once sync.Once
}

// pinger is a provider whose store can be asked whether it answers.
type pinger interface {
	Ping(ctx context.Context) error
}

// NewHealth registers lock_provider_up on reg, at 1, for provider l (the
// provider itself, not WithMetrics' wrapper). log may be nil. Start begins
// the pings.
func NewHealth(l Locker, downAfter time.Duration, reg prometheus.Registerer, log *slog.Logger) (*Health, error) {
	if downAfter <= 0 {
		return nil, fmt.Errorf("lock: health downAfter %s: want a positive duration", downAfter)
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	h := &Health{
		provider:  ProviderOf(l),
		downAfter: downAfter,
		every:     min(max(downAfter/10, 100*time.Millisecond), time.Second),
		log:       log,
		gauge: prometheus.NewGauge(prometheus.GaugeOpts{
			Name:        "lock_provider_up",
			Help:        "1 while the lock provider's store answers; 0 once it has not answered for a lease ttl (no job can take its lease).",
			ConstLabels: prometheus.Labels{"provider": ProviderOf(l)},
		}),
	}
	if p, ok := l.(pinger); ok {
		h.ping = p.Ping
	}
	if err := reg.Register(h.gauge); err != nil {
		return nil, err
	}
	h.up.Store(true)
	h.gauge.Set(1)
	return h, nil
}

// Up reports whether the store answered within the last downAfter.
func (h *Health) Up() bool { return h.up.Load() }

// Ready is the readiness verdict: ok, or why not.
func (h *Health) Ready() (bool, string) {
	if h.Up() {
		return true, ""
	}
	return false, "lock provider " + h.provider + " unreachable"
}

// Start begins the pings in the background; Shutdown ends them. ctx is
// not used past Start: the pings stop only at Shutdown.
func (h *Health) Start(context.Context) error {
	if h.ping == nil {
		return nil
	}
	ctx, stop := context.WithCancel(context.Background())
	h.stop, h.done = stop, make(chan struct{})
	go h.run(ctx)
	return nil
}

// Shutdown stops the pings; it may be called without Start, and twice.
func (h *Health) Shutdown(ctx context.Context) error {
	h.once.Do(func() {
		if h.stop == nil {
			return
		}
		h.stop()
		select {
		case <-h.done:
		case <-ctx.Done():
		}
	})
	return nil
}

func (h *Health) run(ctx context.Context) {
	defer close(h.done)
	t := time.NewTicker(h.every)
	defer t.Stop()
	lastOK := time.Now()
	var downSince time.Time
	for {
		pctx, cancel := context.WithTimeout(ctx, h.every)
		err := h.ping(pctx)
		cancel()
		now := time.Now()
		switch {
		case ctx.Err() != nil:
			return
		case err == nil:
			lastOK = now
			if !h.up.Load() {
				h.up.Store(true)
				h.gauge.Set(1)
				h.log.Info("lock provider reachable again; jobs run again", "provider", h.provider,
					"outage_ms", now.Sub(downSince).Milliseconds())
			}
		case h.up.Load() && now.Sub(lastOK) >= h.downAfter:
			downSince = lastOK
			h.up.Store(false)
			h.gauge.Set(0)
			h.log.Error("lock provider unreachable for longer than the lease ttl; no job runs until it answers",
				"error.code", obs.CodeLockProviderUnavailable, "provider", h.provider,
				"unreachable_ms", now.Sub(lastOK).Milliseconds(), "lease_ttl", h.downAfter.String(), "error", err)
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

// Ping implements pinger: one round trip on the lease pool.
func (p *Postgres) Ping(ctx context.Context) error { return p.pool.Ping(ctx) }

// Ping implements pinger: PING on the lease client.
func (r *Redis) Ping(ctx context.Context) error { return r.rdb.Ping(ctx).Err() }
