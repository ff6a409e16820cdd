package outbox

import (
	"context"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/worker-dev/worker/internal/obs"
)

// An outage of the sink is not the events' fault. When a publish says the
// sink is unavailable (IsUnavailable, or the same failure for most
// aggregates of a batch), the relay opens its breaker: the event is handed
// back with its attempts untouched, the loops stop claiming, and one loop
// at a time claims a single event as a probe, after a jittered exponential
// backoff capped at probe_backoff_max. The first probe the sink answers
// closes the breaker and every loop resumes at once. So an outage of any
// length dead-letters nothing; outbox_sink_up and an alert tell people.
//
// A failure that reads as the sink's can still be one aggregate's own: a
// NATS subject that no stream takes answers "no responders", a receiver
// that crashes on one payload resets the connection. Probed again and
// again, such an aggregate would hold the breaker open for good once it is
// the oldest head. So probes skip the aggregates that failed so since the
// sink last answered, and the others publish. Such failures still never
// count toward max_attempts: telling them from a sink that fails most of
// its calls (flapping, overloaded) would put healthy events at risk.

// probeBackoffBase is the first wait between probes.
const probeBackoffBase = 100 * time.Millisecond

// breaker is the relay's view of whether its sink is available. It is a
// type of its own, told of publishes and asked for admission; it knows
// nothing of claims or batches beyond aggregate keys. The loops (admit,
// probeEnded, unprobed, forgetFailed) and the publish workers (answered,
// unavailable, sinkWide) share it: the atomics are read without the lock,
// mu guards every other field, and max, onOpen and onClose are set at
// construction. onOpen and onClose run on the goroutine that changed the
// state, after mu is released.
type breaker struct {
	max     time.Duration // cap of the wait between probes
	onOpen  func(cause error)
	onClose func(openFor time.Duration)

	isOpen    atomic.Bool // read on every publish: the closed path takes no lock
	failing   atomic.Bool // alike holds failures since the last answer
	hasFailed atomic.Bool // failed is not empty

	mu        sync.Mutex // guards the fields below
	openedAt  time.Time
	cause     string // the failure that opened it, its event's id removed
	probes    int    // failed probes since it opened
	probing   bool   // a loop is claiming or publishing the probe
	nextProbe time.Time
	changed   chan struct{}         // closed and replaced when the breaker closes or a probe ends
	alike     map[aggregateKey]bool // aggregates that failed with likeText since the sink last answered
	likeText  string
	failed    map[aggregateKey]time.Time // aggregates whose last publish failed as unavailable, and when
}

// maxTracked bounds failed; a full failed starts over.
const maxTracked = 4096

func newBreaker(max time.Duration, onOpen func(error), onClose func(time.Duration)) *breaker {
	return &breaker{max: max, onOpen: onOpen, onClose: onClose, changed: make(chan struct{}), failed: map[aggregateKey]time.Time{}}
}

// open reports whether the breaker is open.
func (b *breaker) open() bool { return b.isOpen.Load() }

// admit returns when the loop may claim: at once while the breaker is
// closed (probe false), or, while it is open, when this loop is to claim
// the probe (probe true). It returns ok false when ctx ends first.
func (b *breaker) admit(ctx context.Context) (probe, ok bool) {
	for {
		if !b.open() {
			return false, true
		}
		b.mu.Lock()
		if !b.isOpen.Load() {
			b.mu.Unlock()
			continue
		}
		wait := time.Until(b.nextProbe)
		if !b.probing && wait <= 0 {
			b.probing = true
			b.mu.Unlock()
			return true, true
		}
		changed := b.changed
		if b.probing {
			wait = time.Hour // until the probe ends
		}
		b.mu.Unlock()
		t := time.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return false, false
		case <-changed:
		case <-t.C:
		}
		t.Stop()
	}
}

// probeEnded ends a probe that the sink did not judge: it found no event
// to publish, or its event was unreadable and never reached the sink. The
// next loop that finds work probes.
func (b *breaker) probeEnded() {
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.probing {
		b.probing = false
		b.signal()
	}
}

