package startup_test

import (
	"bytes"
	"encoding/hex"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/nats-io/nats-server/v2/server"
	"github.com/twmb/franz-go/pkg/kfake"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// One trace from the producer's transaction to the task its event
// causes, through the binary and each broker: a producer writes an event
// whose traceparent names its own span; the worker's relay publishes it
// (a PRODUCER span, the producer's span its parent), its inbox receives
// it back from the broker (a CONSUMER span, the publish span its parent:
// the message carried the publish span's context), the inbox's river
// handler enqueues a task (otelriver's insert span, the consumer span its
// parent) and the task runs (a CONSUMER span under the insert span); the
// producer's tracestate reaches the inbox through each binding. A
// job run's span arrives too. The receiver decodes OTLP itself; the NATS
// run exports over gRPC, the others over HTTP.
func TestTracingThroughEachBroker(t *testing.T) {
	t.Parallel()
	for _, b := range []struct {
		name string
		grpc bool
		// setup starts the broker and returns the relay's settings and
		// the inbox source's kind and section.
		setup func(t *testing.T) (sink []string, source string)
	}{
		{"webhook", false, func(t *testing.T) ([]string, string) {
			addr := freeAddr(t)
			secret := "whsec_c2VjcmV0LXNpZ25pbmcta2V5LW9mLXRoaXJ0eQ=="
			return []string{"APP_OUTBOX_SINK=webhook", "APP_OUTBOX_WEBHOOK_URL=http://" + addr + "/hooks", "APP_OUTBOX_WEBHOOK_SECRET=" + secret},
				fmt.Sprintf("kind: webhook\n      webhook: {addr: %q, path: /hooks, secret: %s}", addr, secret)
		}},
		{"nats", true, func(t *testing.T) ([]string, string) {
			srv := runNATS(t, &server.Options{Port: server.RANDOM_PORT, StoreDir: t.TempDir()})
			return []string{"APP_OUTBOX_SINK=nats", "APP_OUTBOX_NATS_URL=" + srv.ClientURL(), "APP_OUTBOX_NATS_CREATE_STREAM=true"},
				fmt.Sprintf("kind: nats\n      nats: {url: %q, stream: OUTBOX, consumer: shop, create_consumer: true}", srv.ClientURL())
		}},
		{"rabbitmq", false, func(t *testing.T) ([]string, string) {
			url := testkit.RabbitMQURL()
			exchange := declareInboxQueue(t, url)
			return []string{"APP_OUTBOX_SINK=rabbitmq", "APP_OUTBOX_RABBITMQ_URL=" + url, "APP_OUTBOX_RABBITMQ_EXCHANGE=" + exchange},
				fmt.Sprintf("kind: rabbitmq\n      rabbitmq: {url: %q, queue: %s}", url, exchange)
		}},
		{"kafka", false, func(t *testing.T) ([]string, string) {
			cluster, err := kfake.NewCluster(kfake.NumBrokers(1), kfake.SeedTopics(1, "order"))
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(cluster.Close)
			brokers := strings.Join(cluster.ListenAddrs(), ",")
			return []string{"APP_OUTBOX_SINK=kafka", "APP_OUTBOX_KAFKA_BROKERS=" + brokers},
				fmt.Sprintf("kind: kafka\n      kafka: {brokers: %q, topics: order, group: shop}", brokers)
		}},
	} {
		t.Run(b.name, func(t *testing.T) {
			t.Parallel()
			sink, source := b.setup(t)
			rcv := startOTLPReceiver(t)
			endpoint, protocol := rcv.httpURL, "http/protobuf"
			if b.grpc {
				endpoint, protocol = rcv.grpcURL, "grpc"
			}
			pgtest.Need(t, 6+pgtest.PoolConns)
			db := pgtest.New(t)
			cfg := writeConfig(t, `inbox:
  sources:
    - name: shop
      `+source+`
      handler: {kind: river, task_kind: ship}
tasks:
  kinds:
    - {name: ship, type: sql, sql: SELECT 1}
jobs:
  - {name: tick, kind: sql, delay: 200ms, sql: SELECT 1}
`)
			p := startWorker(t, append([]string{"APP_DATABASE_URL=" + db.URL, cfg, "APP_DATABASE_MAX_CONNS=6",
				"OTEL_EXPORTER_OTLP_ENDPOINT=" + endpoint, "OTEL_EXPORTER_OTLP_PROTOCOL=" + protocol,
				"OTEL_TRACES_SAMPLER=parentbased_always_on", "OTEL_BSP_SCHEDULE_DELAY=100",
				"OTEL_SERVICE_NAME=shop-worker", "APP_DATABASE_TRACE=true"}, sink...))
			p.waitReady(t, 30*time.Second)

			// The producer's transaction, inside its own span.
			traceID, producerSpan := "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
			if _, err := db.Pool.Exec(t.Context(), `INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload, headers)
				VALUES ('order', '42', 'order.paid', '{"amount": 7}', jsonb_build_object('traceparent', $1::text, 'tracestate', 'shop=t61rcWkgMzE'))`,
				"00-"+traceID+"-"+producerSpan+"-01"); err != nil {
				t.Fatal(err)
			}
			inTrace := func(kind tracepb.Span_SpanKind, prefix string, parent []byte) func(*tracepb.Span) bool {
				return func(s *tracepb.Span) bool {
					return hex.EncodeToString(s.GetTraceId()) == traceID && s.GetKind() == kind &&
						strings.HasPrefix(s.GetName(), prefix) && bytes.Equal(s.GetParentSpanId(), parent)
				}
			}
			wantParent, _ := hex.DecodeString(producerSpan)
			publish := rcv.waitSpan(t, "relay publish, child of the producer's span", 30*time.Second,
				inTrace(tracepb.Span_SPAN_KIND_PRODUCER, "publish order.paid", wantParent))
			process := rcv.waitSpan(t, "inbox process, child of the publish span", 30*time.Second,
				inTrace(tracepb.Span_SPAN_KIND_CONSUMER, "process shop", publish.GetSpanId()))
			insert := rcv.waitSpan(t, "task insert, child of the inbox span", 30*time.Second,
				inTrace(tracepb.Span_SPAN_KIND_PRODUCER, "river.insert_many", process.GetSpanId()))
			rcv.waitSpan(t, "task run, child of the insert span", 30*time.Second,
				inTrace(tracepb.Span_SPAN_KIND_CONSUMER, "process ship", insert.GetSpanId()))
			if b.name == "webhook" {
				writeTracePicture(t, rcv, traceID)
			}
			run := rcv.waitSpan(t, "job run", 30*time.Second, func(s *tracepb.Span) bool {
				return s.GetName() == "job tick" && len(s.GetParentSpanId()) == 0 && hasAttr(s, "worker.job.outcome", "success") &&
					hasAttr(s, "worker.job.name", "tick")
			})
			// database.trace: the run's statement is a span under it.
			rcv.waitSpan(t, "job statement (SELECT 1, child of its run)", 30*time.Second, func(s *tracepb.Span) bool {
				return s.GetKind() == tracepb.Span_SPAN_KIND_CLIENT && bytes.Equal(s.GetParentSpanId(), run.GetSpanId()) &&
					s.GetName() == "SELECT" && hasAttr(s, "db.system.name", "postgresql") && hasAttr(s, "db.query.text", "SELECT 1")
			})
			// The job duration histogram links to the run's trace.
			req, err := http.NewRequestWithContext(t.Context(), http.MethodGet, "http://"+p.addr+"/metrics", nil)
			if err != nil {
				t.Fatal(err)
			}
			req.Header.Set("Accept", "application/openmetrics-text; version=1.0.0")
			resp, err := http.DefaultClient.Do(req)
			if err != nil {
				t.Fatal(err)
			}
			metrics, _ := io.ReadAll(resp.Body)
			resp.Body.Close()
			if !regexp.MustCompile(`job_duration_seconds_bucket\{job_name="tick",le="[^"]+"\} \d+ # \{trace_id="[0-9a-f]{32}"\}`).Match(metrics) {
				t.Errorf("no job_duration_seconds exemplar with a trace_id in the OpenMetrics exposition")
			}
			// tracestate travels too: the publish span inherits the
			// producer's, and the consumer reads it from the message.
			if got := process.GetTraceState(); got != "shop=t61rcWkgMzE" {
				t.Errorf("the inbox span's tracestate is %q, want the producer's shop=t61rcWkgMzE", got)
			}
			if !hasAttr(process, "messaging.system", b.name) || !hasAttr(publish, "messaging.system", b.name) {
				t.Errorf("messaging.system: publish %v, process %v; want %s", publish.GetAttributes(), process.GetAttributes(), b.name)
			}
			rcv.mu.Lock()
			named := rcv.services["shop-worker"]
			for _, s := range rcv.spans {
				// The relay's claims, the sweeps and River's polling run
				// outside any span: no statement span of theirs.
				if hasAttr(s, "db.system.name", "postgresql") && len(s.GetParentSpanId()) == 0 {
					t.Errorf("a statement span without a parent: %s %v", s.GetName(), s.GetAttributes())
				}
			}
			rcv.mu.Unlock()
			if !named {
				t.Errorf("no span came from service.name shop-worker (OTEL_SERVICE_NAME)")
			}
			// The job's log line carries its span's ids.
			if !strings.Contains(p.out.String(), `"trace_id"`) {
				t.Errorf("no log line carries trace_id:\n%s", p.out.String())
			}
			if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
				t.Fatal(err)
			}
			if code := p.exitCode(t, 20*time.Second); code != 0 {
				t.Fatalf("exit %d\n%s", code, p.out.String())
			}
		})
	}
}

