package outbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// Partitions keeps outbox_event's partitions (docs/outbox-internals.md, "Storage"):
// it creates them Ahead intervals ahead of the database clock, so an insert
// always finds its partition, and drops each one once it is older than
// Retention and none of its events is still to publish or DEAD. It has the
// shape of a scheduled job (Name, Run), so it runs under the job's lease:
// one replica at a time. Register it under PartitionsJobName.
type Partitions struct {
	Pool      *pgxpool.Pool
	Interval  time.Duration // the length of a new partition
	Ahead     int           // partitions kept ahead of now
	Retention time.Duration
	Log       *slog.Logger // nil: no logging
}

// partitionLockTimeout bounds each wait for a lock on outbox_event. The
// attach and the detach take only SHARE UPDATE EXCLUSIVE, which producers
// and relays do not conflict with; what they can wait for is another
// schema change, and waiting longer would only queue others behind them.
const partitionLockTimeout = "'5s'"

// Name is the job name, also its lease key.
func (p *Partitions) Name() string { return PartitionsJobName }

// Run creates and drops partitions, and logs what it did.
func (p *Partitions) Run(ctx context.Context) error {
	log := p.Log
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	log = log.With("job", PartitionsJobName)
	created, dropped, err := p.Maintain(ctx)
	for _, name := range created {
		log.Info("outbox partition created", "partition", name)
	}
	for _, name := range dropped {
		log.Info("outbox partition dropped", "partition", name, "retention", p.Retention.String())
	}
	if err != nil {
		log.Warn("outbox partition upkeep stopped", "error", err)
	}
	return err
}

// Maintain is Run's work: it returns the partitions it created and those
// it dropped.
func (p *Partitions) Maintain(ctx context.Context) (created, dropped []string, err error) {
	if p.Interval <= 0 || p.Ahead < 1 {
		return nil, nil, fmt.Errorf("outbox: partitions: interval %s and ahead %d must be positive", p.Interval, p.Ahead)
	}
	if created, err = p.relayEmpty(ctx); err != nil {
		return created, nil, err
	}
	more, err := p.create(ctx)
	if created = append(created, more...); err != nil {
		return created, nil, err
	}
	dropped, err = p.drop(ctx)
	return created, dropped, err
}

// relayEmpty lays the partitions anew on Interval while outbox_event holds
// no event and its partitions are not laid on Interval: on a fresh install,
// the two day-long partitions the migration made (it cannot know the
// configured interval), so that the first event already lands in a
// partition of partition_interval. The check, the drops and the new
// partitions from now to Ahead intervals past it are one transaction
// under the table's lock, so a producer waits for it and then finds its
// partition. A table that holds an event keeps its partitions: the
// interval applies from their end on. It returns the partitions it
// created.
func (p *Partitions) relayEmpty(ctx context.Context) ([]string, error) {
	rows, _ := p.Pool.Query(ctx, `SELECT lo, hi FROM outbox_partition`)
	bounds, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) ([2]time.Time, error) {
		var b [2]time.Time
		return b, r.Scan(&b[0], &b[1])
	})
	if err != nil {
		return nil, err
	}
	laid := true
	for _, b := range bounds {
		laid = laid && b[1].Sub(b[0]) == p.Interval && b[0].Equal(b[0].Truncate(p.Interval))
	}
	// Only an empty table is laid anew, and the lock below would make
	// producers wait: look without it first.
	var empty bool
	if err := p.Pool.QueryRow(ctx, `SELECT NOT EXISTS (SELECT 1 FROM outbox_event)`).Scan(&empty); laid || err != nil || !empty {
		return nil, err
	}
	var created []string
	err = pgx.BeginFunc(ctx, p.Pool, func(tx pgx.Tx) error {
		created = nil
		if _, err := tx.Exec(ctx, "SET LOCAL lock_timeout = "+partitionLockTimeout); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, "LOCK TABLE outbox_event IN ACCESS EXCLUSIVE MODE"); err != nil {
			return err
		}
		var empty bool
		var now time.Time
		if err := tx.QueryRow(ctx, `SELECT NOT EXISTS (SELECT 1 FROM outbox_event) AND NOT EXISTS (SELECT 1 FROM outbox_delivery)
			AND NOT EXISTS (SELECT 1 FROM outbox_purged), now()`).Scan(&empty, &now); err != nil || !empty {
			return err
		}
		rows, _ := tx.Query(ctx, `DELETE FROM outbox_partition RETURNING name`)
		names, err := pgx.CollectRows(rows, pgx.RowTo[string])
		if err != nil {
			return err
		}
		for _, name := range names {
			if _, err := tx.Exec(ctx, "DROP TABLE IF EXISTS "+pgx.Identifier{name}.Sanitize()); err != nil {
				return err
			}
		}
		until := now.Add(time.Duration(p.Ahead) * p.Interval)
		for lo := now.Truncate(p.Interval); lo.Before(until); lo = lo.Add(p.Interval) {
			var name string
			if err := tx.QueryRow(ctx, `SELECT outbox_event_add_partition($1, $2)`, lo, lo.Add(p.Interval)).Scan(&name); err != nil {
				return err
			}
			created = append(created, name)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("lay the partitions of the empty outbox_event on %s: %w", p.Interval, err)
	}
	return created, nil
}

