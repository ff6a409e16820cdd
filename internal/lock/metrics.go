package lock

import (
	"context"
	"errors"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// Acquisition outcomes, the values of lock_acquisition_total{outcome}.
const (
	OutcomeAcquired = "acquired"
	OutcomeTimeout  = "timeout"
	OutcomeError    = "error"
)

type lockMetrics struct {
	acquisitions *prometheus.CounterVec
	duration     *prometheus.HistogramVec
	expired      prometheus.Counter
	lost         prometheus.Counter
	held         prometheus.Gauge
}

// WithMetrics wraps any Locker so that its acquisitions and leases are
// counted on reg:
//
//	lock_acquisition_total{outcome}             acquired | timeout | error
//	lock_acquisition_duration_seconds{outcome}  time spent in TryAcquire
//	lock_lease_expired_total                    Release found the lease expired
//	lock_lease_lost_total                       Lost fired (renewal failed)
//	lock_held                                   leases currently held
//
// Every series exists, at zero, from the start. Keys are not a label: they
// are unbounded in general, and logs carry them instead. Every series
// carries provider (inprocess, postgres, redis; see ProviderOf), so a
// dashboard can tell a cluster's providers apart during a migration.
func WithMetrics(l Locker, reg prometheus.Registerer) (Locker, error) {
	provider := prometheus.Labels{"provider": ProviderOf(l)}
	m := &lockMetrics{
		acquisitions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name:        "lock_acquisition_total",
			Help:        "Lease acquisitions by outcome (acquired, timeout, error).",
			ConstLabels: provider,
		}, []string{"outcome"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:        "lock_acquisition_duration_seconds",
			Help:        "Time spent in TryAcquire, by outcome.",
			Buckets:     prometheus.ExponentialBuckets(0.001, 4, 9), // 1ms .. ~65s
			ConstLabels: provider,
		}, []string{"outcome"}),
		expired: prometheus.NewCounter(prometheus.CounterOpts{
			Name:        "lock_lease_expired_total",
			Help:        "Releases that found the lease already expired: the protected work outlived its lease.",
			ConstLabels: provider,
		}),
		lost: prometheus.NewCounter(prometheus.CounterOpts{
			Name:        "lock_lease_lost_total",
			Help:        "Leases declared lost while held (renewal found them expired, or kept failing for a whole ttl).",
			ConstLabels: provider,
		}),
		held: prometheus.NewGauge(prometheus.GaugeOpts{
			Name:        "lock_held",
			Help:        "Leases currently held by this process.",
			ConstLabels: provider,
		}),
	}
	for _, c := range []prometheus.Collector{m.acquisitions, m.duration, m.expired, m.lost, m.held} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	for _, o := range []string{OutcomeAcquired, OutcomeTimeout, OutcomeError} {
		m.acquisitions.WithLabelValues(o)
		m.duration.WithLabelValues(o)
	}
	return &meteredLocker{inner: l, m: m}, nil
}

// ProviderOf names l's provider for the metrics' provider label: what its
// Provider method returns, or "other" for a Locker without one.
func ProviderOf(l Locker) string {
	if p, ok := l.(interface{ Provider() string }); ok {
		return p.Provider()
	}
	return "other"
}

type meteredLocker struct {
	inner Locker
	m     *lockMetrics
}

func (ml *meteredLocker) TryAcquire(ctx context.Context, key string, wait, ttl time.Duration) (Lease, error) {
	start := time.Now()
	l, err := ml.inner.TryAcquire(ctx, key, wait, ttl)
	outcome := OutcomeAcquired
	switch {
	case IsTimeout(err):
		outcome = OutcomeTimeout
	case err != nil:
		outcome = OutcomeError
	}
	ml.m.acquisitions.WithLabelValues(outcome).Inc()
	ml.m.duration.WithLabelValues(outcome).Observe(time.Since(start).Seconds())
	if err != nil {
		return nil, err
	}
	ml.m.held.Inc()
	w := &meteredLease{Lease: l, m: ml.m, settled: make(chan struct{})}
	go w.watchLost()
	return w, nil
}

// meteredLease counts a lease's end exactly once: lost, or released.
type meteredLease struct {
	Lease
	m        *lockMetrics
	once     sync.Once
	lostOnce sync.Once
	settled  chan struct{}
}

// countLost counts the loss once, from whichever of watchLost and Release
// sees it first: Release must not return before a loss it reports is
// counted, or a caller reading the metric right after races watchLost.
func (l *meteredLease) countLost() { l.lostOnce.Do(l.m.lost.Inc) }

func (l *meteredLease) settle() {
	l.once.Do(func() {
		l.m.held.Dec()
		close(l.settled)
	})
}

func (l *meteredLease) watchLost() {
	select {
	case <-l.Lease.Lost():
	case <-l.settled:
		// Released; but a loss just before the release still counts.
		select {
		case <-l.Lease.Lost():
		default:
			return
		}
	}
	l.countLost()
	l.settle()
}

func (l *meteredLease) Release(ctx context.Context) error {
	err := l.Lease.Release(ctx)
	select {
	case <-l.Lease.Lost():
		l.countLost()
	default:
	}
	switch {
	case errors.Is(err, ErrLeaseExpired):
		l.m.expired.Inc()
		l.settle()
	case err == nil:
		l.settle()
	}
	// A release that failed leaves the grant in the store until a retried
	// Release or its ttl, when Lost fires and watchLost settles it.
	return err
}