// Tracing off, as by default or with OTEL_SDK_DISABLED=true or
// OTEL_TRACES_EXPORTER=none even beside an endpoint: the worker relays,
// receives and runs jobs, and no exporter ever connects to the endpoint.
func TestTracingOffConnectsNowhere(t *testing.T) {
	t.Parallel()
	for name, env := range map[string][]string{
		"sdk disabled":  {"OTEL_SDK_DISABLED=true"},
		"exporter none": {"OTEL_TRACES_EXPORTER=none"},
	} {
		t.Run(name, func(t *testing.T) {
			t.Parallel()
			rcv := startOTLPReceiver(t)
			db := pgtest.New(t)
			addr := freeAddr(t)
			secret := "whsec_c2VjcmV0LXNpZ25pbmcta2V5LW9mLXRoaXJ0eQ=="
			cfg := writeConfig(t, fmt.Sprintf(`inbox:
  sources:
    - name: shop
      kind: webhook
      webhook: {addr: %q, path: /hooks, secret: %s}
      handler: {kind: sql, sql: "SELECT 1"}
jobs:
  - {name: tick, kind: sql, delay: 100ms, sql: SELECT 1}
`, addr, secret))
			p := startWorker(t, append([]string{"APP_DATABASE_URL=" + db.URL, cfg, "APP_TASKS_ENABLED=false",
				"APP_OUTBOX_SINK=webhook", "APP_OUTBOX_WEBHOOK_URL=http://" + addr + "/hooks", "APP_OUTBOX_WEBHOOK_SECRET=" + secret,
				"OTEL_EXPORTER_OTLP_ENDPOINT=" + rcv.httpURL, "OTEL_BSP_SCHEDULE_DELAY=50"}, env...))
			p.waitReady(t, 30*time.Second)
			if _, err := db.Pool.Exec(t.Context(), `INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload, headers)
				VALUES ('order', '42', 'order.paid', '{}', '{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}')`); err != nil {
				t.Fatal(err)
			}
			deadline := time.Now().Add(30 * time.Second)
			for {
				var processed bool
				if err := db.Pool.QueryRow(t.Context(), `SELECT EXISTS (SELECT FROM inbox_message WHERE state = 'PROCESSED')`).Scan(&processed); err != nil {
					t.Fatal(err)
				}
				if processed {
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("the event was not received back\n%s", p.out.String())
				}
				time.Sleep(50 * time.Millisecond)
			}
			if err := p.cmd.Process.Signal(syscall.SIGTERM); err != nil {
				t.Fatal(err)
			}
			if code := p.exitCode(t, 20*time.Second); code != 0 {
				t.Fatalf("exit %d\n%s", code, p.out.String())
			}
			// Exited: whatever an exporter would have flushed is sent.
			if n := rcv.conns.Load(); n != 0 {
				t.Errorf("%d connection(s) to the OTLP endpoint with tracing off", n)
			}
			if strings.Contains(p.out.String(), `"trace_id"`) {
				t.Errorf("a log line carries trace_id with tracing off")
			}
		})
	}
}

