package config

import (
	"fmt"
	"maps"
	"strings"
	"time"

	"github.com/worker-dev/worker/internal/inbox/inboxconfig"
	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
	"github.com/worker-dev/worker/internal/tasks/tasksconfig"
)

// durationBound is the smallest value a duration setting takes: min, or,
// with above, anything longer than min. Validation refuses less, and
// docs/configuration.md states it in the key's row (TestDurationBoundsAreDocumented).
type durationBound struct {
	min   time.Duration
	above bool
	why   string // the reason, for the refusal; "" when it goes without saying
}

// Bounds of the duration settings validate checks itself; the outbox,
// inbox and tasks sections name theirs (DurationMinimums).
const (
	minLeaseTTL = time.Second // a job's own lease_ttl has the same floor
	// shutdownReserve is the last second of shutdown.timeout, which hands
	// back claims and leases: the timeout must be longer.
	shutdownReserve = time.Second
)

var ownDurationBounds = map[string]durationBound{
	"database.connect_timeout": {min: 0, above: true},
	"lock.wait_time":           {min: 0, above: true},
	"lock.lease_ttl":           {min: minLeaseTTL, why: "the lease is renewed every ttl/3, so a tiny ttl floods the store and loses leases"},
	"shutdown.timeout": {min: shutdownReserve, above: true,
		why: "in-flight work gets the timeout minus 1s, the last second hands back claims and leases"},
}

// durationBounds are the bounds of every duration setting, by key.
func durationBounds() map[string]durationBound {
	all := maps.Clone(ownDurationBounds)
	for _, m := range []map[string]time.Duration{outboxconfig.DurationMinimums(), inboxconfig.DurationMinimums(), tasksconfig.DurationMinimums()} {
		for key, min := range m {
			if min == time.Nanosecond {
				all[key] = durationBound{min: 0, above: true} // "positive" reads better than "at least 1ns"
				continue
			}
			all[key] = durationBound{min: min}
		}
	}
	return all
}

func (b durationBound) allows(d time.Duration) bool {
	if b.above {
		return d > b.min
	}
	return d >= b.min
}

// refusal completes "<key>=<v> ": what is allowed, and why.
func (b durationBound) refusal(v time.Duration) string {
	var s string
	switch {
	case v <= 0:
		return "must be positive"
	case b.above && b.min == 0:
		s = "must be positive"
	case b.above:
		s = fmt.Sprintf("must be longer than %s", b.min)
	default:
		s = fmt.Sprintf("is too short; want at least %s", b.min)
	}
	if b.why != "" {
		s += " (" + b.why + ")"
	}
	return s
}

// doc is how docs/configuration.md states the bound.
func (b durationBound) doc() string {
	switch {
	case b.above && b.min == 0:
		return "positive"
	case b.above:
		return "longer than `" + shortDuration(b.min) + "`"
	}
	return "at least `" + shortDuration(b.min) + "`"
}

// shortDuration writes d as the docs and worker.yaml do: 1m, not 1m0s.
func shortDuration(d time.Duration) string {
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = strings.TrimSuffix(s, "0s")
	}
	if strings.HasSuffix(s, "h0m") {
		s = strings.TrimSuffix(s, "0m")
	}
	return s
}
