package outbox

import (
	"bytes"
	"cmp"
	"context"
	"flag"
	"fmt"
	"io"
	"net/http"
	"net/http/httptest"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"text/tabwriter"
	"time"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/protobuf/proto"

	"github.com/worker-dev/worker/internal/outbox/outboxconfig"
	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// Benchmarks of the relay, measured on the real worker binary. Run them
// with
//
//	go test -run '^$' -bench RelayScale -timeout 60m ./internal/outbox
//	go test -run '^$' -bench RelayLatency ./internal/outbox
//	go test -run '^$' -bench RelayHungWebhook ./internal/outbox
//	go test -run '^$' -bench RelayScale ./internal/outbox -args -phases r1,r1otel,wh0,wh0otel
//
// Flags after the package: -rounds N (default 3), -phases a,b (a subset
// of the scale phases), -latency-rate and -latency-for. The broker phases
// need RabbitMQ (WORKER_TEST_RABBITMQ_URL, by default the local one with
// guest/guest); NATS and Kafka run in the benchmark process. Benchmarks
// are not tests: nothing fails on a figure.

var (
	benchPhases  = flag.String("phases", "", "relay scale benchmark: comma-separated phase keys (default: all but the extra wh0r4 and wh20r4)")
	latencyRate  = flag.Int("latency-rate", 500, "relay latency benchmark: producer commits per second")
	latencyTotal = flag.Duration("latency-for", 30*time.Second, "relay latency benchmark: how long producers run")
)

const (
	benchBacklog     = 200_000 // the drain backlog: events over benchAggregates
	benchAggregates  = 1_000
	slowBacklog      = 2_000 // the slow-webhook backlog: events over slowAggregates
	slowAggregates   = 200
	brokerBacklog    = 100_000 // the broker comparison's backlog: events over brokerAggregates
	brokerAggregates = 1_000
)

// scalePhase is one configuration of the worker binary draining a backlog.
type scalePhase struct {
	key     string
	name    string
	procs   int      // worker processes
	env     []string // each process's APP_OUTBOX_* settings
	webhook bool     // webhook sink to a local receiver instead of the log sink to /dev/null
	broker  string   // a broker sink (outboxconfig.SinkNATS, ...) to a broker of the phase's own
	delay   time.Duration
	backlog string // the saved backlog it drains: benchTable (default), slowTable or brokerTable
	extra   bool   // run only when -phases names it
	traced  bool   // tracing on: every span sampled unless env names a sampler, exported over OTLP/HTTP to a local receiver
}

// The saved backlogs.
const (
	benchTable  = "bench_backlog"
	slowTable   = "bench_slow"
	brokerTable = "bench_broker"
)

var batch500 = []string{"APP_OUTBOX_BATCH_SIZE=500"}

// goDefaultGC runs the worker at Go's default collector target instead of
// its own (defaultGCPercent in internal/startup).
const goDefaultGC = "GOGC=100"

func relays(n int, rest ...string) []string {
	return append([]string{fmt.Sprintf("APP_OUTBOX_RELAYS=%d", n)}, rest...)
}

var scalePhases = []scalePhase{
	{key: "r1", name: "1 relay, batch 500", procs: 1, env: relays(1, batch500...)},
	{key: "r2", name: "2 relays, batch 500", procs: 1, env: relays(2, batch500...)},
	{key: "r4", name: "4 relays, batch 500", procs: 1, env: relays(4, batch500...)},
	{key: "p2r2", name: "2 processes x 2 relays, batch 500", procs: 2, env: relays(2, batch500...)},
	{key: "default", name: "default configuration", procs: 1},
	{key: "wh0", name: "webhook 0 ms, 1 relay, batch 500", procs: 1, env: relays(1, batch500...), webhook: true},
	{key: "wh20", name: "webhook 20 ms, default configuration, 2,000 events / 200 aggregates", procs: 1, webhook: true, delay: 20 * time.Millisecond, backlog: slowTable},
	{key: "log100k", name: "log sink, 1 relay, batch 500, 100,000 events", procs: 1, env: relays(1, batch500...), backlog: brokerTable},
	{key: "nats", name: "NATS, 1 relay, batch 500, 100,000 events", procs: 1, env: relays(1, batch500...), broker: outboxconfig.SinkNATS, backlog: brokerTable},
	{key: "rabbitmq", name: "RabbitMQ, 1 relay, batch 500, 100,000 events", procs: 1, env: relays(1, batch500...), broker: outboxconfig.SinkRabbitMQ, backlog: brokerTable},
	{key: "kafka", name: "Kafka (kfake), 1 relay, batch 500, 100,000 events", procs: 1, env: relays(1, batch500...), broker: outboxconfig.SinkKafka, backlog: brokerTable},
	{key: "r1otel", name: "1 relay, batch 500, tracing on", procs: 1, env: relays(1, batch500...), traced: true, extra: true},
	// The floor of tracing on: each event's span is started, not sampled,
	// and its context still written into the message.
	{key: "r1otel0", name: "1 relay, batch 500, tracing on, nothing sampled", procs: 1, traced: true, extra: true,
		env: relays(1, append([]string{"OTEL_TRACES_SAMPLER=always_off"}, batch500...)...)},
	{key: "wh0otel", name: "webhook 0 ms, 1 relay, batch 500, tracing on", procs: 1, env: relays(1, batch500...), webhook: true, traced: true, extra: true},
	{key: "natsotel", name: "NATS, 1 relay, batch 500, 100,000 events, tracing on", procs: 1, env: relays(1, batch500...), broker: outboxconfig.SinkNATS, backlog: brokerTable, traced: true, extra: true},
	{key: "kafkaotel", name: "Kafka (kfake), 1 relay, batch 500, 100,000 events, tracing on", procs: 1, env: relays(1, batch500...), broker: outboxconfig.SinkKafka, backlog: brokerTable, traced: true, extra: true},
	{key: "r1gc100", name: "1 relay, batch 500, GOGC=100", procs: 1, env: relays(1, batch500[0], goDefaultGC), extra: true},
	{key: "wh0gc100", name: "webhook 0 ms, 1 relay, batch 500, GOGC=100", procs: 1, env: relays(1, batch500[0], goDefaultGC), webhook: true, extra: true},
	{key: "wh0r4", name: "webhook 0 ms, 4 relays, batch 500", procs: 1, env: relays(4, batch500...), webhook: true, extra: true},
	{key: "wh20r4", name: "webhook 20 ms, 4 relays, 2,000 events / 200 aggregates", procs: 1, env: relays(4), webhook: true, delay: 20 * time.Millisecond, backlog: slowTable, extra: true},
}

// otlpSink is the local OTLP/HTTP receiver of the traced phases: it keeps
// every export's body and answers success (an empty
// ExportTraceServiceResponse), so the worker pays for building, batching
// and sending its spans, and the receiver for little else. The bodies are
// decoded after the phase, to count the spans that arrived: the SDK drops
// a span that finds its queue full rather than wait.
type otlpSink struct {
	*httptest.Server
	mu     sync.Mutex
	bodies [][]byte
}

func newOTLPSink() *otlpSink {
	o := &otlpSink{}
	o.Server = httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		body, _ := io.ReadAll(r.Body)
		o.mu.Lock()
		o.bodies = append(o.bodies, body)
		o.mu.Unlock()
		w.Header().Set("Content-Type", "application/x-protobuf")
	}))
	return o
}

