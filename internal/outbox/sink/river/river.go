// Package river is the river sink (outbox.sink: river): each event becomes
// a task, inserted in the relay's transaction. The task runtime is
// internal/tasks; this package is the outbox's side of it, so that tasks
// (and the inbox, which enqueues tasks) do not depend on the relay.
package river

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"

	"github.com/jackc/pgx/v5"
	"github.com/riverqueue/river"

	"github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
	"github.com/worker-dev/worker/internal/tasks"
	"github.com/worker-dev/worker/internal/tasks/tasksconfig"
)

// Sink is the outbox's river sink: it turns each event into a task
// whose kind its event type selects (outbox.river.routes, "*" the
// default). It is an outbox.TxSink: the relay inserts the tasks in the
// transaction that marks their events PUBLISHED, so every event becomes
// exactly one task, even across crashes. The tasks then retry on their own
// under their kind's policy; they run in parallel, so an aggregate's
// events are inserted in order but not run in order (docs/sinks.md).
type Sink struct {
	routes     map[string]tasksconfig.Kind // event type -> kind; "*" for the rest
	maxBacklog map[string]int              // queue -> max_backlog (0: unbounded)
}

var _ outbox.TxSink = (*Sink)(nil)

// New builds the sink from a validated tasks configuration. Every
// route must name a kind under tasks.kinds, whose queue and max_attempts
// its tasks get.
func New(cfg tasksconfig.Config, routes map[string]string) (*Sink, error) {
	s := &Sink{routes: map[string]tasksconfig.Kind{}, maxBacklog: map[string]int{}}
	for eventType, kind := range routes {
		k, ok := cfg.KindNamed(kind)
		if !ok {
			return nil, fmt.Errorf("%s.%s=%q: no such kind under tasks.kinds (have %s)",
				outboxconfig.RoutesKey, eventType, kind, strings.Join(cfg.KindNames(), ", "))
		}
		s.routes[eventType] = k
	}
	for name, q := range cfg.Queues {
		s.maxBacklog[name] = q.Backlog()
	}
	return s, nil
}

// Name implements outbox.Sink.
func (s *Sink) Name() string { return "river" }

// Publish implements outbox.Sink; the relay calls PublishTx instead.
func (s *Sink) Publish(context.Context, outbox.Event) error {
	return errors.New("outbox: the river sink writes only in the relay's transaction (PublishTx)")
}

// PublishTx implements outbox.TxSink: one River insert for the events it
// admits. An event type without a route fails permanently (the event goes
// DEAD). An event whose queue is at its max_backlog is refused with
// JOB_EXECUTOR_REJECTED, a transient failure, so the event retries with
// the outbox backoff; the later events of its aggregate wait with it.
func (s *Sink) PublishTx(ctx context.Context, tx pgx.Tx, events []outbox.Event) ([]error, error) {
	errs := make([]error, len(events))
	kinds := make([]tasksconfig.Kind, len(events))
	for i, ev := range events {
		k, ok := s.route(ev.EventType)
		if !ok {
			errs[i] = outbox.Permanent(fmt.Errorf("%s has no route for event type %q and no \"*\" default", outboxconfig.RoutesKey, ev.EventType))
		}
		kinds[i] = k
	}
	room, err := s.room(ctx, tx, kinds)
	if err != nil {
		return nil, err
	}
	type aggregate struct{ typ, id string }
	held := map[aggregate]bool{} // aggregates with a failed event in this call
	var params []river.InsertManyParams
	for i, ev := range events {
		agg := aggregate{ev.AggregateType, ev.AggregateID}
		k := kinds[i]
		switch free, bounded := room[k.Queue]; {
		case held[agg]:
			errs[i] = errors.New("an earlier event of its aggregate failed")
		case errs[i] != nil:
		case bounded && free <= 0:
			errs[i] = &tasks.RejectedError{Msg: fmt.Sprintf("JOB_EXECUTOR_REJECTED: queue %s has %d available tasks, its max_backlog; event %s waits",
				k.Queue, s.maxBacklog[k.Queue], ev.EventID)}
		default:
			p, err := s.insertParams(ev, k)
			if err != nil {
				errs[i] = outbox.Permanent(err)
				break
			}
			if bounded {
				room[k.Queue]--
			}
			params = append(params, p)
		}
		if errs[i] != nil {
			held[agg] = true
		}
	}
	if len(params) == 0 {
		return errs, nil
	}
	if err := tasks.InsertManyTx(ctx, tx, params); err != nil {
		return nil, err
	}
	return errs, nil
}

func (s *Sink) route(eventType string) (tasksconfig.Kind, bool) {
	if k, ok := s.routes[eventType]; ok {
		return k, true
	}
	k, ok := s.routes["*"]
	return k, ok
}

// room returns, for each bounded queue the kinds use, how many more tasks
// it accepts: max_backlog minus its available tasks. The count stops at
// max_backlog, as worker_task_admit's does, so its cost stays bounded.
func (s *Sink) room(ctx context.Context, tx pgx.Tx, kinds []tasksconfig.Kind) (map[string]int, error) {
	var queues []string
	var caps []int32
	seen := map[string]bool{}
	for _, k := range kinds {
		if c := s.maxBacklog[k.Queue]; c > 0 && !seen[k.Queue] {
			seen[k.Queue] = true
			queues, caps = append(queues, k.Queue), append(caps, int32(c))
		}
	}
	room := make(map[string]int, len(queues))
	if len(queues) == 0 {
		return room, nil
	}
	rows, err := tx.Query(ctx, `
SELECT u.queue, u.cap - (SELECT count(*) FROM (SELECT 1 FROM river_job j
                                               WHERE j.state = 'available' AND j.queue = u.queue
                                               LIMIT u.cap) waiting)
FROM unnest($1::text[], $2::int[]) AS u(queue, cap)`, queues, caps)
	if err != nil {
		return nil, err
	}
	for rows.Next() {
		var q string
		var free int
		if err := rows.Scan(&q, &free); err != nil {
			rows.Close()
			return nil, err
		}
		room[q] = free
	}
	return room, rows.Err()
}

// insertParams is the task of one event: its args, its kind's queue and
// max_attempts, and the propagated context its headers carry.
func (s *Sink) insertParams(ev outbox.Event, k tasksconfig.Kind) (river.InsertManyParams, error) {
	args, err := json.Marshal(tasks.EventArgs{
		EventID: ev.EventID, EventType: ev.EventType, AggregateType: ev.AggregateType, AggregateID: ev.AggregateID,
		Payload: ev.Payload, Headers: ev.Headers, OccurredAt: ev.OccurredAt,
	})
	if err != nil {
		return river.InsertManyParams{}, err
	}
	h := ev.Headers
	return tasks.InsertParams(k, args, tasks.Meta{RequestID: h["request_id"], Traceparent: h["traceparent"],
		CorrelationID: h["correlation_id"], TenantID: h["tenant_id"]})
}
