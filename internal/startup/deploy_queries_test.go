package startup_test

import (
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/promql/parser"
	"go.yaml.in/yaml/v3"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

const deployDir = "../../deploy"

// targetLabels are set by Prometheus on every scraped series (namespace by
// the Prometheus Operator's ServiceMonitor); queries may use them on any
// metric.
var targetLabels = []string{"job", "instance", "namespace"}

// A query on a metric or label the worker does not export shows an empty
// panel, or an alert that can never fire: both read as "all is well". A
// real worker (multi-instance, postgres leases, a job, the outbox relay, a
// task kind) must serve every metric and label the dashboard and the rules
// name, and before any event: known series start at zero, so nothing is
// missing until something happens.
func TestDeployQueriesNameOnlyExportedMetrics(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	cfgFile := filepath.Join(t.TempDir(), "worker.yaml")
	if err := os.WriteFile(cfgFile, []byte(`jobs:
  - {name: tick, kind: sql, sql: "SELECT 1", delay: 1h, initial_delay: 1h}
tasks:
  kinds:
    - {name: ping, type: sql, sql: "SELECT $1"}
    - {name: hook, type: http, url: "http://127.0.0.1:9/hook"}
`+inboxSourceYAML(t)), 0o600); err != nil {
		t.Fatal(err)
	}
	p := startWorker(t, []string{"APP_DATABASE_URL=" + db.URL, "APP_CONFIG_FILE=" + cfgFile,
		"APP_MULTI_INSTANCE_ENABLED=true", "APP_LOCK_PROVIDER=postgres", "APP_OUTBOX_METRICS_INTERVAL=100ms"})
	p.waitReady(t, 15*time.Second)

	queries := deployQueries(t)
	if len(queries) < 40 {
		t.Fatalf("found %d queries in %s; the dashboard and rules hold more", len(queries), deployDir)
	}
	recorded := recordedLabels(t, queries)
	// The outbox gauges appear with the relay's first refresh.
	var problems []string
	t.Cleanup(func() {
		if t.Failed() && len(problems) > 0 {
			t.Errorf("queries in %s name what the worker does not export:\n%s", deployDir, strings.Join(problems, "\n"))
		}
	})
	testkit.Eventually(t, 10*time.Second, "every query to name exported metrics and labels", func() bool {
		exported, _ := scrape(t, p)
		problems = problems[:0]
		for _, q := range queries {
			problems = append(problems, q.check(exported, recorded)...)
		}
		return len(problems) == 0
	})

	// The worker said in one line what it is and how it runs.
	lines := p.out.Lines(t, "worker starting")
	if len(lines) != 1 {
		t.Fatalf("%d \"worker starting\" lines, want 1", len(lines))
	}
	want := map[string]string{"config_file": cfgFile, "mode": "multi-instance", "lock_provider": "postgres", "sink": "log", "version": "dev"}
	for k, v := range want {
		if lines[0][k] != v {
			t.Errorf("startup line: %s = %v, want %q", k, lines[0][k], v)
		}
	}
	for _, k := range []string{"revision", "goversion"} {
		if s, _ := lines[0][k].(string); s == "" {
			t.Errorf("startup line has no %s: %v", k, lines[0])
		}
	}
}

// query is one PromQL expression found in deploy/, with where it was found.
type query struct {
	where  string
	expr   string
	record string // the recording rule's output name, if it is one
	// labelValues is a Grafana variable's label_values(metric, label).
	labelValues []string
}

var labelValuesQuery = regexp.MustCompile(`^label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*,\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)$`)

// deployQueries reads every expression in the Grafana dashboard and the
// Prometheus rules.
func deployQueries(t *testing.T) []query {
	t.Helper()
	var out []query
	var dash struct {
		Panels     []dashPanel
		Templating struct {
			List []struct {
				Name  string
				Type  string
				Query json.RawMessage
			}
		}
	}
	readJSON(t, filepath.Join(deployDir, "grafana/worker-dashboard.json"), &dash)
	var walk func([]dashPanel)
	walk = func(panels []dashPanel) {
		for _, p := range panels {
			for _, tg := range p.Targets {
				out = append(out, query{where: fmt.Sprintf("dashboard panel %q %s", p.Title, tg.RefID), expr: grafanaToPromQL(tg.Expr)})
			}
			walk(p.Panels)
		}
	}
	walk(dash.Panels)
	for _, v := range dash.Templating.List {
		if v.Type != "query" {
			continue
		}
		var q struct{ Query string }
		if err := json.Unmarshal(v.Query, &q); err != nil {
			t.Fatalf("dashboard variable %s: query: %v", v.Name, err)
		}
		m := labelValuesQuery.FindStringSubmatch(q.Query)
		if m == nil {
			t.Fatalf("dashboard variable %s: %q is not label_values(metric, label)", v.Name, q.Query)
		}
		out = append(out, query{where: "dashboard variable " + v.Name, labelValues: m[1:]})
	}
	for _, file := range []string{"prometheus/recording.yaml", "prometheus/alerts.yaml"} {
		var rules struct {
			Groups []struct {
				Rules []struct{ Record, Alert, Expr string }
			}
		}
		b, err := os.ReadFile(filepath.Join(deployDir, file))
		if err != nil {
			t.Fatal(err)
		}
		if err := yaml.Unmarshal(b, &rules); err != nil {
			t.Fatalf("%s: %v", file, err)
		}
		for _, g := range rules.Groups {
			for _, r := range g.Rules {
				out = append(out, query{where: file + " " + r.Record + r.Alert, expr: r.Expr, record: r.Record})
			}
		}
	}
	return out
}

type dashPanel struct {
	Title   string
	Targets []struct {
		RefID string
		Expr  string
	}
	Panels []dashPanel
}

func readJSON(t *testing.T, path string, v any) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(b, v); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}

