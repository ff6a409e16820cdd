package inbox

// The statements of the inbox's state machine (docs/inbox.md, "States").
// Every one names the consumer and the keys as arrays, so a batch costs
// one statement, and every write after the claim is a compare-and-set on
// the claim's owner and token: a claim that was taken over, or handed to
// an operator, writes nothing.

// keysIn matches the rows of consumer $1 whose keys are the pairs of the
// arrays $2 (msg_source) and $3 (msg_id).
const keysIn = `consumer = $1 AND (msg_source, msg_id) IN (SELECT * FROM unnest($2::text[], $3::text[]))`

// held matches rows of keysIn still claimed by owner $4 with token $5.
const held = keysIn + ` AND owner = $4 AND lease_token = $5`

// claimToken draws the token of a claim transaction and bounds it on the
// server (see boundWork): its first statement. insertClaimed reads the
// token back with currval.
const claimToken = `SELECT nextval('inbox_lease_token_seq'),
       set_config('statement_timeout', $1, true), set_config('idle_in_transaction_session_timeout', $2, true)`

// insertClaimed claims new messages under owner $4 and the transaction's
// token (claimToken). They go straight to PROCESSING: their work starts
// at once. A key that exists is left alone; the claim looks at it next.
//
// The keys are inserted in one order, the same in every transaction, so
// that two claims racing over the same duplicate keys wait for each other
// instead of deadlocking: an insert of a key another open transaction
// inserted waits for that transaction, and finds its row once it commits.
const insertClaimed = `
INSERT INTO inbox_message (consumer, msg_source, msg_id, state, owner, lease_token, lease_until,
                           order_key, msg_type, origin, headers, body)
SELECT $1, s, i, 'PROCESSING', $4, currval('inbox_lease_token_seq'), now() + $5::interval, ok, ty, og, h, b
  FROM unnest($2::text[], $3::text[], $6::text[], $7::text[], $8::text[], $9::jsonb[], $10::bytea[])
       AS u(s, i, ok, ty, og, h, b)
 ORDER BY s COLLATE "C", i COLLATE "C"
ON CONFLICT DO NOTHING
RETURNING msg_source, msg_id`

// insertProcessed is insertClaimed for a transactional handler's first
// try: its claim, work and PROCESSED commit together or not at all, and
// no other session sees the row before that commit, so the row is written
// once, already the dedupe record markProcessed would make of it, with no
// body or headers to store and then clear. A message that must not run
// after all (behind a busy one of its order key) is rewritten by
// unprocess; a failed work rolls the transaction back, and its retry
// claims with insertClaimed.
const insertProcessed = `
INSERT INTO inbox_message (consumer, msg_source, msg_id, state, finished_at, order_key, msg_type, origin)
SELECT $1, s, i, 'PROCESSED', now(), ok, ty, og
  FROM unnest($2::text[], $3::text[], $4::text[], $5::text[], $6::text[]) AS u(s, i, ok, ty, og)
 ORDER BY s COLLATE "C", i COLLATE "C"
ON CONFLICT DO NOTHING
RETURNING msg_source, msg_id`

// unprocess turns rows insertProcessed wrote in this transaction into
// claims let go (release): RECEIVED under owner $4 and token $5, their
// lease ended, with the headers ($6) and body ($7) a takeover runs them
// from.
const unprocess = `
UPDATE inbox_message m
   SET state = 'RECEIVED', finished_at = NULL, owner = $4, lease_token = $5, lease_until = now(), headers = u.h, body = u.b
  FROM unnest($2::text[], $3::text[], $6::jsonb[], $7::bytea[]) AS u(s, i, h, b)
 WHERE m.consumer = $1 AND m.msg_source = u.s AND m.msg_id = u.i AND m.state = 'PROCESSED'`

// insertDead dead-letters messages that cannot be processed, with their
// reason ($4); a redelivery of one finds it and is a duplicate. Sorted
// like insertClaimed.
const insertDead = `
INSERT INTO inbox_message (consumer, msg_source, msg_id, state, origin, headers, body, last_error, finished_at)
SELECT $1, s, i, 'DEAD', og, h, b, e, now()
  FROM unnest($2::text[], $3::text[], $4::text[], $5::text[], $6::jsonb[], $7::bytea[]) AS u(s, i, e, og, h, b)
 ORDER BY s COLLATE "C", i COLLATE "C"
ON CONFLICT DO NOTHING
RETURNING msg_source, msg_id`

// lockExisting reads the rows of keys that exist already. A row another
// transaction holds (its work committing now) is skipped: that delivery
// is busy.
const lockExisting = `
SELECT msg_source, msg_id, state, coalesce(owner, ''), coalesce(lease_token, 0),
       coalesce(lease_until <= now(), false),
       greatest(coalesce(extract(epoch FROM lease_until - now()), 0), 0)
  FROM inbox_message WHERE ` + keysIn + `
   FOR UPDATE SKIP LOCKED`

