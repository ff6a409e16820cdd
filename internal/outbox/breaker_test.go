package outbox

import (
	"errors"
	"testing"
	"time"
)

// TestBreakerTellsAPoisonFromAnOutage: a publish sent before the breaker
// opened does not close it; one sent after does, and makes the aggregate
// that opened it a suspect, whose next failure is its own until it
// publishes. Probes leave out the aggregates that just failed.
func TestBreakerTellsAPoisonFromAnOutage(t *testing.T) {
	opened, closed := 0, 0
	b := newBreaker(time.Second, func(error) { opened++ }, func(time.Duration) { closed++ })
	poison := Event{AggregateType: "order", AggregateID: "poison"}
	other := Event{AggregateType: "order", AggregateID: "other"}
	cands := []*candidate{
		{head: windowRow{key: aggregateKey{"order", "poison"}}},
		{head: windowRow{key: aggregateKey{"order", "other"}}},
	}

	sentBefore := time.Now()
	b.unavailable(poison, errors.New("no responders"))
	if !b.open() || opened != 1 {
		t.Fatalf("open %v after %d openings, want open after 1", b.open(), opened)
	}
	if got := b.unprobed(cands); len(got) != 1 || got[0].head.key.id != "other" {
		t.Errorf("probe candidates %v, want only the aggregate that did not fail", got)
	}
	if got := b.unprobed(cands[:1]); len(got) != 1 {
		t.Errorf("probe candidates %v, want the failed one again when nothing else waits", got)
	}

	b.answered(other, sentBefore, true)
	if !b.open() || closed != 0 {
		t.Fatal("a publish sent before the breaker opened closed it")
	}
	if b.suspected(poison) {
		t.Error("poison suspected on a publish sent before it failed")
	}

	b.answered(other, time.Now(), true)
	if b.open() || closed != 1 {
		t.Fatal("a publish sent after the breaker opened did not close it")
	}
	if !b.suspected(poison) || b.suspected(other) {
		t.Errorf("suspected: poison %v, other %v; want only poison", b.suspected(poison), b.suspected(other))
	}

	b.answered(poison, time.Now(), true)
	if b.suspected(poison) {
		t.Error("poison still suspected after it published")
	}
}