// spans counts the publish spans received.
func (o *otlpSink) spans(tb testing.TB) int {
	o.mu.Lock()
	defer o.mu.Unlock()
	n := 0
	for _, body := range o.bodies {
		var msg coltracepb.ExportTraceServiceRequest
		if err := proto.Unmarshal(body, &msg); err != nil {
			tb.Fatalf("OTLP export: %v", err)
		}
		for _, rs := range msg.ResourceSpans {
			for _, ss := range rs.ScopeSpans {
				for _, sp := range ss.Spans {
					if sp.Kind == tracepb.Span_SPAN_KIND_PRODUCER {
						n++
					}
				}
			}
		}
	}
	return n
}

// phaseRun is one phase in one round, with the ceiling run next to it.
type phaseRun struct {
	phase, ceiling drainResult
	disorder       int           // events the receiver saw out of their aggregate's order
	brokerCPU      time.Duration // an in-process broker's or the receiver's CPU during the phase
	workerRSS      int64         // the largest peak resident memory of the phase's workers, bytes
	spans          int           // spans the OTLP receiver got, in a traced phase
}

// BenchmarkRelayScale drains the same 200,000-event backlog (1,000
// aggregates) with the worker binary in each configuration of
// scalePhases, and right before each phase the plain-SQL ceiling on the
// same rows, for -rounds rounds with the phase order rotated. The broker
// sinks drain a 100,000-event backlog (1,000 aggregates), as does a log
// sink phase to compare them with in the same round. It prints
// min / median / max events/s, the median ratio to the ceiling of the same
// round, and CPU per event (database server processes plus the worker
// process, or this process for the ceiling; and the receiver's or a
// measurable broker's).
func BenchmarkRelayScale(b *testing.B) {
	phases := selectedPhases(b)
	db := pgtest.New(b)
	loadBacklog(b, db.Pool, slowBacklog, slowAggregates)
	saveBacklog(b, db.Pool, slowTable)
	loadBacklog(b, db.Pool, brokerBacklog, brokerAggregates)
	saveBacklog(b, db.Pool, brokerTable)
	loadBacklog(b, db.Pool, benchBacklog, benchAggregates)
	saveBacklog(b, db.Pool, benchTable)
	idle := idleWorkerCPU(b, db)
	before := machineConditions(b, db.Pool)
	for range b.N {
		runs := make([][]phaseRun, len(phases))
		for round := range *benchRounds {
			for k := range phases {
				i := (k + round) % len(phases) // rotate the order between rounds
				ceiling := drainCeiling(b, db, benchTable)
				run := runScalePhase(b, db, phases[i], idle)
				run.ceiling = ceiling
				runs[i] = append(runs[i], run)
				fmt.Printf("round %d, %s: %.0f events/s, ceiling %.0f, ratio %.2f\n",
					round+1, phases[i].name, run.phase.rate, ceiling.rate, run.phase.rate/ceiling.rate)
			}
		}
		printScale(os.Stdout, phases, runs, idle, before, machineConditions(b, db.Pool))
		for i, ph := range phases {
			b.ReportMetric(spreadOf(rates(runs[i])).med, ph.key+"_events/s")
			b.ReportMetric(spreadOf(ratios(runs[i])).med, ph.key+"_ratio")
		}
	}
}