// create adds partitions from the end of the last one (or the start of the
// current interval, after a gap) until Ahead intervals past now are
// covered. Bounds are multiples of Interval since the zero time, so a day
// starts at midnight UTC.
func (p *Partitions) create(ctx context.Context) ([]string, error) {
	var last *time.Time
	var now time.Time
	if err := p.Pool.QueryRow(ctx, `SELECT max(hi), now() FROM outbox_partition`).Scan(&last, &now); err != nil {
		return nil, err
	}
	lo := now.Truncate(p.Interval)
	if last != nil && last.After(lo) {
		lo = *last
	}
	until := now.Add(time.Duration(p.Ahead) * p.Interval)
	var created []string
	for ; lo.Before(until); lo = lo.Add(p.Interval) {
		var name string
		err := pgx.BeginFunc(ctx, p.Pool, func(tx pgx.Tx) error {
			if _, err := tx.Exec(ctx, "SET LOCAL lock_timeout = "+partitionLockTimeout); err != nil {
				return err
			}
			return tx.QueryRow(ctx, `SELECT outbox_event_add_partition($1, $2)`, lo, lo.Add(p.Interval)).Scan(&name)
		})
		if err != nil {
			return created, fmt.Errorf("create the partition from %s: %w", lo.UTC().Format(time.RFC3339), err)
		}
		created = append(created, name)
	}
	return created, nil
}

// A partition is done when no delivery row of its events is left: every
// one was published or purged. The probe walks the delivery rows in the
// partition's id range (the primary key), which is empty for a done
// partition, whatever the backlog of later ones.
const partitionDoneSQL = `
SELECT NOT EXISTS (SELECT 1 FROM outbox_delivery d
                   WHERE d.id BETWEEN r.lo AND r.hi AND d.created_at >= $1 AND d.created_at < $2)
FROM (SELECT min(id) AS lo, max(id) AS hi FROM %s) r`

