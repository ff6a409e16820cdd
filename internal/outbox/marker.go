package outbox

import (
	"context"
	"fmt"
	"math"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/jackc/pgx/v5"

	"github.com/worker-dev/worker/internal/pglisten"
)

// A relay that dies while publishes are detached leaves their events
// IN_FLIGHT under its owner token, and their aggregates would wait for the
// visibility deadline (in_flight_timeout). The database knows sooner: a
// killed process's sessions end with it. So each relay holds a marker on
// its LISTEN connection: a shared session-level advisory lock
// (markerLockClass, id), the id drawn once per relay from
// outbox_relay_marker_seq, so it is never reused. A detach names the
// marker in claimed_by (token@id). Every relay's listener also looks at
// the markers in pg_locks every markerPoll; a marker it saw held and then
// finds missing for markerGrace is a dead owner's, and it makes that
// owner's IN_FLIGHT events due at once (reclaimSQL). The loops then claim
// them as any expired IN_FLIGHT event, in order.
//
// Why this design. The server releases a session lock the moment the
// session ends, whatever ended it: nothing to write while alive, nothing to
// clean up after a death. The LISTEN connection exists anyway, so the
// marker costs no connection, and pg_locks is readable by every role,
// while pg_stat_activity hides other roles' sessions. The lock provider
// stays session-free; the marker belongs to the relay, which needs a
// session for LISTEN already. The marker rides in claimed_by rather than a
// column of its own: every later claim rewrites claimed_by, so an event
// that another relay, or an older version, detached again cannot carry a
// stale marker.
//
// What must never happen is making a live owner's events due early: its
// publish may land after the aggregate's next event, published by the
// relay that took it over. A marker can vanish while its owner lives, so:
//   - A missing marker never means death; only one that was seen held and
//     is gone does, and only on one unbroken session of the watcher. A
//     restart, crash or failover of the server ends every session, the
//     watcher's too, so it starts over having seen nothing; the owners take
//     their markers back when they reconnect. A new session counts as seen
//     the markers that IN_FLIGHT events detached since the server started
//     name (namedMarkersSQL): a detach writes only while its marker is held
//     (below), so such a marker was held on this server, as surely as if
//     the session had looked then. Without that, a replica that starts
//     just before another dies never saw the dead one's marker, and its
//     events waited for the timeout.
//   - Only a session of its own gets a marker. Behind a pooler the
//     listener's backend is not the one its startup named (the
//     BackendKeyData pid is not pg_backend_pid()), or it changes between
//     statements; the relay then takes no marker, names none and watches
//     none: its events wait for the timeout, as before.
//   - A detach names the marker only while the relay's last look, at most
//     markerFresh ago, found it held by its own session. An event
//     detached otherwise names none and waits for the timeout if its
//     relay dies.
//   - The relay never lets go of a marker that detached events may still
//     be named by and published under: it gives up on a connection that
//     does not answer only after markerBound (in_flight_timeout +
//     markerFresh), and on TCP tells the server not to end the session for
//     silence sooner (tcp_user_timeout, tcp_keepalives_idle). An event is
//     named at most markerFresh after the look that confirmed the marker,
//     and its publish is cancelled at 90% of in_flight_timeout after its
//     claim, so both bounds end later than any such publish: a relay cut
//     off from the database frees nothing before its timeout would. At a
//     stop the marker goes only once the relay has stopped, its detached
//     publishes done or handed back.
//   - After a lost connection the listener reconnects and takes the same id
//     again; markerGrace leaves it the time. So a session that something
//     outside ends (pg_terminate_backend, a proxy resetting connections)
//     is not taken for a death when the relay is back within the grace.
//     That is the one case left: a session ended from outside whose relay
//     cannot reconnect within markerGrace looks dead.
//
// A statement can outlive its sender. A relay's claim transaction sends
// its detach and its COMMIT in one round trip; if the process dies right
// after, the server still runs them (the bytes are in its socket) and only
// then reads the end of the connection, tens of milliseconds after the
// marker's session ended. So the owner's liveness is judged inside the
// statements, in two steps that no order of death and statement defeats:
//   - The detach writes IN_FLIGHT only if it sees the marker held by the
//     relay's marker session in the same statement (markInFlightNamedSQL);
//     otherwise it changes nothing, and the commit frees the events for
//     any relay at once. Run after the marker is gone, it cannot hide an
//     event from the reclaim.
//   - Before it, the claim transaction takes the marker's detach lock
//     (detachLockClass, id) shared, until it ends. The reclaim takes that
//     lock exclusively, without waiting, before it looks for the marker's
//     events (reclaim), and tries again at the next look while it cannot.
//     Every transaction that saw the marker held has then committed or
//     rolled back, so its events are visible to the reclaim, and any
//     later one changes nothing. Without the lock, a detach that saw the
//     marker just before the death and committed after the reclaim looked
//     would name a marker nobody looks for again.
//
// The price: a detach that runs in the moment between the server ending a
// live relay's marker session and the relay noticing leaves its events
// free while their publishes are out. The relay logs it, and those events
// may be published twice.
//
// in_flight_timeout remains the backstop for an owner that is alive but
// stuck (it keeps its marker), for events that name no marker, and for a
// relay whose death no other relay saw. Once another relay has claimed a
// reclaimed event, a late completion by its first owner is refused by the
// compare-and-set on token and attempts (completeSQL).

