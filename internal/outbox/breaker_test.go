package outbox

import (
	"context"
	"errors"
	"testing"
	"time"
)

// TestBreakerClosesOnlyOnAPublishSentAfterItOpened: an answer to a publish
// sent before the outage's first failure does not close the breaker; one
// sent after does. Probes leave out the aggregates that failed as
// unavailable until the sink answers a publish sent after their failure.
func TestBreakerClosesOnlyOnAPublishSentAfterItOpened(t *testing.T) {
	opened, closed := 0, 0
	b := newBreaker(time.Second, func(error) { opened++ }, func(time.Duration) { closed++ })
	poison := Event{AggregateType: "order", AggregateID: "poison"}
	cands := []*candidate{
		{head: windowRow{key: aggregateKey{"order", "poison"}}},
		{head: windowRow{key: aggregateKey{"order", "other"}}},
	}

	sentBefore := time.Now()
	b.unavailable(poison, errors.New("no responders"), false)
	if !b.open() || opened != 1 {
		t.Fatalf("open %v after %d openings, want open after 1", b.open(), opened)
	}
	if got := b.unprobed(cands); len(got) != 1 || got[0].head.key.id != "other" {
		t.Errorf("probe candidates %v, want only the aggregate that did not fail", got)
	}
	if got := b.unprobed(cands[:1]); len(got) != 0 {
		t.Errorf("probe candidates %v, want none when only the failed one waits", got)
	}

	b.answered(sentBefore, true)
	if !b.open() || closed != 0 {
		t.Fatal("a publish sent before the breaker opened closed it")
	}
	if got := b.unprobed(cands); len(got) != 1 {
		t.Error("an answer to a publish sent before the failure let the failed aggregate be probed again")
	}

	b.answered(time.Now(), true)
	if b.open() || closed != 1 {
		t.Fatal("a publish sent after the breaker opened did not close it")
	}
	if got := b.unprobed(cands); len(got) != 2 {
		t.Errorf("probe candidates %v after the sink answered, want both", got)
	}

	b.unavailable(poison, errors.New("no responders"), false)
	b.forgetFailed()
	if got := b.unprobed(cands); len(got) != 2 {
		t.Errorf("probe candidates %v after forgetFailed, want both", got)
	}
}

// TestBreakerKeepsOneProbeWhileOthersFail: a publish that was not the
// probe (sent before the breaker opened, or detached) failing while the
// probe is in flight does not let a second loop probe; the probe's own
// failure, or its ending unjudged, does.
func TestBreakerKeepsOneProbeWhileOthersFail(t *testing.T) {
	b := newBreaker(time.Millisecond, func(error) {}, func(time.Duration) {})
	ev := Event{AggregateType: "order", AggregateID: "a"}
	down := errors.New("connection refused")
	b.unavailable(ev, down, false)

	admit := func() bool {
		ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
		defer cancel()
		probe, ok := b.admit(ctx)
		return probe && ok
	}
	if !admit() {
		t.Fatal("no probe admitted after the breaker opened")
	}
	b.unavailable(Event{AggregateType: "order", AggregateID: "b"}, down, false)
	if admit() {
		t.Fatal("a second probe was admitted while the first was in flight")
	}
	b.unavailable(ev, down, true)
	if !admit() {
		t.Fatal("no probe admitted after the probe failed")
	}
	b.probeEnded()
	if !admit() {
		t.Fatal("no probe admitted after a probe ended unjudged")
	}
}
