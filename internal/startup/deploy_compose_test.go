package startup

import (
	"context"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/compose-spec/compose-go/v2/loader"
	"github.com/compose-spec/compose-go/v2/types"
	"sigs.k8s.io/yaml"

	"github.com/worker-dev/worker/internal/config"
)

const composeDir = "../../deploy/compose"

// loadCompose loads the demo's compose file as Docker Compose does, with
// the Compose specification's schema validation: an unknown or misspelt
// key fails.
func loadCompose(t *testing.T) *types.Project {
	t.Helper()
	dir, err := filepath.Abs(composeDir)
	if err != nil {
		t.Fatal(err)
	}
	p, err := loader.LoadWithContext(context.Background(), types.ConfigDetails{
		WorkingDir:  dir,
		ConfigFiles: []types.ConfigFile{{Filename: filepath.Join(dir, "compose.yaml")}},
		Environment: types.Mapping{},
	}, func(o *loader.Options) { o.SetProjectName("worker-demo", true) })
	if err != nil {
		t.Fatalf("compose.yaml: %v", err)
	}
	return p
}

// mounted returns the host file that the service mounts at target, failing
// when it mounts nothing there or a file that does not exist.
func mounted(t *testing.T, s types.ServiceConfig, target string) string {
	t.Helper()
	for _, v := range s.Volumes {
		if v.Type == types.VolumeTypeBind && v.Target == target {
			if _, err := os.Stat(v.Source); err != nil {
				t.Errorf("service %s mounts %s at %s: %v", s.Name, v.Source, target, err)
			}
			return v.Source
		}
	}
	t.Errorf("service %s mounts nothing at %s", s.Name, target)
	return ""
}

// sameFile fails unless got is the repository file want (relative to the
// repository's root).
func sameFile(t *testing.T, what, got, want string) {
	t.Helper()
	abs, err := filepath.Abs(filepath.Join("../..", want))
	if err != nil {
		t.Fatal(err)
	}
	if got != abs {
		t.Errorf("%s is %s, want the project's %s", what, got, want)
	}
}

// The demo runs what the README says: three replicas of the worker built
// from this repository, in multi-instance mode with postgres leases, on
// the demo configuration, which the worker itself accepts.
func TestComposeDemoRunsThreeReplicas(t *testing.T) {
	t.Parallel()
	p := loadCompose(t)
	w, err := p.GetService("worker")
	if err != nil {
		t.Fatal(err)
	}
	if w.Build == nil {
		t.Fatal("the worker service builds no image")
	}
	sameFile(t, "the worker's build context", w.Build.Context, ".")
	if _, err := os.Stat(filepath.Join(w.Build.Context, w.Build.Dockerfile)); err != nil {
		t.Errorf("the worker's Dockerfile: %v", err)
	}
	if got := w.GetScale(); got != 3 {
		t.Errorf("worker replicas = %d, want 3", got)
	}

	var env []string
	for k, v := range w.Environment {
		if v == nil {
			t.Errorf("worker variable %s has no value", k)
			continue
		}
		env = append(env, k+"="+*v)
	}
	cfgPath := mounted(t, w, envValue(env, "APP_CONFIG_FILE"))
	sameFile(t, "the worker's configuration", cfgPath, "configs/demo.yaml")
	cfg, err := LoadConfig(cfgPath, env)
	if err != nil {
		t.Fatalf("the worker refuses the demo's configuration: %v", err)
	}
	if !cfg.MultiInstance.Enabled || cfg.Lock.Provider != config.ProviderPostgres {
		t.Errorf("the demo runs multi_instance=%v with the %q lock provider, want multi-instance with postgres leases",
			cfg.MultiInstance.Enabled, cfg.Lock.Provider)
	}
	if len(cfg.Jobs) == 0 || len(cfg.Tasks.Kinds) == 0 || !cfg.Outbox.Enabled {
		t.Errorf("the demo configuration has %d jobs, %d task kinds and outbox.enabled=%v; it should show all three",
			len(cfg.Jobs), len(cfg.Tasks.Kinds), cfg.Outbox.Enabled)
	}
	if !strings.Contains(envValue(env, "APP_DATABASE_URL"), "@postgres:5432/") {
		t.Errorf("APP_DATABASE_URL does not name the demo's postgres service")
	}
	if _, err := p.GetService("postgres"); err != nil {
		t.Error(err)
	}
}