var (
	grafanaInterval = regexp.MustCompile(`\$\{?__(rate_interval|interval|range)\}?`)
	grafanaVariable = regexp.MustCompile(`\$\{?[a-zA-Z_][a-zA-Z0-9_]*\}?`)
)

// grafanaToPromQL replaces Grafana's variables with what Grafana would put
// there, so the expression parses.
func grafanaToPromQL(expr string) string {
	return grafanaVariable.ReplaceAllString(grafanaInterval.ReplaceAllString(expr, "5m"), ".*")
}

// exported maps each series name on /metrics (a histogram's _bucket, _sum
// and _count included) to its label names.
type exported map[string][]string

// scrape reads /metrics: its series, and its metric families with their
// label names.
func scrape(t *testing.T, p *proc) (exported, map[string][]string) {
	t.Helper()
	code, body := p.get("/metrics")
	if code != http.StatusOK {
		t.Fatalf("/metrics = %d: %s", code, body)
	}
	return parseMetrics(t, body)
}

// parseMetrics reads a text exposition as scrape does.
func parseMetrics(t *testing.T, body string) (exported, map[string][]string) {
	t.Helper()
	parser := expfmt.NewTextParser(model.UTF8Validation)
	families, err := parser.TextToMetricFamilies(strings.NewReader(body))
	if err != nil {
		t.Fatalf("/metrics does not parse: %v", err)
	}
	out, byFamily := exported{}, map[string][]string{}
	add := func(name string, labels []string) { out[name] = append(out[name], labels...) }
	for name, mf := range families {
		byFamily[name] = []string{}
		for _, m := range mf.GetMetric() {
			var labels []string
			for _, lp := range m.GetLabel() {
				labels = append(labels, lp.GetName())
				if !slices.Contains(byFamily[name], lp.GetName()) {
					byFamily[name] = append(byFamily[name], lp.GetName())
				}
			}
			switch {
			case m.Histogram != nil:
				add(name+"_bucket", append(labels, "le"))
				add(name+"_sum", labels)
				add(name+"_count", labels)
			case m.Summary != nil:
				add(name, append(labels, "quantile"))
				add(name+"_sum", labels)
				add(name+"_count", labels)
			default:
				add(name, labels)
			}
		}
	}
	return out, byFamily
}

// recordedLabels returns each recording rule's output name with the labels
// its expression can carry: those of the selectors it reads.
func recordedLabels(t *testing.T, queries []query) map[string][]string {
	t.Helper()
	out := map[string][]string{}
	for _, q := range queries {
		if q.record == "" {
			continue
		}
		expr, err := parser.NewParser(parser.Options{}).ParseExpr(q.expr)
		if err != nil {
			t.Fatalf("%s: %v", q.where, err)
		}
		parser.Inspect(expr, func(n parser.Node, _ []parser.Node) error {
			if vs, ok := n.(*parser.VectorSelector); ok {
				for _, m := range vs.LabelMatchers {
					out[q.record] = append(out[q.record], m.Name)
				}
			}
			return nil
		})
		out[q.record] = append(out[q.record], targetLabels...)
	}
	return out
}

