package main

import (
	"fmt"
	"io"
	"time"

	"github.com/worker-dev/worker/internal/soak/load"
)

// verdict is what the soak found at its end.
type verdict struct {
	duration                            time.Duration
	produced, inboxTaken, tasksEnqueued int
	lost, dups                          int
	outOfOrder                          []string
	counts                              load.Counts
	growth                              []growth
}

// print writes the figures and the verdict, and reports whether it passed.
func (v verdict) print(w io.Writer) bool {
	var failed []string
	secs := v.duration.Seconds()
	fmt.Fprintf(w, "soak of %s: %.0f events, %.0f inbox deliveries and %.0f tasks a second\n", v.duration,
		float64(v.produced)/secs, float64(v.inboxTaken)/secs, float64(v.tasksEnqueued)/secs)
	fmt.Fprintf(w, "  outbox: %d events produced, %d lost, %d out of order, %d duplicate deliveries (at least once)\n",
		v.produced, v.lost, len(v.outOfOrder), v.dups)
	fmt.Fprintf(w, "  inbox: %d deliveries taken, %d applied, %d twice; tasks: %d enqueued, %d applied, %d twice\n",
		v.inboxTaken, v.counts.InboxApplied, v.counts.InboxDoubled, v.tasksEnqueued, v.counts.TaskApplied, v.counts.TaskDoubled)
	fmt.Fprintf(w, "  job: %d committed runs, %d fencing tokens used twice, %d overlaps\n",
		v.counts.JobRuns, v.counts.JobTokenTwice, v.counts.JobOverlaps)
	if v.lost > 0 {
		failed = append(failed, fmt.Sprintf("%d events lost", v.lost))
	}
	if n := len(v.outOfOrder); n > 0 {
		failed = append(failed, fmt.Sprintf("%d events out of order (first: %s)", n, v.outOfOrder[0]))
	}
	failed = append(failed, v.counts.Problems()...)
	fmt.Fprintf(w, "  resources (limit: +%.0f%%):\n", maxGrowth*100)
	for _, g := range v.growth {
		switch {
		case !g.judged:
			fmt.Fprintf(w, "    %-16s %s\n", g.name, g.note)
		default:
			change := 0.0
			if g.from != 0 {
				change = (g.to - g.from) / g.from * 100
			}
			mark := "ok"
			if g.grew() {
				mark = "GREW"
				failed = append(failed, fmt.Sprintf("%s grew from %.1f to %.1f", g.name, g.from, g.to))
			}
			fmt.Fprintf(w, "    %-16s from minute %d: %.1f, at the end: %.1f (%+.1f%%) %s\n", g.name, g.fromMinute, g.from, g.to, change, mark)
		}
	}
	if len(failed) > 0 {
		fmt.Fprintln(w, "verdict: FAIL")
		for _, f := range failed {
			fmt.Fprintln(w, "  -", f)
		}
		return false
	}
	fmt.Fprintln(w, "verdict: PASS (0 lost, 0 doubled, no resource grew by more than 10%)")
	return true
}