func selectedPhases(tb testing.TB) []scalePhase {
	if *benchPhases == "" {
		return slices.DeleteFunc(slices.Clone(scalePhases), func(p scalePhase) bool { return p.extra })
	}
	var out []scalePhase
	for key := range strings.SplitSeq(*benchPhases, ",") {
		i := slices.IndexFunc(scalePhases, func(p scalePhase) bool { return p.key == key })
		if i < 0 {
			tb.Fatalf("-phases: unknown phase %q", key)
		}
		out = append(out, scalePhases[i])
	}
	return out
}

// runScalePhase restores the phase's backlog, starts its worker processes
// and measures the drain.
func runScalePhase(tb testing.TB, db *pgtest.DB, ph scalePhase, idle time.Duration) phaseRun {
	tb.Helper()
	restoreBacklog(tb, db.Pool, cmp.Or(ph.backlog, benchTable))
	env := ph.env
	var rcv *receiver
	if ph.webhook {
		rcv = newReceiver(ph.delay, "", nil)
		defer rcv.close()
		env = append(slices.Clone(env), "APP_OUTBOX_SINK=webhook", "APP_OUTBOX_WEBHOOK_URL="+rcv.url)
	}
	var otlp *otlpSink
	if ph.traced {
		otlp = newOTLPSink()
		defer otlp.Close()
		// Every span sampled, unless the phase names its own sampler: a
		// later value of a variable wins.
		env = append([]string{"OTEL_EXPORTER_OTLP_ENDPOINT=" + otlp.URL, "OTEL_TRACES_SAMPLER=always_on"}, env...)
	}
	var broker *benchBroker
	if ph.broker != "" {
		broker = startBroker(tb, ph.broker)
		defer broker.close()
		env = append(slices.Clone(env), broker.env...)
	}
	instance := "bench-" + ph.key + "-"
	cpu0 := testkit.SelfCPU(tb)
	var procs []*workerProc
	for i := range ph.procs {
		procs = append(procs, startWorkerProc(tb, db, fmt.Sprintf("%s%d", instance, i), nil, env...))
	}
	waitDrained(tb, db.Pool, 10*time.Minute)
	var run phaseRun
	if rcv != nil {
		run.brokerCPU = testkit.SelfCPU(tb) - cpu0 // the receiver, in this process
	} else {
		run.brokerCPU = brokerCPU(tb, broker, cpu0)
	}
	run.phase.dbCPU = serverCPU(tb, db, "worker "+instance)
	for _, p := range procs {
		run.workerRSS = max(run.workerRSS, p.peakRSS(tb))
		run.phase.clientCPU += max(p.stop(tb)-idle, 0)
	}
	run.phase.events, run.phase.rate = publishedSpan(tb, db.Pool)
	if rcv != nil {
		run.disorder, _ = rcv.stats()
	}
	if otlp != nil {
		run.spans = otlp.spans(tb) // the workers flushed their spans as they stopped
	}
	return run
}