func hasAttr(s *tracepb.Span, key, value string) bool {
	for _, a := range s.GetAttributes() {
		if a.GetKey() == key && a.GetValue().GetStringValue() == value {
			return true
		}
	}
	return false
}

// The river sink: the task the relay writes for an event runs in a span
// under the event's publish span, itself under the producer's span.
func TestTracingThroughTheRiverSink(t *testing.T) {
	t.Parallel()
	rcv := startOTLPReceiver(t)
	db := pgtest.New(t)
	cfg := writeConfig(t, `outbox:
  sink: river
  river:
    routes: {"*": ship}
tasks:
  kinds:
    - {name: ship, type: sql, sql: SELECT 1}
`)
	p := startWorker(t, []string{"APP_DATABASE_URL=" + db.URL, cfg,
		"OTEL_EXPORTER_OTLP_ENDPOINT=" + rcv.httpURL, "OTEL_BSP_SCHEDULE_DELAY=100"})
	p.waitReady(t, 30*time.Second)
	traceID, producerSpan := "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
	if _, err := db.Pool.Exec(t.Context(), `INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload, headers)
		VALUES ('order', '42', 'order.paid', '{}', jsonb_build_object('traceparent', $1::text))`, "00-"+traceID+"-"+producerSpan+"-01"); err != nil {
		t.Fatal(err)
	}
	parent, _ := hex.DecodeString(producerSpan)
	publish := rcv.waitSpan(t, "relay publish, child of the producer's span", 30*time.Second, func(s *tracepb.Span) bool {
		return s.GetKind() == tracepb.Span_SPAN_KIND_PRODUCER && bytes.Equal(s.GetParentSpanId(), parent) && hasAttr(s, "messaging.system", "river")
	})
	rcv.waitSpan(t, "task run, child of the publish span", 30*time.Second, func(s *tracepb.Span) bool {
		return s.GetName() == "process ship" && hex.EncodeToString(s.GetTraceId()) == traceID && bytes.Equal(s.GetParentSpanId(), publish.GetSpanId())
	})
}