func envValue(env []string, name string) string {
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, name+"="); ok {
			return v
		}
	}
	return ""
}

// Prometheus scrapes the replicas under the job name the alerts expect and
// loads the project's own rule files.
func TestComposeDemoPrometheusUsesTheProjectRules(t *testing.T) {
	t.Parallel()
	p := loadCompose(t)
	prom, err := p.GetService("prometheus")
	if err != nil {
		t.Fatal(err)
	}
	const configTarget = "/etc/prometheus/prometheus.yml"
	if !slices.Contains(prom.Command, "--config.file="+configTarget) {
		t.Errorf("prometheus command %v does not read %s", prom.Command, configTarget)
	}
	var conf struct {
		RuleFiles     []string `json:"rule_files"`
		ScrapeConfigs []struct {
			JobName      string `json:"job_name"`
			DNSSDConfigs []struct {
				Names []string `json:"names"`
				Port  int      `json:"port"`
			} `json:"dns_sd_configs"`
		} `json:"scrape_configs"`
	}
	if err := yaml.Unmarshal([]byte(readFile(t, mounted(t, prom, configTarget))), &conf); err != nil {
		t.Fatal(err)
	}
	var rules []string
	for _, f := range conf.RuleFiles {
		rules = append(rules, filepath.Base(mounted(t, prom, f)))
		sameFile(t, "rule file "+f, mounted(t, prom, f), filepath.Join("deploy/prometheus", filepath.Base(f)))
	}
	slices.Sort(rules)
	if want := []string{"alerts.yaml", "recording.yaml"}; !slices.Equal(rules, want) {
		t.Errorf("prometheus loads the rule files %v, want %v", rules, want)
	}
	// The alerts on up{job="worker"} need the scrape job to be "worker".
	if len(conf.ScrapeConfigs) != 1 || conf.ScrapeConfigs[0].JobName != "worker" ||
		len(conf.ScrapeConfigs[0].DNSSDConfigs) != 1 ||
		!slices.Equal(conf.ScrapeConfigs[0].DNSSDConfigs[0].Names, []string{"worker"}) ||
		conf.ScrapeConfigs[0].DNSSDConfigs[0].Port != 9090 {
		t.Errorf("prometheus scrape configs %+v: want one job named worker, every replica of the service worker on the ops port 9090", conf.ScrapeConfigs)
	}
	if !strings.Contains(readFile(t, "../../deploy/prometheus/alerts.yaml"), `up{job="worker"}`) {
		t.Error(`the alerts no longer select up{job="worker"}; change the demo's scrape job with them`)
	}
}

// Grafana provisions the project's dashboard, reading the demo's
// Prometheus.
func TestComposeDemoGrafanaProvisionsTheDashboard(t *testing.T) {
	t.Parallel()
	p := loadCompose(t)
	g, err := p.GetService("grafana")
	if err != nil {
		t.Fatal(err)
	}
	var providers struct {
		Providers []struct {
			Type    string `json:"type"`
			Options struct {
				Path string `json:"path"`
			} `json:"options"`
		} `json:"providers"`
	}
	if err := yaml.Unmarshal([]byte(readFile(t, mounted(t, g, "/etc/grafana/provisioning/dashboards/worker.yaml"))), &providers); err != nil {
		t.Fatal(err)
	}
	if len(providers.Providers) != 1 || providers.Providers[0].Type != "file" {
		t.Fatalf("dashboard providers %+v: want one file provider", providers.Providers)
	}
	dash := mounted(t, g, providers.Providers[0].Options.Path+"/worker-dashboard.json")
	sameFile(t, "the provisioned dashboard", dash, "deploy/grafana/worker-dashboard.json")

	var sources struct {
		Datasources []struct {
			Type      string `json:"type"`
			URL       string `json:"url"`
			IsDefault bool   `json:"isDefault"`
		} `json:"datasources"`
	}
	if err := yaml.Unmarshal([]byte(readFile(t, mounted(t, g, "/etc/grafana/provisioning/datasources/worker.yaml"))), &sources); err != nil {
		t.Fatal(err)
	}
	// The dashboard's data source variable picks the default Prometheus.
	if len(sources.Datasources) != 1 || sources.Datasources[0].Type != "prometheus" ||
		sources.Datasources[0].URL != "http://prometheus:9090" || !sources.Datasources[0].IsDefault {
		t.Errorf("grafana data sources %+v: want the demo's Prometheus as the default", sources.Datasources)
	}
}