// check lists what q names that the worker does not export.
func (q query) check(have exported, recorded map[string][]string) []string {
	if q.labelValues != nil {
		metric, label := q.labelValues[0], q.labelValues[1]
		if labels, ok := have[metric]; !ok {
			return []string{fmt.Sprintf("%s: metric %s is not exported", q.where, metric)}
		} else if !slices.Contains(labels, label) && !slices.Contains(targetLabels, label) {
			return []string{fmt.Sprintf("%s: %s has no label %s", q.where, metric, label)}
		}
		return nil
	}
	expr, err := parser.NewParser(parser.Options{}).ParseExpr(q.expr)
	if err != nil {
		return []string{fmt.Sprintf("%s: %v", q.where, err)}
	}
	var problems []string
	// labelsOf returns the labels the selectors under n can carry.
	labelsOf := func(n parser.Node) []string {
		labels := slices.Clone(targetLabels)
		parser.Inspect(n, func(n parser.Node, _ []parser.Node) error {
			if vs, ok := n.(*parser.VectorSelector); ok {
				labels = append(labels, have[vs.Name]...)
				labels = append(labels, recorded[vs.Name]...)
			}
			return nil
		})
		return labels
	}
	parser.Inspect(expr, func(n parser.Node, _ []parser.Node) error {
		switch n := n.(type) {
		case *parser.VectorSelector:
			labels, ok := have[n.Name]
			if r, isRecorded := recorded[n.Name]; isRecorded {
				labels, ok = r, true
			}
			if n.Name == "up" { // Prometheus' own, with target labels only
				ok = true
			}
			if !ok {
				problems = append(problems, fmt.Sprintf("%s: metric %s is not exported", q.where, n.Name))
				return nil
			}
			for _, m := range n.LabelMatchers {
				if m.Name != model.MetricNameLabel && !slices.Contains(labels, m.Name) && !slices.Contains(targetLabels, m.Name) {
					problems = append(problems, fmt.Sprintf("%s: %s has no label %s", q.where, n.Name, m.Name))
				}
			}
		case *parser.AggregateExpr:
			known := labelsOf(n.Expr)
			for _, l := range n.Grouping {
				if !slices.Contains(known, l) {
					problems = append(problems, fmt.Sprintf("%s: grouping by %s, which no metric under it has", q.where, l))
				}
			}
		case *parser.BinaryExpr:
			if n.VectorMatching == nil {
				return nil
			}
			known := append(labelsOf(n.LHS), labelsOf(n.RHS)...)
			for _, l := range append(slices.Clone(n.VectorMatching.MatchingLabels), n.VectorMatching.Include...) {
				if !slices.Contains(known, l) {
					problems = append(problems, fmt.Sprintf("%s: matching on %s, which neither side has", q.where, l))
				}
			}
		}
		return nil
	})
	return problems
}

