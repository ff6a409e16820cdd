package inboxtest

import (
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/worker-dev/worker/internal/inbox"
)

// States records a source's Up and Down reports in order, a repeated one
// once.
type States struct {
	mu   sync.Mutex
	seen []string
}

func (s *States) add(v string) {
	s.mu.Lock()
	defer s.mu.Unlock()
	if len(s.seen) == 0 || s.seen[len(s.seen)-1] != v {
		s.seen = append(s.seen, v)
	}
}

// String is the reports so far: "[up down up]".
func (s *States) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return fmt.Sprint(s.seen)
}

// Reporting passes a Handoff's calls on, recording Up and Down to States.
type Reporting struct {
	inbox.Handoff
	States *States
}

func (r *Reporting) Up() {
	r.States.add("up")
	r.Handoff.Up()
}

func (r *Reporting) Down(err error) {
	r.States.add("down")
	r.Handoff.Down(err)
}

// Outcomes passes a Handoff's calls on, recording what each message's
// deliveries were settled as.
type Outcomes struct {
	inbox.Handoff
	// LoseFirst drops the first settle of every message, as if the
	// replica died right after the commit: the outcome is recorded, the
	// source never hears of it.
	LoseFirst bool

	mu   sync.Mutex
	byID map[string][]inbox.Outcome
}

// RecordOutcomes returns h, recording its outcomes.
func RecordOutcomes(h inbox.Handoff) *Outcomes {
	return &Outcomes{Handoff: h, byID: map[string][]inbox.Outcome{}}
}

func (o *Outcomes) Process(ctx context.Context, batch []*inbox.Delivery) {
	for _, d := range batch {
		settle, id := d.Settle, d.Message.ID
		d.Settle = func(ctx context.Context, out inbox.Outcome, after time.Duration) error {
			o.mu.Lock()
			o.byID[id] = append(o.byID[id], out)
			first := len(o.byID[id]) == 1
			o.mu.Unlock()
			if first && o.LoseFirst {
				return nil
			}
			return settle(ctx, out, after)
		}
	}
	o.Handoff.Process(ctx, batch)
}

// Of returns the outcomes of message id's deliveries, in order.
func (o *Outcomes) Of(id string) []inbox.Outcome {
	o.mu.Lock()
	defer o.mu.Unlock()
	return append([]inbox.Outcome(nil), o.byID[id]...)
}

// Count returns how many deliveries were settled as out.
func (o *Outcomes) Count(out inbox.Outcome) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	n := 0
	for _, os := range o.byID {
		for _, x := range os {
			if x == out {
				n++
			}
		}
	}
	return n
}

// Counting passes a Handoff's calls on, counting batches and the
// deliveries settled processed, and closes Done once Want were.
type Counting struct {
	inbox.Handoff
	*Count
}

// Count is what Counting handoffs count; replicas' handoffs share one
// (Also).
type Count struct {
	Want    int64
	Done    chan struct{}
	Settled atomic.Int64
	Batches atomic.Int64
}

// NewCounting returns h, counting until want deliveries were processed.
func NewCounting(h inbox.Handoff, want int) *Counting {
	return &Counting{Handoff: h, Count: &Count{Want: int64(want), Done: make(chan struct{})}}
}

// Also returns h counting into c's count too: another replica's handoff.
func (c *Counting) Also(h inbox.Handoff) *Counting {
	return &Counting{Handoff: h, Count: c.Count}
}

func (c *Counting) Process(ctx context.Context, batch []*inbox.Delivery) {
	c.Batches.Add(1)
	for _, d := range batch {
		settle := d.Settle
		d.Settle = func(ctx context.Context, o inbox.Outcome, after time.Duration) error {
			err := settle(ctx, o, after)
			if o == inbox.Processed && c.Settled.Add(1) == c.Want {
				close(c.Done)
			}
			return err
		}
	}
	c.Handoff.Process(ctx, batch)
}
