package inbox

import (
	"log/slog"
	"sync"
	"time"
)

// health is a source's connection state as its consumer reports it: an
// outage is logged once when it starts and once when it ends, like an
// outbox sink's, and never counted against a message.
type health struct {
	name string
	log  *slog.Logger
	m    *Metrics

	mu      sync.Mutex // Up and Down come from the source's goroutines
	known   bool       // false until the first report
	isUp    bool
	downAt  time.Time
	lastErr string
}

func newHealth(name string, log *slog.Logger, m *Metrics) *health {
	return &health{name: name, log: log, m: m}
}

func (h *health) up() {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.known && h.isUp {
		return
	}
	h.m.sourceUp.WithLabelValues(h.name).Set(1)
	if h.known {
		h.log.Info("inbox source available again; consuming resumes",
			"down_for", time.Since(h.downAt).Round(time.Millisecond).String())
	}
	h.known, h.isUp = true, true
}

func (h *health) down(err error) {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.known && !h.isUp {
		return
	}
	h.known, h.isUp, h.downAt, h.lastErr = true, false, time.Now(), err.Error()
	h.m.sourceUp.WithLabelValues(h.name).Set(0)
	h.log.Warn("inbox source unavailable; messages wait in the source with their attempts untouched, and the consumer reconnects until it answers",
		"error", err)
}