const (
	// markerLockClass is the first key of the markers' two-key advisory
	// locks (SQL text), apart from the insert trigger's aggregate locks
	// (7304564) and from single-key locks an application may take.
	markerLockClass = "7304565"
	// detachLockClass is the first key of the markers' detach locks: a
	// claim transaction holds (detachLockClass, id) shared from its detach
	// to its end, a reclaim of marker id takes it exclusively.
	detachLockClass = "7304567"
	// markerPoll is how often the listener looks at the markers.
	markerPoll = 200 * time.Millisecond
	// markerGrace is how long a marker must stay missing before its owner
	// counts as dead: a relay whose connection was ended from outside
	// reconnects and takes its marker back well within it.
	markerGrace = 500 * time.Millisecond
	// markerFresh is how long after a look that found the marker held the
	// relay still names it in detaches.
	markerFresh = 2 * time.Second
)

// markerBound is the shortest time after the last look that found its
// marker held for which the relay's marker session may end on its own
// account, or for silence on the server's (see above).
func (l *listener) markerBound() time.Duration { return l.inFlightTimeout + markerFresh }

// marker is the relay's marker as its detaches see it.
type marker struct {
	mu    sync.Mutex
	id    int64     // from outbox_relay_marker_seq; 0 until drawn
	pid   uint32    // backend of the session holding it; 0 when none does
	fresh time.Time // detaches may name it until then
	off   bool      // the listener has no session of its own: no marker
}

// current returns the marker a detach may name now.
func (m *marker) current() (id int64, pid uint32, ok bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.off || m.pid == 0 || !time.Now().Before(m.fresh) {
		return 0, 0, false
	}
	return m.id, m.pid, true
}

func (m *marker) held(id int64, pid uint32, fresh time.Time) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.id, m.pid, m.fresh = id, pid, fresh
}

// drawn keeps the relay's id, drawn once.
func (m *marker) drawn(id int64) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.id = id
}

// lost forgets the session that held the marker; the id stays.
func (m *marker) lost() {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.pid, m.fresh = 0, time.Time{}
}

func (m *marker) snapshot() (id int64, off bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.id, m.off
}

// markerWatch is what one listener session knows of the markers. A new
// session starts empty: what an earlier one saw says nothing about this
// one's server.
type markerWatch struct {
	seen     map[int64]time.Time // markers seen held: zero while held, else when first found missing
	named    bool                // this session holds the marker, and its detaches may name it
	adopted  bool                // the markers in flight events name were counted as seen (namedMarkersSQL)
	lastGood time.Time           // start of the last look that succeeded
	failing  bool                // a look failed since the last good one (logged once)
	lastPing time.Time           // without a marker: the last health check
}