// config print ends with the tracing the OTEL_* variables put in force,
// and a value the worker does not know stops it with exit 78, naming the
// variable.
func TestTracingConfigPrint(t *testing.T) {
	t.Parallel()
	for _, c := range []struct {
		name string
		env  []string
		code int
		want string
	}{
		{"default", nil, 0, "# tracing (OTEL_* variables): off (no OTEL_TRACES_EXPORTER nor OTLP endpoint set)\n"},
		{"endpoint", []string{"OTEL_EXPORTER_OTLP_ENDPOINT=http://collector:4317", "OTEL_EXPORTER_OTLP_PROTOCOL=grpc"}, 0,
			"# tracing (OTEL_* variables): on: exporter=otlp protocol=grpc endpoint=http://collector:4317 sampler=parentbased_always_on\n"},
		{"disabled", []string{"OTEL_EXPORTER_OTLP_ENDPOINT=http://collector:4318", "OTEL_SDK_DISABLED=true"}, 0,
			"# tracing (OTEL_* variables): off (OTEL_SDK_DISABLED=true)\n"},
		{"unknown exporter", []string{"OTEL_TRACES_EXPORTER=zipkin"}, 78, `OTEL_TRACES_EXPORTER=\"zipkin\": want otlp or none`},
		{"unknown sampler", []string{"OTEL_TRACES_EXPORTER=otlp", "OTEL_TRACES_SAMPLER=sometimes"}, 78, `OTEL_TRACES_SAMPLER=\"sometimes\"`},
		{"unknown protocol", []string{"OTEL_TRACES_EXPORTER=otlp", "OTEL_EXPORTER_OTLP_PROTOCOL=http/json"}, 78, `OTEL_EXPORTER_OTLP_PROTOCOL=\"http/json\"`},
	} {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			code, stdout, stderr := runCLI(t, append([]string{writeConfig(t, "{}\n")}, c.env...), "config", "print")
			if code != c.code {
				t.Fatalf("exit %d, want %d\n%s%s", code, c.code, stdout, stderr)
			}
			if !strings.Contains(stdout+stderr, c.want) {
				t.Errorf("output lacks %q:\n%s%s", c.want, stdout, stderr)
			}
		})
	}
}

