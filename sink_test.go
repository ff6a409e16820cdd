package worker

import (
	"context"
	"errors"
	"testing"
	"time"

	ioutbox "github.com/worker-dev/worker/internal/outbox"
	"github.com/worker-dev/worker/outbox"
)

type fixedSink struct{ err error }

func (fixedSink) Name() string                                    { return "fixed" }
func (s fixedSink) Publish(context.Context, outbox.Message) error { return s.err }

// The relay classifies a custom sink's errors as it does a built-in
// sink's: the public error kinds reach it as its own.
func TestCustomSinkErrorKindsReachTheRelay(t *testing.T) {
	publish := func(err error) error {
		return portSink{fixedSink{err}}.Publish(context.Background(), ioutbox.Event{EventID: "e"})
	}
	boom := errors.New("boom")

	if err := publish(outbox.Permanent(boom)); !ioutbox.IsPermanent(err) {
		t.Errorf("Permanent: %v is not permanent to the relay", err)
	}
	if err := publish(outbox.Unavailable(boom)); !ioutbox.IsUnavailable(err) || ioutbox.IsPermanent(err) {
		t.Errorf("Unavailable: %v is not unavailability to the relay", err)
	}
	var ra *ioutbox.RetryAfterError
	if err := publish(&outbox.RetryAfterError{Err: boom, After: time.Minute}); !errors.As(err, &ra) || ra.After != time.Minute || !errors.Is(err, boom) {
		t.Errorf("RetryAfterError: the relay sees %v (%+v), want a retry after 1m wrapping boom", err, ra)
	}
	if err := publish(outbox.Permanent(&outbox.RetryAfterError{Err: boom, After: time.Minute})); !ioutbox.IsPermanent(err) {
		t.Errorf("a permanent error stays permanent with a retry time inside: %v", err)
	}
	if err := publish(boom); ioutbox.IsPermanent(err) || ioutbox.IsUnavailable(err) || !errors.Is(err, boom) {
		t.Errorf("a plain error counts one attempt: %v", err)
	}
}