// observe records one look (the markers held, started at at) and returns
// the markers missing for markerGrace.
func (w *markerWatch) observe(held []int64, own int64, at time.Time) (dead []int64) {
	now := make(map[int64]bool, len(held))
	for _, m := range held {
		if m != own {
			now[m] = true
			w.seen[m] = time.Time{}
		}
	}
	for m, missing := range w.seen {
		switch {
		case now[m]:
		case missing.IsZero():
			w.seen[m] = at
		case at.Sub(missing) >= markerGrace:
			dead = append(dead, m)
		}
	}
	return dead
}

// markerHolders selects the markers held in this database.
const markerHolders = `
FROM pg_locks l
WHERE l.locktype = 'advisory' AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.classid::bigint = ` + markerLockClass + ` AND l.objsubid = 2 AND l.mode = 'ShareLock' AND l.granted`

const (
	// markerSetupSQL draws the relay's id the first time ($1 = 0), tells
	// the server not to end the session for less than $2 s of silence
	// ($3 ms of unacknowledged data), and takes the marker. set_config
	// returns the socket's value: 0 on a Unix socket, where there is no
	// silence to wait out, and on a platform without the option.
	markerSetupSQL = `
WITH m AS (SELECT CASE WHEN $1::bigint > 0 THEN $1::bigint ELSE nextval('outbox_relay_marker_seq') END AS id)
SELECT m.id, set_config('tcp_keepalives_idle', $2, false), set_config('tcp_user_timeout', $3, false),
       pg_try_advisory_lock_shared(` + markerLockClass + `, m.id::integer)
FROM m`

	// markerPollSQL is one look: this session's backend, the markers held,
	// and whether this session holds marker $1.
	markerPollSQL = `
SELECT pg_backend_pid(), coalesce(array_agg(DISTINCT l.objid::bigint), '{}'),
       coalesce(bool_or(l.pid = pg_backend_pid() AND l.objid::bigint = $1), false)` + markerHolders

	// namedMarkersSQL lists the markers named by IN_FLIGHT events detached
	// since the server started ($1: in_flight_timeout in ms, which the
	// detach added to its clock_timestamp()). An event detached before a
	// restart names a marker whose owner may still be reconnecting.
	namedMarkersSQL = `
SELECT DISTINCT substring(claimed_by FROM '@([0-9]+)$')::bigint
FROM outbox_delivery
WHERE status = 'IN_FLIGHT' AND next_attempt_at > now() AND claimed_by ~ '@[0-9]+$'
  AND next_attempt_at - $1 * interval '1 millisecond' > pg_postmaster_start_time()`

	// reclaimLockSQL tries the detach lock of marker $1 for the reclaim's
	// transaction: false while a claim transaction that may still commit
	// events naming the marker is open.
	reclaimLockSQL = `SELECT pg_try_advisory_xact_lock(` + detachLockClass + `, $1::integer)`

	// reclaimSQL makes the IN_FLIGHT events that name marker $1 due now,
	// unless the marker is held again by now (its owner came back). Rows
	// another session locks are being claimed already. It returns the
	// tokens it reclaimed.
	reclaimSQL = `
WITH held AS (SELECT 1` + markerHolders + ` AND l.objid::bigint = $1),
due AS (
    SELECT e.ctid FROM outbox_delivery e
    WHERE e.status = 'IN_FLIGHT' AND e.next_attempt_at > now()
      AND e.claimed_by LIKE '%@' || $1::bigint AND NOT EXISTS (SELECT 1 FROM held)
    FOR UPDATE SKIP LOCKED
)
UPDATE outbox_delivery e SET next_attempt_at = clock_timestamp()
FROM due WHERE e.ctid = due.ctid
RETURNING e.claimed_by`
)