// A collector that cannot be reached is one WARN line with
// TRACE_EXPORT_FAILED, however many exports fail, and nothing unstructured
// on stderr. Once it answers, one INFO line ends the outage, counting the
// spans lost, and spans arrive again.
func TestTraceExportOutage(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	collector := freeAddr(t) // nothing listens there yet
	cfg := writeConfig(t, "jobs:\n  - {name: tick, kind: sql, delay: 20ms, sql: SELECT 1}\n")
	p := startWorker(t, []string{"APP_DATABASE_URL=" + db.URL, cfg, "APP_TASKS_ENABLED=false",
		"OTEL_EXPORTER_OTLP_ENDPOINT=http://" + collector, "OTEL_BSP_SCHEDULE_DELAY=20"})
	p.waitReady(t, 30*time.Second)
	const failing = `"error.code":"TRACE_EXPORT_FAILED"`
	testkit.Eventually(t, 30*time.Second, "the outage's WARN line", func() bool { return strings.Contains(p.out.String(), failing) })
	// Each run is a span, exported within 20 ms: 50 more runs are dozens of
	// failed exports.
	runs := func() int { return strings.Count(p.out.String(), `"msg":"job run finished"`) }
	from := runs()
	testkit.Eventually(t, 30*time.Second, "50 more job runs while the collector is down", func() bool { return runs() >= from+50 })

	ln, err := net.Listen("tcp", collector)
	if err != nil {
		t.Fatal(err)
	}
	rcv := &otlpReceiver{services: map[string]bool{}}
	hs := &httptest.Server{Listener: ln, Config: &http.Server{Handler: http.HandlerFunc(rcv.serveHTTP)}}
	hs.Start()
	t.Cleanup(hs.Close)
	rcv.waitSpan(t, "a job run's span once the collector answers", 30*time.Second, func(s *tracepb.Span) bool { return s.GetName() == "job tick" })
	recovered := regexp.MustCompile(`"msg":"trace export works again".*"spans_lost":[1-9]`)
	testkit.Eventually(t, 10*time.Second, "the INFO line ending the outage", func() bool { return recovered.MatchString(p.out.String()) })

	out := p.out.String()
	if n := strings.Count(out, failing); n != 1 {
		t.Errorf("%d lines with %s, want 1 for the outage", n, failing)
	}
	for line := range strings.SplitSeq(out, "\n") {
		if line != "" && !strings.HasPrefix(line, "{") {
			t.Errorf("a line that is not JSON: %s", line)
			break
		}
	}
}
