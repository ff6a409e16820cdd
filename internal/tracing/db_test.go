package tracing_test

import (
	"context"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/codes"
	sdktrace "go.opentelemetry.io/otel/sdk/trace"
	"go.opentelemetry.io/otel/sdk/trace/tracetest"
	"go.opentelemetry.io/otel/trace"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/tracing"
)

// A statement or batch run inside a span is a CLIENT span under it, with
// the database's attributes and a failure's SQLSTATE; one run outside any
// span (as the relay's claims are) makes none.
func TestDatabaseStatementsInsideASpan(t *testing.T) {
	exp := tracetest.NewInMemoryExporter()
	tp := sdktrace.NewTracerProvider(sdktrace.WithSyncer(exp))
	tracing.Use(tp)
	db := pgtest.New(t)
	pool := db.NewPool(t, 2, func(c *pgxpool.Config) { c.ConnConfig.Tracer = tracing.DatabaseTracer{} })
	ctx := context.Background()

	if _, err := pool.Exec(ctx, "SELECT 1"); err != nil {
		t.Fatal(err)
	}
	if n := len(exp.GetSpans()); n != 0 {
		t.Fatalf("a statement outside any span made %d spans, want none", n)
	}

	ctx, parent := tp.Tracer("test").Start(ctx, "job tick")
	if _, err := pool.Exec(ctx, "  select $1::int", 7); err != nil {
		t.Fatal(err)
	}
	b := &pgx.Batch{}
	b.Queue("SELECT 1")
	b.Queue("SELECT 2")
	if err := pool.SendBatch(ctx, b).Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := pool.Exec(ctx, "INSERT INTO no_such_table VALUES (1)"); err == nil {
		t.Fatal("the insert into a missing table succeeded")
	}
	parent.End()

	spans := exp.GetSpans()
	byName := map[string]tracetest.SpanStub{}
	for _, s := range spans {
		byName[s.Name] = s
	}
	for _, name := range []string{"SELECT", "BATCH", "INSERT"} {
		s, ok := byName[name]
		if !ok {
			t.Fatalf("no %s span among %d", name, len(spans))
		}
		if s.Parent.SpanID() != parent.SpanContext().SpanID() || s.SpanKind != trace.SpanKindClient {
			t.Errorf("%s: parent %s kind %s; want the job's span %s, CLIENT", name, s.Parent.SpanID(), s.SpanKind, parent.SpanContext().SpanID())
		}
		if !has(s.Attributes, attribute.String("db.system.name", "postgresql")) || !has(s.Attributes, attribute.String("db.namespace", db.Name)) {
			t.Errorf("%s: attributes %v", name, s.Attributes)
		}
	}
	if s := byName["SELECT"]; !has(s.Attributes, attribute.String("db.query.text", "  select $1::int")) {
		t.Errorf("SELECT: attributes %v; want its text, without its argument", s.Attributes)
	}
	if s := byName["BATCH"]; !has(s.Attributes, attribute.Int("db.operation.batch.size", 2)) {
		t.Errorf("BATCH: attributes %v", s.Attributes)
	}
	if s := byName["INSERT"]; s.Status.Code != codes.Error || !has(s.Attributes, attribute.String("db.response.status_code", "42P01")) {
		t.Errorf("the failed INSERT: status %v, attributes %v; want an error with SQLSTATE 42P01", s.Status, s.Attributes)
	}
}

func has(attrs []attribute.KeyValue, want attribute.KeyValue) bool {
	for _, a := range attrs {
		if a == want {
			return true
		}
	}
	return false
}
