// Package inbox holds what a Go inbox handler needs
// (worker.WithInboxHandler): the message it is given, and the error that
// dead-letters a message at once.
package inbox

import iinbox "github.com/worker-dev/worker/internal/inbox"

// Message is one message an inbox source received: its dedupe key
// (Source, ID), Type, OrderKey, Origin, Headers, Body and the Attempt its
// work is on.
type Message = iinbox.Message

// Permanent wraps a handler's error that no retry can fix: the message is
// dead-lettered without using its remaining attempts.
func Permanent(err error) error { return iinbox.Permanent(err) }
