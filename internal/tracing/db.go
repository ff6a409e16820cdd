package tracing

import (
	"context"
	"errors"
	"strings"
	"unicode"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"go.opentelemetry.io/otel"
	"go.opentelemetry.io/otel/attribute"
	"go.opentelemetry.io/otel/trace"
)

// DatabaseTracer is a pgx tracer (pgx.QueryTracer and pgx.BatchTracer)
// that gives each statement or batch run inside a recording span a CLIENT
// span of its own, after OpenTelemetry's database conventions: a job's
// SQL, an inbox handler's, a task's, each under its operation's span. A
// statement outside any span (the relay's claims, lease renewals, the
// sweeps) gets none, so tracing the database adds no span per claimed
// row or per poll. The statement's text is recorded; its arguments never
// are. database.trace installs it on the worker's pools.
type DatabaseTracer struct{}

var dbTracer = otel.Tracer("github.com/worker-dev/worker/internal/tracing")

// statementSpan is the context key of the span a DatabaseTracer started
// for the statement in flight: pgx hands the start's context to the end.
type statementSpan struct{}

func (DatabaseTracer) TraceQueryStart(ctx context.Context, conn *pgx.Conn, d pgx.TraceQueryStartData) context.Context {
	return startStatement(ctx, conn, operation(d.SQL), attribute.String("db.query.text", d.SQL))
}

func (DatabaseTracer) TraceQueryEnd(ctx context.Context, _ *pgx.Conn, d pgx.TraceQueryEndData) {
	endStatement(ctx, d.Err)
}

func (DatabaseTracer) TraceBatchStart(ctx context.Context, conn *pgx.Conn, d pgx.TraceBatchStartData) context.Context {
	return startStatement(ctx, conn, "BATCH", attribute.Int("db.operation.batch.size", d.Batch.Len()))
}

// TraceBatchQuery adds nothing: a batch is one round trip, one span, and
// its end says whether a statement failed.
func (DatabaseTracer) TraceBatchQuery(context.Context, *pgx.Conn, pgx.TraceBatchQueryData) {}

func (DatabaseTracer) TraceBatchEnd(ctx context.Context, _ *pgx.Conn, d pgx.TraceBatchEndData) {
	endStatement(ctx, d.Err)
}

func startStatement(ctx context.Context, conn *pgx.Conn, op string, attr attribute.KeyValue) context.Context {
	if !trace.SpanFromContext(ctx).IsRecording() {
		return ctx
	}
	cfg := conn.Config()
	ctx, span := dbTracer.Start(ctx, op, trace.WithSpanKind(trace.SpanKindClient), trace.WithAttributes(
		attribute.String("db.system.name", "postgresql"),
		attribute.String("db.namespace", cfg.Database),
		attribute.String("db.operation.name", op),
		attribute.String("server.address", cfg.Host),
		attribute.Int("server.port", int(cfg.Port)),
		attr,
	))
	return context.WithValue(ctx, statementSpan{}, span)
}

func endStatement(ctx context.Context, err error) {
	span, ok := ctx.Value(statementSpan{}).(trace.Span)
	if !ok {
		return
	}
	if pgErr, ok := errors.AsType[*pgconn.PgError](err); ok {
		span.SetAttributes(attribute.String("db.response.status_code", pgErr.Code))
	}
	End(span, err)
}

// operation is a statement's first keyword (SELECT, INSERT, WITH, ...),
// its span's name.
func operation(sql string) string {
	sql = strings.TrimLeftFunc(sql, unicode.IsSpace)
	end := strings.IndexFunc(sql, func(r rune) bool { return !unicode.IsLetter(r) })
	if end < 0 {
		end = len(sql)
	}
	if end == 0 {
		return "postgresql"
	}
	return strings.ToUpper(sql[:end])
}
