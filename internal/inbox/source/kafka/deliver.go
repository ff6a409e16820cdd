package kafka

import (
	"context"
	"fmt"
	"sync"
	"time"

	"github.com/twmb/franz-go/pkg/kgo"

	kafkabroker "github.com/worker-dev/worker/internal/broker/kafka"
	"github.com/worker-dev/worker/internal/inbox"
	"github.com/worker-dev/worker/internal/obs"
)

// unsettledWait is the wait before handing a record over again that the
// inbox left unsettled without saying busy; the contract says it does not.
const unsettledWait = time.Second

// settled is what the inbox made of one record.
type settled struct {
	done  bool // processed, duplicate or dead: its offset may be committed
	after time.Duration
}

// process hands recs (one poll: each partition's records in offset order)
// to the inbox, hands the busy ones over again after the wait the inbox
// asks for until none is left or ctx ends, and then commits each
// partition's offsets through its last record before the first one not
// settled. It returns the commit's error.
func (s *Source) process(ctx context.Context, cl *kgo.Client, h inbox.Handoff, recs []*kgo.Record) error {
	fates := make([]settled, len(recs))
	var mu sync.Mutex // Settle may be called from the inbox's goroutines
	pending := make([]int, len(recs))
	for i := range recs {
		pending[i] = i
	}
	for len(pending) > 0 {
		batch := make([]*inbox.Delivery, len(pending))
		for n, i := range pending {
			d := delivery(recs[i])
			d.Settle = func(_ context.Context, o inbox.Outcome, after time.Duration) error {
				mu.Lock()
				defer mu.Unlock()
				switch o {
				case inbox.Processed, inbox.Duplicate, inbox.Dead:
					fates[i] = settled{done: true}
				default:
					fates[i] = settled{after: max(after, time.Millisecond)}
				}
				return nil
			}
			batch[n] = d
		}
		h.Process(ctx, batch)
		if ctx.Err() != nil {
			break
		}
		var wait time.Duration
		mu.Lock()
		busy := pending[:0]
		for _, i := range pending {
			switch f := fates[i]; {
			case f.done:
			case f.after == 0: // not settled at all
				busy = append(busy, i)
				wait = max(wait, unsettledWait)
			default:
				busy = append(busy, i)
				wait = max(wait, f.after)
				fates[i] = settled{}
			}
		}
		mu.Unlock()
		pending = busy
		if len(pending) > 0 && !obs.Sleep(ctx, wait) {
			break
		}
	}
	mu.Lock()
	commit := committable(recs, fates)
	mu.Unlock()
	if len(commit) == 0 {
		return nil
	}
	cctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), commitTimeout)
	defer cancel()
	if err := cl.CommitRecords(cctx, commit...); err != nil {
		// The work is committed: the records come again, as duplicates.
		return s.classify(fmt.Errorf("committing offsets: %w", err))
	}
	return nil
}

// committable returns, per partition, the last record of the longest run
// of settled records from the partition's first in recs: committing it
// commits them all, and nothing past a record not settled.
func committable(recs []*kgo.Record, fates []settled) []*kgo.Record {
	type tp struct {
		topic     string
		partition int32
	}
	last := map[tp]*kgo.Record{}
	stopped := map[tp]bool{}
	var order []tp
	for i, r := range recs {
		k := tp{r.Topic, r.Partition}
		switch {
		case stopped[k]:
		case !fates[i].done:
			stopped[k] = true
		default:
			if last[k] == nil {
				order = append(order, k)
			}
			last[k] = r
		}
	}
	out := make([]*kgo.Record, 0, len(order))
	for _, k := range order {
		out = append(out, last[k])
	}
	return out
}

// delivery maps a record as the outbox's Kafka sink produces it: its
// keys from the CloudEvents attributes (inbox.CloudEvent), or, for a
// record without ce_subject, the record key as its order key. A record
// without ce_id keeps ID "": the inbox applies the source's configured
// key or dead-letters it, under its topic, partition and offset.
func delivery(r *kgo.Record) *inbox.Delivery {
	msg := inbox.CloudEvent(kafkabroker.Decode(r.Headers))
	msg.Origin, msg.Headers, msg.Body = r.Topic, make(map[string]string, len(r.Headers)), r.Value
	for _, h := range r.Headers {
		v := string(h.Value)
		if prev, ok := msg.Headers[h.Key]; ok {
			v = prev + ", " + v
		}
		msg.Headers[h.Key] = v
	}
	if msg.OrderKey == "" && len(r.Key) > 0 {
		msg.OrderKey = string(r.Key)
	}
	return &inbox.Delivery{Message: msg, Ref: fmt.Sprintf("%s/%d/%d", r.Topic, r.Partition, r.Offset)}
}