func rates(runs []phaseRun) []float64 {
	var out []float64
	for _, r := range runs {
		out = append(out, r.phase.rate)
	}
	return out
}

func ratios(runs []phaseRun) []float64 {
	var out []float64
	for _, r := range runs {
		out = append(out, r.phase.rate/r.ceiling.rate)
	}
	return out
}

// printScale prints the table of BenchmarkRelayScale.
func printScale(w io.Writer, phases []scalePhase, runs [][]phaseRun, idle time.Duration, before, after string) {
	fmt.Fprintf(w, "\nrelay scale: %d rounds; machine before: %s; after: %s; idle worker start+stop CPU %s (subtracted)\n",
		len(runs[0]), before, after, idle.Round(time.Millisecond))
	if slices.ContainsFunc(phases, func(p scalePhase) bool { return p.broker != "" }) {
		fmt.Fprintf(w, "brokers: %s\n", brokerSetup())
	}
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight|tabwriter.Debug)
	fmt.Fprintln(tw, "phase\tevents/s min / median / max\tceiling events/s, median\tratio median (min-max)\tCPU µs/event db+worker\tbroker or receiver CPU µs/event\tceiling CPU µs/event db+client\tworker peak RSS MB\torder violations\t")
	for i, ph := range phases {
		r := spreadOf(rates(runs[i]))
		q := spreadOf(ratios(runs[i]))
		var ceil, db, client, broker, cdb, cclient, rss []float64
		violations := 0
		for _, run := range runs[i] {
			ceil = append(ceil, run.ceiling.rate)
			n := float64(max(run.phase.events, 1))
			db = append(db, float64(run.phase.dbCPU.Microseconds())/n)
			client = append(client, float64(run.phase.clientCPU.Microseconds())/n)
			broker = append(broker, float64(run.brokerCPU.Microseconds())/n)
			cn := float64(max(run.ceiling.events, 1))
			cdb = append(cdb, float64(run.ceiling.dbCPU.Microseconds())/cn)
			cclient = append(cclient, float64(run.ceiling.clientCPU.Microseconds())/cn)
			rss = append(rss, float64(run.workerRSS)/(1<<20))
			violations += run.disorder
		}
		brokerCol := "" // known for the receiver and a broker this process can measure
		if m := spreadOf(broker).med; m > 0 {
			brokerCol = fmt.Sprintf("%.1f", m)
		}
		fmt.Fprintf(tw, "%s\t%.0f / %.0f / %.0f\t%.0f\t%.2f (%.2f-%.2f)\t%.1f+%.1f\t%s\t%.1f+%.1f\t%.0f\t%d\t\n",
			ph.name, r.min, r.med, r.max, spreadOf(ceil).med, q.med, q.min, q.max,
			spreadOf(db).med, spreadOf(client).med, brokerCol, spreadOf(cdb).med, spreadOf(cclient).med, spreadOf(rss).med, violations)
	}
	tw.Flush()
	// The goals compare phases within a round.
	rate := func(r drainResult) float64 { return r.rate }
	dbPerEvent := func(r drainResult) float64 { return r.dbCPU.Seconds() / float64(max(r.events, 1)) }
	for _, c := range []struct {
		name, num, den string
		of             func(drainResult) float64
	}{
		{"4 relays ÷ 2 relays", "r4", "r2", rate},
		{"2 processes x 2 relays ÷ 2 relays", "p2r2", "r2", rate},
		{"webhook 0 ms ÷ log sink (1 relay, batch 500)", "wh0", "r1", rate},
		{"webhook 0 ms ÷ log sink, both at GOGC=100", "wh0gc100", "r1gc100", rate},
		{"NATS ÷ log sink (100,000 events)", "nats", "log100k", rate},
		{"RabbitMQ ÷ log sink (100,000 events)", "rabbitmq", "log100k", rate},
		{"Kafka (kfake) ÷ log sink (100,000 events)", "kafka", "log100k", rate},
		{"database CPU per event, 4 relays ÷ 1 relay", "r4", "r1", dbPerEvent},
		{"tracing on ÷ off, log sink", "r1otel", "r1", rate},
		{"tracing on, nothing sampled ÷ off, log sink", "r1otel0", "r1", rate},
		{"tracing on ÷ off, webhook 0 ms", "wh0otel", "wh0", rate},
		{"tracing on ÷ off, NATS", "natsotel", "nats", rate},
		{"tracing on ÷ off, Kafka (kfake)", "kafkaotel", "kafka", rate},
	} {
		i := slices.IndexFunc(phases, func(p scalePhase) bool { return p.key == c.num })
		j := slices.IndexFunc(phases, func(p scalePhase) bool { return p.key == c.den })
		if i < 0 || j < 0 {
			continue
		}
		var xs []float64
		for round := range runs[i] {
			xs = append(xs, c.of(runs[i][round].phase)/c.of(runs[j][round].phase))
		}
		s := spreadOf(xs)
		fmt.Fprintf(w, "%s, same round: median %.2f (%.2f-%.2f)\n", c.name, s.med, s.min, s.max)
	}
	for i, ph := range phases {
		if !ph.traced {
			continue
		}
		var xs []float64
		for _, run := range runs[i] {
			xs = append(xs, float64(run.spans)/float64(max(run.phase.events, 1)))
		}
		s := spreadOf(xs)
		fmt.Fprintf(w, "%s: publish spans received ÷ events published: median %.3f (%.3f-%.3f)\n", ph.name, s.med, s.min, s.max)
	}
}

