// Command audit is the custom sink of docs/sinks.md: the stock worker plus
// a sink named "audit" that writes each event to an audit store over HTTP.
// APP_OUTBOX_SINK=audit selects it; AUDIT_URL is the store's address.
package main

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"net/http"
	"net/url"
	"os"
	"time"

	"github.com/worker-dev/worker"
	"github.com/worker-dev/worker/outbox"
)

type auditSink struct{ client *auditClient }

func (auditSink) Name() string { return "audit" }

func (s auditSink) Publish(ctx context.Context, m outbox.Message) error {
	err := s.client.Put(ctx, m.EventID, m.AggregateID, m.Payload) // idempotent on EventID
	switch {
	case errors.Is(err, errRejected):
		return outbox.Permanent(err) // the event goes DEAD at once
	case errors.Is(err, errMaintenance):
		return outbox.Unavailable(err) // the sink is down: no attempt spent, the relay probes
	case errors.Is(err, errThrottled):
		return &outbox.RetryAfterError{Err: err, After: time.Minute}
	}
	return err // nil: published; other errors count one attempt
}

func main() {
	os.Exit(worker.Run(os.Args[1:], worker.WithSink("audit", func(ctx context.Context) (outbox.Sink, error) {
		return auditSink{client: newAuditClient(os.Getenv("AUDIT_URL"))}, nil
	})))
}

// auditClient is the audit store's client: what a client library of the
// destination would give, with the errors such a library documents.
type auditClient struct {
	base string
	http *http.Client
}

var (
	errRejected    = errors.New("audit: record rejected")      // it never will be accepted
	errMaintenance = errors.New("audit: down for maintenance") // all records wait
	errThrottled   = errors.New("audit: throttled")            // this client sends too much
)

func newAuditClient(base string) *auditClient {
	return &auditClient{base: base, http: &http.Client{}}
}

// Put stores payload under id. Storing an id again replaces the record
// with the same one, so a retried event is stored once.
func (c *auditClient) Put(ctx context.Context, id, aggregateID string, payload []byte) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodPut, c.base+"/records/"+url.PathEscape(id), bytes.NewReader(payload))
	if err != nil {
		return err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Audit-Aggregate-Id", aggregateID)
	resp, err := c.http.Do(req)
	if err != nil {
		// Returned as it is: the relay counts a network error, a timeout or
		// a cancelled ctx as the sink being unavailable.
		return err
	}
	defer resp.Body.Close()
	// Read to the end so that the connection is reused.
	_, _ = io.Copy(io.Discard, resp.Body)
	switch code := resp.StatusCode; {
	case code < 300:
		return nil
	case code == http.StatusTooManyRequests:
		return errThrottled
	case code == http.StatusServiceUnavailable:
		return errMaintenance
	case code < 500:
		return fmt.Errorf("%w: %s", errRejected, resp.Status)
	}
	return fmt.Errorf("audit: %s", resp.Status)
}
