package tasks

import (
	"context"
	"encoding/json"
	"log/slog"
	"strings"
)

// Meta is the caller's context that rides with a task, in River's job
// metadata, into every log line of the task's runs (and, for http tasks,
// into the request headers).
type Meta struct {
	RequestID     string `json:"request_id,omitempty"`
	Traceparent   string `json:"traceparent,omitempty"`
	TraceID       string `json:"trace_id,omitempty"`
	CorrelationID string `json:"correlation_id,omitempty"`
	TenantID      string `json:"tenant_id,omitempty"`
}

type metaKey struct{}

// WithMeta stores m in ctx; Enqueue copies it into the tasks it inserts.
// Request handlers call it once, with what they got from their caller.
func WithMeta(ctx context.Context, m Meta) context.Context {
	return context.WithValue(ctx, metaKey{}, m)
}

// MetaFrom returns the Meta stored in ctx by WithMeta, or the one of the
// task being run.
func MetaFrom(ctx context.Context) Meta {
	m, _ := ctx.Value(metaKey{}).(Meta)
	return m
}

// normalized fills trace_id from traceparent (W3C: version-traceid-spanid-
// flags) when only the latter is given.
func (m Meta) normalized() Meta {
	if m.TraceID == "" {
		if parts := strings.Split(m.Traceparent, "-"); len(parts) == 4 && len(parts[1]) == 32 {
			m.TraceID = parts[1]
		}
	}
	return m
}

// metaFromJob reads the propagated fields from a job's metadata; other
// metadata keys (River's own, the application's) are left alone.
func metaFromJob(metadata []byte) Meta {
	var m Meta
	_ = json.Unmarshal(metadata, &m) // a task with odd metadata still runs
	return m.normalized()
}

// logAttrs are the fields every log line of a task run carries.
func (m Meta) logAttrs() []any {
	var out []any
	for _, kv := range [][2]string{{"request_id", m.RequestID}, {"traceparent", m.Traceparent},
		{"trace_id", m.TraceID}, {"correlation_id", m.CorrelationID}, {"tenant_id", m.TenantID}} {
		if kv[1] != "" {
			out = append(out, slog.String(kv[0], kv[1]))
		}
	}
	return out
}

// mergeInto adds m's fields to a metadata object, keeping the keys the
// caller set.
func (m Meta) mergeInto(metadata []byte) ([]byte, error) {
	obj := map[string]any{}
	if len(metadata) > 0 {
		if err := json.Unmarshal(metadata, &obj); err != nil {
			return nil, err
		}
	}
	mine, _ := json.Marshal(m.normalized())
	var fields map[string]any
	_ = json.Unmarshal(mine, &fields)
	for k, v := range fields {
		if _, ok := obj[k]; !ok {
			obj[k] = v
		}
	}
	return json.Marshal(obj)
}