// BenchmarkRelayLatency is the black-box latency measurement: producers
// commit one event per transaction at -latency-rate for -latency-for while
// a worker with the default configuration publishes, once through the log
// sink (arrival = the line on the worker's stdout) and once through the
// webhook sink (arrival = the request at a local receiver answering at
// once), for -rounds rounds. It prints commit-to-arrival p50 / p99 / max,
// min / median / max over rounds.
func BenchmarkRelayLatency(b *testing.B) {
	db := pgtest.New(b)
	sinks := []string{"log", "webhook"}
	before := machineConditions(b, db.Pool)
	for range b.N {
		res := map[string][][3]float64{}
		for round := range *benchRounds {
			for k := range sinks {
				sink := sinks[(k+round)%len(sinks)]
				p50, p99, worst := latencyRun(b, db, sink)
				res[sink] = append(res[sink], [3]float64{ms(p50), ms(p99), ms(worst)})
			}
		}
		fmt.Printf("\nrelay latency: %d commits/s for %s, default configuration, %d rounds; machine before: %s; after: %s\n",
			*latencyRate, *latencyTotal, *benchRounds, before, machineConditions(b, db.Pool))
		for _, sink := range sinks {
			line := sink + " sink, commit to arrival, ms (min / median / max over rounds):"
			for i, name := range []string{"p50", "p99", "max"} {
				var xs []float64
				for _, r := range res[sink] {
					xs = append(xs, r[i])
				}
				s := spreadOf(xs)
				line += fmt.Sprintf(" %s %.1f / %.1f / %.1f;", name, s.min, s.med, s.max)
				b.ReportMetric(s.med, sink+"_"+name+"_ms")
			}
			fmt.Println(line)
		}
	}
}

