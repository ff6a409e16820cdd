// Package kafka is the inbox source for Kafka (inbox.sources[].kind:
// kafka): a consumer group over the configured topics, with franz-go's
// auto-commit off. Each poll is one batch of at most inbox.batch_size
// records, handed to the inbox; offsets are committed after the inbox
// commit, and only through records whose outcome is settled.
//
// A record the inbox finds busy (another replica holds its claim, which
// happens around rebalances) cannot be nak'd as in NATS: it is handed to
// the inbox again after the wait the inbox asks for, and its partition's
// offset is not committed past it until it settles.
//
// Rebalances. The client blocks rebalances from a poll until its batch is
// processed and committed (BlockRebalanceOnPoll), so a partition is never
// revoked while its records are being processed, and every commit is for
// partitions this member owns. Nothing is left uncommitted when a
// rebalance runs, so the revoke and lost callbacks have nothing to do. The
// price: a batch should finish within the group's rebalance timeout,
// inbox.lease_ttl or kafka.session_timeout, whichever is longer. Each
// round of work ends within 2/3 of the lease, so only a batch whose
// failures are retried in place runs longer; its member is then dropped
// from the group and rejoins, and the records it had not committed run
// again on their new owner as duplicates, which the inbox absorbs.
//
// Order. A partition's records reach the inbox in offset order, and the
// inbox processes a batch in order per aggregate (ce_source/ce_subject, or
// the record key for a record without ce_subject). A partition has one
// owner at a time, so the order of an aggregate whose records share a
// partition (the outbox's Kafka sink keys them so) holds, except around a
// rebalance, when a busy record is processed by the replica that held it.
//
// A new group starts at the earliest offset. An outage (no broker answers,
// the group cannot be joined) is reported as the source being down, never
// as a message's failure, and probed with capped, jittered backoff. Run
// returns an error only for what retrying cannot fix: refused credentials
// or authorisation, unusable TLS files, a missing topic.
package kafka