// takeOver claims RECEIVED and FAILED rows whose lease expired: their
// work never started, or failed and rolled back. Like new claims, they go
// to PROCESSING, their work next.
const takeOver = `
UPDATE inbox_message SET state = 'PROCESSING', owner = $4, lease_token = $5, lease_until = now() + $6::interval
 WHERE ` + keysIn + ` AND state IN ('RECEIVED', 'FAILED') AND lease_until <= now()
RETURNING msg_source, msg_id, attempts`

// toRecovery ends PROCESSING rows whose lease expired: their holder may
// have done part of the work's effects outside the transaction, so only
// an operator decides (worker inbox recovery). The try that was cut off
// counts as an attempt.
const toRecovery = `
UPDATE inbox_message
   SET state = 'RECOVERY_REQUIRED', finished_at = now(), attempts = attempts + 1,
       last_error = 'the processing lease of ' || owner || ' expired at ' || lease_until::text || ' before its work committed',
       owner = NULL, lease_token = NULL, lease_until = NULL
 WHERE ` + keysIn + ` AND state = 'PROCESSING' AND lease_until <= now()
RETURNING msg_source, msg_id, last_error`

// begin marks claimed rows PROCESSING again, for $6, before a retry's
// work. For a handler with external effects it commits on its own: from
// there on an expired lease means the work may have started. A
// transactional handler's retry runs it in its work transaction.
const begin = `
UPDATE inbox_message SET state = 'PROCESSING', lease_until = now() + $6::interval
 WHERE ` + held + ` AND state IN ('RECEIVED', 'FAILED', 'PROCESSING')
RETURNING msg_source, msg_id, attempts`

// states reads the state of rows, to settle those a claim lost.
const states = `SELECT msg_source, msg_id, state FROM inbox_message WHERE ` + keysIn

// markProcessed is the work transaction's last statement: it turns the
// rows still held and PROCESSING into dedupe records. Rows it does not
// return were taken from this claim; the transaction must roll back.
const markProcessed = `
UPDATE inbox_message
   SET state = 'PROCESSED', finished_at = now(), owner = NULL, lease_token = NULL, lease_until = NULL,
       headers = '{}', body = NULL, last_error = NULL
 WHERE ` + held + ` AND state = 'PROCESSING'
RETURNING msg_source, msg_id`

// markFailed records failed work ($6 errors, $7 backoffs in seconds, $8
// max_attempts, $9 lease, $10 permanent): FAILED and held for the retry
// after the backoff, or DEAD when out of attempts or permanent.
const markFailed = `
UPDATE inbox_message m
   SET attempts = m.attempts + 1, last_error = f.e,
       state = CASE WHEN (f.p OR m.attempts + 1 >= $8) THEN 'DEAD' ELSE 'FAILED' END,
       finished_at = CASE WHEN (f.p OR m.attempts + 1 >= $8) THEN now() END,
       owner = CASE WHEN (f.p OR m.attempts + 1 >= $8) THEN NULL ELSE m.owner END,
       lease_token = CASE WHEN (f.p OR m.attempts + 1 >= $8) THEN NULL ELSE m.lease_token END,
       lease_until = CASE WHEN (f.p OR m.attempts + 1 >= $8) THEN NULL
                          ELSE now() + $9::interval + make_interval(secs => f.w) END
  FROM unnest($2::text[], $3::text[], $6::text[], $7::float8[], $10::bool[]) AS f(s, i, e, w, p)
 WHERE m.consumer = $1 AND m.msg_source = f.s AND m.msg_id = f.i
   AND m.owner = $4 AND m.lease_token = $5 AND m.state = 'PROCESSING'
RETURNING m.msg_source, m.msg_id, m.state`

// release puts rows whose work did not run (held behind a failure of
// their order key, or let go) back to RECEIVED, so a takeover may run
// them; let go, their lease ends now.
const release = `UPDATE inbox_message SET state = 'RECEIVED', lease_until = least(lease_until, now() + $6::interval)
 WHERE ` + held + ` AND state IN ('RECEIVED', 'PROCESSING', 'FAILED')`

// orphans reads claims whose lease expired, whatever their source does: a
// replica that died with them, a webhook sender that gave up, or an
// operator's requeue (owner 'operator', worker inbox dead retry). The
// sweep runs them through their consumer from their stored message: a
// RECEIVED or FAILED one is taken over, a PROCESSING one goes to an
// operator.
const orphans = `
SELECT consumer, msg_source, msg_id, msg_type, order_key, origin, headers, coalesce(body, '')
  FROM inbox_message
 WHERE finished_at IS NULL AND lease_until <= now()
 ORDER BY lease_until
 LIMIT $1`