// latencyRun runs one latency measurement through sink and returns the
// commit-to-arrival p50, p99 and maximum.
func latencyRun(tb testing.TB, db *pgtest.DB, sink string) (p50, p99, worst time.Duration) {
	tb.Helper()
	exec(tb, db.Pool, "TRUNCATE outbox_event, outbox_delivery")
	arrivals := newArrivals()
	var stdout io.Writer = arrivals
	var env []string
	if sink == "webhook" {
		rcv := newReceiver(0, "", arrivals.arrive)
		defer rcv.close()
		stdout = nil
		env = []string{"APP_OUTBOX_SINK=webhook", "APP_OUTBOX_WEBHOOK_URL=" + rcv.url}
	}
	w := startWorkerProc(tb, db, "bench-latency", stdout, env...)
	w.waitReady(tb)
	defer w.stop(tb)

	commits := produce(tb, db, *latencyRate, *latencyTotal)
	testkit.Eventually(tb, time.Minute, "every event to arrive", func() bool { return arrivals.count() >= len(commits) })
	lat := arrivals.latencies(commits)
	return percentile(lat, 0.50), percentile(lat, 0.99), percentile(lat, 1)
}

// BenchmarkRelayHungWebhook is goal 4, black-box: the webhook never answers
// for one aggregate, whose 10 events are the oldest, while 1,000 events of
// 100 other aggregates wait behind them. A worker in the default
// configuration starts; it prints, per round, how long after the start the
// last of the 1,000 arrived (the webhook timeout is 10 s), and how many
// requests for the hung aggregate were left unanswered meanwhile.
func BenchmarkRelayHungWebhook(b *testing.B) {
	db := pgtest.New(b)
	workerBinary(b) // built before the clock starts
	for range b.N {
		var secs []float64
		for round := range *benchRounds {
			exec(b, db.Pool, "TRUNCATE outbox_event, outbox_delivery")
			exec(b, db.Pool, `INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
				SELECT 'order', 'hung', 'order.updated', jsonb_build_object('seq', g) FROM generate_series(1, 10) g`)
			loadBacklog(b, db.Pool, 1000, 100)
			arrivals := newArrivals()
			rcv := newReceiver(0, "hung", arrivals.arrive)
			start := time.Now()
			w := startWorkerProc(b, db, "bench-hung", nil, "APP_OUTBOX_SINK=webhook", "APP_OUTBOX_WEBHOOK_URL="+rcv.url)
			testkit.Eventually(b, 2*time.Minute, "the other aggregates' events to arrive", func() bool { return arrivals.count() >= 1000 })
			took := arrivals.last().Sub(start)
			_, hung := rcv.stats()
			rcv.close()
			w.stop(b)
			secs = append(secs, took.Seconds())
			fmt.Printf("round %d: 1,000 events of other aggregates arrived within %.2f s of the worker's start; %d unanswered requests for the hung aggregate\n",
				round+1, took.Seconds(), hung)
		}
		s := spreadOf(secs)
		fmt.Printf("hung webhook for one aggregate: the others arrived within %.2f / %.2f / %.2f s (min / median / max; goal 10 s)\n", s.min, s.med, s.max)
		b.ReportMetric(s.med, "others_arrived_s")
	}
}