// markerHooks keep the marker and the watch on the listener's session.
func (l *listener) markerHooks() pglisten.Hooks {
	return pglisten.Hooks{Setup: l.markerSetup, Tick: l.markerTick, Every: markerPoll, Ended: l.marker.lost}
}

// markerSetup takes the marker on a new listener session.
func (l *listener) markerSetup(ctx context.Context, conn *pgx.Conn) error {
	start := time.Now()
	l.watch = &markerWatch{seen: map[int64]time.Time{}, lastGood: start, lastPing: start}
	id, off := l.marker.snapshot()
	if off {
		return nil
	}
	qctx, cancel := context.WithTimeout(ctx, l.markerBound())
	defer cancel()
	var pid uint32
	var unix bool
	if err := conn.QueryRow(qctx, `SELECT pg_backend_pid(), inet_client_addr() IS NULL`).Scan(&pid, &unix); err != nil {
		return l.markerError(conn, "check the listener's session", err)
	}
	if pid != conn.PgConn().PID() {
		l.markerOff()
		return nil
	}
	silence := l.markerBound()
	wantIdle := int64(math.Ceil(silence.Seconds()))
	var keepIdle, userTimeout string
	var locked bool
	if err := conn.QueryRow(qctx, markerSetupSQL, id, strconv.FormatInt(wantIdle, 10),
		strconv.FormatInt(silence.Milliseconds(), 10)).Scan(&id, &keepIdle, &userTimeout, &locked); err != nil {
		return l.markerError(conn, "take the relay's marker", err)
	}
	l.marker.drawn(id)
	if !unix && (atLeast(keepIdle, wantIdle) != nil || atLeast(userTimeout, silence.Milliseconds()) != nil) {
		l.log.WarnContext(ctx, "outbox relay marker not taken: the server cannot be told to keep its session through a silence; events this relay detaches wait for outbox.in_flight_timeout if it dies",
			"tcp_keepalives_idle", keepIdle, "tcp_user_timeout", userTimeout)
		return nil
	}
	if !locked {
		l.log.WarnContext(ctx, "outbox relay marker not taken: another session holds it exclusively; events this relay detaches wait for outbox.in_flight_timeout if it dies",
			"marker", id)
		return nil
	}
	l.watch.named = true
	l.marker.held(id, pid, start.Add(markerFresh))
	return nil
}

func atLeast(v string, want int64) error {
	n, err := strconv.ParseInt(v, 10, 64)
	if err == nil && n < want {
		err = fmt.Errorf("%d is below %d", n, want)
	}
	return err
}

// markerError ends the session if its connection is gone; otherwise the
// relay goes on without a marker on this session.
func (l *listener) markerError(conn *pgx.Conn, what string, err error) error {
	if conn.IsClosed() {
		return err
	}
	l.log.Warn("outbox relay marker not taken: could not "+what+"; events this relay detaches wait for outbox.in_flight_timeout if it dies",
		"error", err)
	return nil
}

// markerOff gives up the marker for the relay's life: its listener has no
// session of its own.
func (l *listener) markerOff() {
	l.marker.mu.Lock()
	l.marker.off, l.marker.pid = true, 0
	l.marker.mu.Unlock()
	l.log.Warn("outbox relay marker off: the listener's connection is not a session of its own (a connection pooler?); events a dead replica detached wait for outbox.in_flight_timeout")
}