// The dashboard imports as it is: every panel reads the data source the
// importer picks, the variables the queries use exist, and the rows the
// operators look for are there.
func TestDashboardIsImportable(t *testing.T) {
	t.Parallel()
	var dash struct {
		UID           string
		SchemaVersion int
		Panels        []struct {
			ID         int
			Type       string
			Title      string
			Datasource *struct{ Type, UID string }
			Targets    []struct {
				Datasource struct{ Type, UID string }
				Expr       string
				Exemplar   bool
			}
			FieldConfig struct {
				Defaults struct {
					Links []struct{ Title, URL string }
				}
			}
		}
		Templating struct {
			List []struct {
				Name, Type string
				Query      json.RawMessage // a query variable's is an object
			}
		}
	}
	readJSON(t, filepath.Join(deployDir, "grafana/worker-dashboard.json"), &dash)
	// 39 is Grafana 11's; this file is written for Grafana 12 (41).
	if dash.UID == "" || dash.SchemaVersion < 41 {
		t.Errorf("uid %q, schemaVersion %d; want a fixed uid and a current Grafana's schema (41 or later)", dash.UID, dash.SchemaVersion)
	}
	vars := map[string]string{}
	for _, v := range dash.Templating.List {
		vars[v.Name] = v.Type
		if v.Name == "traces" && string(v.Query) != `"tempo"` {
			t.Errorf("variable traces picks %q data sources, want tempo", v.Query)
		}
	}
	if vars["traces"] != "datasource" {
		t.Errorf("variables %v; want a datasource variable traces for the trace links", vars)
	}
	if vars["datasource"] != "datasource" || vars["instance"] != "query" || vars["job_name"] != "query" {
		t.Errorf("variables %v; want a datasource variable and label_values queries for instance and job_name", vars)
	}
	ids := map[int]bool{}
	var rows, byJobName []string
	for _, p := range dash.Panels {
		if ids[p.ID] {
			t.Errorf("panel id %d is used twice", p.ID)
		}
		ids[p.ID] = true
		if p.Type == "row" {
			rows = append(rows, p.Title)
			continue
		}
		if p.Datasource == nil || p.Datasource.UID != "${datasource}" || len(p.Targets) == 0 {
			t.Errorf("panel %q: datasource %v, %d queries; want ${datasource} and at least one query", p.Title, p.Datasource, len(p.Targets))
		}
		for _, tg := range p.Targets {
			if tg.Datasource.UID != "${datasource}" {
				t.Errorf("panel %q: a query reads data source %q, want ${datasource}", p.Title, tg.Datasource.UID)
			}
			if strings.Contains(tg.Expr, "$") && !strings.Contains(tg.Expr, `instance=~"$instance"`) {
				t.Errorf("panel %q: %s does not filter on the instance variable", p.Title, tg.Expr)
			}
			if strings.Contains(tg.Expr, "$job_name") && !slices.Contains(byJobName, p.Title) {
				byJobName = append(byJobName, p.Title)
			}
		}
		// The duration panels whose histograms carry a trace id as exemplar
		// (obs.ObserveCtx) show them, and link to the traces of the series
		// by the span attribute docs/tracing.md names.
		if traced, ok := map[string]string{"Duration p50 / p99": "span.worker.job.name = \\\"${__field.labels.job_name}\\\"",
			"Task duration p50 / p99": "span.worker.task.kind = \\\"${__field.labels.task_kind}\\\""}[p.Title]; ok {
			for _, tg := range p.Targets {
				if !tg.Exemplar {
					t.Errorf("panel %q: a query does not ask for exemplars", p.Title)
				}
			}
			links := p.FieldConfig.Defaults.Links
			if len(links) != 1 || !strings.Contains(links[0].URL, `"datasource":"${traces}"`) || !strings.Contains(links[0].URL, traced) {
				t.Errorf("panel %q: links %v; want one to the ${traces} data source, querying %s", p.Title, links, traced)
			}
		}
		// A job that never succeeded reports 0; dropping it (`> 0` alone)
		// would hide exactly the job that needs looking at.
		if p.Title == "Time since last success" && !strings.Contains(p.Targets[0].Expr, "== 0") {
			t.Errorf("panel %q: %s drops the jobs that never succeeded (job_last_success_timestamp_seconds == 0)", p.Title, p.Targets[0].Expr)
		}
	}
	// docs/deploy.md says which panels the Job variable narrows, by title.
	page, err := os.ReadFile("../../docs/deploy.md")
	if err != nil {
		t.Fatal(err)
	}
	_, section, _ := strings.Cut(string(page), "\n## Dashboard\n")
	section, _, _ = strings.Cut(section, "\n## ")
	for _, title := range byJobName {
		if !strings.Contains(section, "*"+title+"*") {
			t.Errorf("docs/deploy.md's Dashboard section does not name %q among the panels the Job variable narrows", title)
		}
	}
	if len(byJobName) == 0 || strings.Contains(section, "narrow every panel") {
		t.Errorf("panels %v use $job_name; docs/deploy.md's Dashboard section must say which, not every panel", byJobName)
	}
	for _, want := range []string{"Jobs", "Lock", "Outbox", "Inbox", "Process"} {
		if !slices.Contains(rows, want) {
			t.Errorf("rows %v lack %q", rows, want)
		}
	}
}

// Whoever is paged gets a runbook: every alert links docs/runbooks/<Alert>.md,
// which exists, answers the paged person's questions, and whose links lead
// somewhere.
func TestEveryAlertHasARunbook(t *testing.T) {
	t.Parallel()
	var rules struct {
		Groups []struct {
			Rules []struct {
				Alert       string
				Annotations map[string]string
			}
		}
	}
	b, err := os.ReadFile(filepath.Join(deployDir, "prometheus/alerts.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(b, &rules); err != nil {
		t.Fatal(err)
	}
	link := regexp.MustCompile(`\]\(([^)#:]+)(#[^)]*)?\)`)
	alerts := 0
	for _, g := range rules.Groups {
		for _, r := range g.Rules {
			if r.Alert == "" {
				continue
			}
			alerts++
			want := "docs/runbooks/" + r.Alert + ".md"
			if got := r.Annotations["runbook_url"]; got != want {
				t.Errorf("%s: runbook_url %q, want %q", r.Alert, got, want)
				continue
			}
			path := filepath.Join("../..", want)
			text, err := os.ReadFile(path)
			if err != nil {
				t.Errorf("%s: %v", r.Alert, err)
				continue
			}
			for _, section := range []string{"# " + r.Alert + "\n", "## What it means", "## Impact", "## First checks", "## Fix", "## Escalate"} {
				if !strings.Contains(string(text), section) {
					t.Errorf("%s lacks %q", want, strings.TrimSpace(section))
				}
			}
			for _, m := range link.FindAllStringSubmatch(string(text), -1) {
				if _, err := os.Stat(filepath.Join(filepath.Dir(path), m[1])); err != nil {
					t.Errorf("%s links %s, which does not exist", want, m[1])
				}
			}
		}
	}
	if alerts < 12 {
		t.Errorf("%d alerts; the issue asks for at least the 12 in alerts.yaml", alerts)
	}
}
