// Package webhook is the HTTP wire convention both directions share: the
// Standard Webhooks signature (HMAC-SHA256, whsec_ secrets) and the
// CloudEvents HTTP binding (Ce- headers, percent-encoded) as an
// encode/decode pair. The outbox's sink (outbox/sink/webhook) signs and
// sends with it, the inbox's source (inbox/source/webhook) verifies and
// reads with it.
package webhook