// markerTick looks at the markers: it confirms this relay's own and
// reclaims the events of the owners whose markers are gone.
func (l *listener) markerTick(ctx context.Context, conn *pgx.Conn) error {
	w := l.watch
	start := time.Now()
	id, off := l.marker.snapshot()
	if off {
		// No marker: a health check every pglisten.DefaultIdle, as a
		// listener without one does.
		if start.Sub(w.lastPing) < pglisten.DefaultIdle {
			return nil
		}
		w.lastPing = start
		pctx, cancel := context.WithTimeout(ctx, pglisten.DefaultIdle)
		defer cancel()
		return conn.Ping(pctx)
	}
	qctx, cancel := context.WithTimeout(ctx, l.markerBound())
	defer cancel()
	var pid uint32
	var held []int64
	var mine bool
	if err := conn.QueryRow(qctx, markerPollSQL, id).Scan(&pid, &held, &mine); err != nil {
		return l.lookFailed(w, conn, err)
	}
	if pid != conn.PgConn().PID() {
		l.markerOff()
		return nil
	}
	w.lastGood = start
	if w.named && mine {
		l.marker.held(id, pid, start.Add(markerFresh))
	}
	if !w.adopted {
		rows, _ := conn.Query(qctx, namedMarkersSQL, l.inFlightTimeout.Milliseconds())
		named, err := pgx.CollectRows(rows, pgx.RowTo[int64])
		if err != nil {
			return l.lookFailed(w, conn, err)
		}
		for _, m := range named {
			if _, ok := w.seen[m]; !ok && m != id {
				w.seen[m] = time.Time{}
			}
		}
		w.adopted = true
	}
	l.looks.Add(1)
	for _, m := range w.observe(held, id, start) {
		done, err := l.reclaim(ctx, conn, m)
		if err != nil {
			return l.lookFailed(w, conn, err) // the marker stays seen: tried again next look
		}
		if done {
			delete(w.seen, m)
		}
	}
	w.failing = false
	return nil
}

// lookFailed decides what a failed statement on the marker session means:
// a lost connection ends the session, and so does a connection that has
// not answered for markerBound; anything else waits for the next look.
func (l *listener) lookFailed(w *markerWatch, conn *pgx.Conn, err error) error {
	if conn.IsClosed() || time.Since(w.lastGood) >= l.markerBound() {
		return err
	}
	if !w.failing {
		w.failing = true
		l.log.Warn("outbox relay marker look failed; trying again", "error", err)
	}
	return nil
}

// reclaim makes the IN_FLIGHT events of the dead owner of marker m due,
// wakes the relays and logs one line. It reports false, having changed
// nothing, while a transaction of the owner's that may still commit
// events naming m is open: the next look tries again.
func (l *listener) reclaim(ctx context.Context, conn *pgx.Conn, m int64) (done bool, err error) {
	qctx, cancel := context.WithTimeout(ctx, l.markerBound())
	defer cancel()
	var tokens []string
	err = pgx.BeginFunc(qctx, conn, func(tx pgx.Tx) error {
		if err := tx.QueryRow(qctx, reclaimLockSQL, m).Scan(&done); err != nil || !done {
			return err
		}
		// A statement of its own, so its snapshot is taken after the lock:
		// it sees whatever the owner's transactions committed.
		rows, _ := tx.Query(qctx, reclaimSQL, m)
		tokens, err = pgx.CollectRows(rows, pgx.RowTo[string])
		return err
	})
	if err != nil || !done {
		return false, err
	}
	if len(tokens) > 0 {
		l.log.InfoContext(ctx, "outbox relay gone; its detached events reclaimed", "events", len(tokens),
			"owner", ownerOf(tokens[0]), "marker", m)
	}
	// Also when nothing was reclaimed: the owner's last transactions freed
	// the events they held, which idle loops would otherwise find only at
	// their next poll. The other replicas' loops may be idle too, every
	// head they saw being in flight.
	l.wake()
	_, err = conn.Exec(qctx, "SELECT pg_notify($1, '')", NotifyChannel)
	if err != nil && !conn.IsClosed() {
		err = nil
	}
	return true, err
}

// ownerOf is the owner part of a detach's token, instance/batch@marker:
// the instance id.
func ownerOf(token string) string {
	if i := strings.LastIndexByte(token, '/'); i >= 0 {
		return token[:i]
	}
	return token
}