// produce commits one event per transaction at rate per second for d, over
// 100 aggregates, and returns when each commit returned, by event_id. Four
// producers each keep their own schedule of rate/4 per second, so a slow
// commit delays only one of them.
func produce(tb testing.TB, db *pgtest.DB, rate int, d time.Duration) map[string]time.Time {
	tb.Helper()
	pool := db.NewPool(tb, 8)
	total := int(int64(rate) * int64(d) / int64(time.Second))
	var mu sync.Mutex
	commits := make(map[string]time.Time, total)
	var wg sync.WaitGroup
	start := time.Now()
	for p := range 4 {
		wg.Go(func() {
			for i := p; i < total; i += 4 {
				time.Sleep(time.Until(start.Add(time.Duration(i) * time.Second / time.Duration(rate)))) // the producer's schedule
				var id string
				err := pool.QueryRow(context.Background(),
					`INSERT INTO outbox_event (aggregate_type, aggregate_id, event_type, payload)
					 VALUES ('order', $1, 'order.updated', $2) RETURNING event_id::text`,
					fmt.Sprintf("order-%d", i%100), fmt.Sprintf(`{"seq": %d, "note": %q}`, i, strings.Repeat("x", 150))).Scan(&id)
				if err != nil {
					tb.Error(err)
					return
				}
				now := time.Now()
				mu.Lock()
				commits[id] = now
				mu.Unlock()
			}
		})
	}
	wg.Wait()
	return commits
}

// arrivals records when each event first reached the consumer: a webhook
// request, or a log sink line on the worker's stdout (as an io.Writer).
type arrivals struct {
	mu      sync.Mutex
	at      map[string]time.Time
	partial []byte // an incomplete last line
}

func newArrivals() *arrivals { return &arrivals{at: map[string]time.Time{}} }

func (a *arrivals) arrive(id string, at time.Time) {
	a.mu.Lock()
	defer a.mu.Unlock()
	if _, dup := a.at[id]; !dup {
		a.at[id] = at
	}
}

// Write takes the worker's stdout: event lines start with their event_id.
func (a *arrivals) Write(p []byte) (int, error) {
	now := time.Now()
	a.mu.Lock()
	defer a.mu.Unlock()
	a.partial = append(a.partial, p...)
	for {
		line, rest, ok := bytes.Cut(a.partial, []byte{'\n'})
		if !ok {
			break
		}
		if id, ok := bytes.CutPrefix(line, []byte(`{"event_id":"`)); ok && len(id) >= 36 {
			if _, dup := a.at[string(id[:36])]; !dup {
				a.at[string(id[:36])] = now
			}
		}
		a.partial = rest
	}
	a.partial = slices.Clone(a.partial) // do not pin the whole buffer
	return len(p), nil
}

// last is when the latest event arrived.
func (a *arrivals) last() time.Time {
	a.mu.Lock()
	defer a.mu.Unlock()
	var t time.Time
	for _, at := range a.at {
		if at.After(t) {
			t = at
		}
	}
	return t
}

func (a *arrivals) count() int {
	a.mu.Lock()
	defer a.mu.Unlock()
	return len(a.at)
}

// latencies is arrival minus commit per event, sorted (0 when the event
// arrived before the producer saw its commit acknowledged).
func (a *arrivals) latencies(commits map[string]time.Time) []time.Duration {
	a.mu.Lock()
	defer a.mu.Unlock()
	out := make([]time.Duration, 0, len(commits))
	for id, c := range commits {
		out = append(out, max(0, a.at[id].Sub(c)))
	}
	slices.Sort(out)
	return out
}

func percentile(sorted []time.Duration, p float64) time.Duration {
	if len(sorted) == 0 {
		return 0
	}
	i := int(p*float64(len(sorted))+0.5) - 1
	return sorted[min(max(i, 0), len(sorted)-1)]
}

func ms(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