// drop detaches and drops the partitions past retention that are done, and
// the V1 table once its history is past retention. Detaching CONCURRENTLY
// takes no lock producers or relays would wait for; it cannot run in a
// transaction, and one interrupted part way is finished by the next run.
func (p *Partitions) drop(ctx context.Context) ([]string, error) {
	rows, err := p.Pool.Query(ctx, `
SELECT name, lo, hi FROM outbox_partition
WHERE hi <= now() - make_interval(secs => $1) ORDER BY lo`, p.Retention.Seconds())
	if err != nil {
		return nil, err
	}
	type part struct {
		name   string
		lo, hi time.Time
	}
	expired, err := pgx.CollectRows(rows, func(r pgx.CollectableRow) (part, error) {
		var x part
		return x, r.Scan(&x.name, &x.lo, &x.hi)
	})
	if err != nil {
		return nil, err
	}
	var dropped []string
	for _, x := range expired {
		ident := pgx.Identifier{x.name}.Sanitize()
		var done bool
		if err := p.Pool.QueryRow(ctx, fmt.Sprintf(partitionDoneSQL, ident), x.lo, x.hi).Scan(&done); err != nil {
			return dropped, err
		}
		if !done {
			continue // events still to publish, or DEAD: kept
		}
		if err := p.detach(ctx, x.name); err != nil {
			return dropped, fmt.Errorf("drop partition %s: %w", x.name, err)
		}
		dropped = append(dropped, x.name)
	}
	if err := p.dropV1(ctx); err != nil {
		return dropped, err
	}
	return dropped, nil
}

// detach detaches the partition name (or finishes an earlier detach that
// was interrupted), then drops it and forgets it.
func (p *Partitions) detach(ctx context.Context, name string) error {
	ident := pgx.Identifier{name}.Sanitize()
	var pending *bool
	if err := p.Pool.QueryRow(ctx, `
SELECT i.inhdetachpending FROM pg_inherits i
WHERE i.inhrelid = to_regclass($1) AND i.inhparent = 'outbox_event'::regclass`, ident).Scan(&pending); err != nil && !errors.Is(err, pgx.ErrNoRows) {
		return err
	}
	conn, err := p.Pool.Acquire(ctx)
	if err != nil {
		return err
	}
	defer conn.Release()
	if _, err := conn.Exec(ctx, "SET lock_timeout = "+partitionLockTimeout); err != nil {
		return err
	}
	defer func() { _, _ = conn.Exec(context.WithoutCancel(ctx), "RESET lock_timeout") }()
	switch {
	case pending == nil: // detached already
	case *pending:
		_, err = conn.Exec(ctx, "ALTER TABLE outbox_event DETACH PARTITION "+ident+" FINALIZE")
	default:
		_, err = conn.Exec(ctx, "ALTER TABLE outbox_event DETACH PARTITION "+ident+" CONCURRENTLY")
	}
	if err != nil {
		return err
	}
	return pgx.BeginFunc(ctx, conn, func(tx pgx.Tx) error {
		// The purge records and the event_ids of its events go with it.
		if _, err := tx.Exec(ctx, `DELETE FROM outbox_purged p USING outbox_partition x
			WHERE x.name = $1 AND p.created_at >= x.lo AND p.created_at < x.hi`, name); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, `DELETE FROM outbox_event_id i USING outbox_partition x
			WHERE x.name = $1 AND i.created_at >= x.lo AND i.created_at < x.hi`, name); err != nil {
			return err
		}
		if _, err := tx.Exec(ctx, "DROP TABLE IF EXISTS "+ident); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, "DELETE FROM outbox_partition WHERE name = $1", name)
		return err
	})
}

// dropV1 drops the V1 table the cutover left, which holds only published
// history (the cutover carried everything else), once that is past
// retention.
func (p *Partitions) dropV1(ctx context.Context) error {
	var due bool
	err := p.Pool.QueryRow(ctx, `
SELECT to_regclass('outbox_event_v1') IS NOT NULL
   AND (SELECT cut_over_at FROM outbox_publication) <= now() - make_interval(secs => $1)`, p.Retention.Seconds()).Scan(&due)
	if err != nil || !due {
		return err
	}
	return pgx.BeginFunc(ctx, p.Pool, func(tx pgx.Tx) error {
		if _, err := tx.Exec(ctx, "SET LOCAL lock_timeout = "+partitionLockTimeout); err != nil {
			return err
		}
		_, err := tx.Exec(ctx, "DROP TABLE IF EXISTS outbox_event_v1")
		return err
	})
}