// answered notes that the sink answered a publish sent at sent: it took
// it (ok), or failed it with a failure of the event's own. Either way
// it was available after sent: the aggregates that failed as unavailable
// before then may be probed again, and an open breaker that opened before
// then closes. A publish sent before the breaker opened says nothing: its
// answer can arrive after the outage's first failure. Only a publish the
// sink took ends a run of failures alike (sinkWide).
func (b *breaker) answered(sent time.Time, ok bool) {
	if !b.open() && !(ok && b.failing.Load()) && !b.hasFailed.Load() {
		return
	}
	b.mu.Lock()
	if ok {
		b.alike, b.likeText = nil, ""
		b.failing.Store(false)
	}
	for k, at := range b.failed {
		if at.Before(sent) {
			delete(b.failed, k)
		}
	}
	b.hasFailed.Store(len(b.failed) > 0)
	if !b.isOpen.Load() || sent.Before(b.openedAt) {
		b.mu.Unlock()
		return
	}
	openFor := time.Since(b.openedAt)
	b.isOpen.Store(false)
	b.probing = false
	b.probes = 0
	b.cause = ""
	b.signal()
	b.mu.Unlock()
	b.onClose(openFor)
}

// unprobed leaves out of a probe's candidates the aggregates that failed
// as unavailable since the sink last answered. None left: every candidate
// failed so, and the caller looks elsewhere or forgets (forgetFailed).
func (b *breaker) unprobed(cands []*candidate) []*candidate {
	if !b.hasFailed.Load() {
		return cands
	}
	b.mu.Lock()
	defer b.mu.Unlock()
	var rest []*candidate
	for _, c := range cands {
		if _, failed := b.failed[c.head.key]; !failed {
			rest = append(rest, c)
		}
	}
	return rest
}

// forgetFailed lets every aggregate be probed again: none but those that
// failed is waiting, and one of them may be the first the sink takes.
func (b *breaker) forgetFailed() {
	b.mu.Lock()
	clear(b.failed)
	b.hasFailed.Store(false)
	b.mu.Unlock()
}

// unavailable notes a publish of ev that failed because of the sink. It
// opens the breaker, or schedules the next probe if this was the probe.
// Any other publish failing while the breaker is open (one sent before it
// opened, or detached) leaves the probe in flight alone: ending it would
// let a second loop probe at the same time.
func (b *breaker) unavailable(ev Event, err error, probe bool) {
	b.mu.Lock()
	if len(b.failed) >= maxTracked {
		clear(b.failed)
	}
	b.failed[ev.key()] = time.Now()
	b.hasFailed.Store(true)
	if b.isOpen.Load() {
		if probe && b.probing {
			b.probing = false
			b.probes++
			b.nextProbe = time.Now().Add(obs.FullJitter(probeBackoffBase, b.max, b.probes+1))
			b.signal()
		}
		b.mu.Unlock()
		return
	}
	b.isOpen.Store(true)
	b.openedAt = time.Now()
	b.cause = failureText(ev, err)
	b.probes = 0
	b.probing = false
	b.nextProbe = b.openedAt.Add(obs.FullJitter(probeBackoffBase, b.max, 1))
	b.mu.Unlock()
	b.onOpen(err)
}

// sinkWide reports whether ev's failure err, which is not classified as
// unavailable, is the sink's all the same: the failure that opened the
// breaker, or the same failure for minSinkWide aggregates since the sink
// last answered. A sink that answers every event with the same error is
// down, whatever it answers.
func (b *breaker) sinkWide(ev Event, err error) bool {
	text := failureText(ev, err)
	b.mu.Lock()
	defer b.mu.Unlock()
	if b.isOpen.Load() {
		return b.cause == text
	}
	if text != b.likeText {
		b.alike, b.likeText = map[aggregateKey]bool{}, text
	}
	b.alike[ev.key()] = true
	b.failing.Store(true)
	return len(b.alike) >= minSinkWide
}

// signal wakes the loops waiting in admit. Called with b.mu held.
func (b *breaker) signal() {
	close(b.changed)
	b.changed = make(chan struct{})
}

// failureText is err's message with ev's own identifiers removed, so the
// same failure of different events compares equal.
func failureText(ev Event, err error) string {
	s := err.Error()
	if ev.EventID != "" {
		s = strings.ReplaceAll(s, ev.EventID, "")
	}
	return s
}

// minSinkWide is the fewest aggregates failing alike that say the sink,
// not the events, failed. One or two aggregates failing alike is what a
// poison event looks like; so the first two aggregates of an outage that
// answers with an unclassified error each spend an attempt.
const minSinkWide = 3
