package startup

import (
	"bytes"
	"net"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	kjson "sigs.k8s.io/json"
	"sigs.k8s.io/yaml"
)

const manifestDir = "../../deploy/kubernetes"

// kustomization is the part of kustomize's Kustomization the manifests use.
type kustomization struct {
	metav1.TypeMeta `json:",inline"`
	Labels          []struct {
		Pairs map[string]string `json:"pairs"`
	} `json:"labels"`
	Resources []string `json:"resources"`
	Images    []struct {
		Name    string `json:"name"`
		NewName string `json:"newName,omitempty"`
		NewTag  string `json:"newTag,omitempty"`
	} `json:"images"`
}

// serviceMonitor is the part of the Prometheus Operator's ServiceMonitor
// the manifests use; its types would bring the operator's module along.
type serviceMonitor struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata"`
	Spec              struct {
		Selector  metav1.LabelSelector `json:"selector"`
		Endpoints []struct {
			Port     string `json:"port"`
			Path     string `json:"path"`
			Interval string `json:"interval"`
		} `json:"endpoints"`
	} `json:"spec"`
}

// decodeStrict decodes one YAML manifest into v, failing on an unknown,
// misspelt (also in case) or duplicated field.
func decodeStrict(t *testing.T, path string, v any) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if bytes.Contains(b, []byte("\n---")) {
		t.Fatalf("%s: one object per file, please", path)
	}
	j, err := yaml.YAMLToJSONStrict(b)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	strict, err := kjson.UnmarshalStrict(j, v)
	if err != nil {
		t.Fatalf("%s: %v", path, err)
	}
	for _, e := range strict {
		t.Errorf("%s: %v", path, e)
	}
}

// manifests decodes every file of the kustomization into its official type.
type manifests struct {
	deployment *appsv1.Deployment
	service    *corev1.Service
	pdb        *policyv1.PodDisruptionBudget
	monitor    *serviceMonitor
}

func loadManifests(t *testing.T) manifests {
	t.Helper()
	var k kustomization
	decodeStrict(t, filepath.Join(manifestDir, "kustomization.yaml"), &k)
	files, err := filepath.Glob(filepath.Join(manifestDir, "*.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var m manifests
	for _, f := range files {
		name := filepath.Base(f)
		if name == "kustomization.yaml" {
			continue
		}
		if !slices.Contains(k.Resources, name) {
			t.Errorf("%s is not listed in kustomization.yaml's resources", name)
		}
		var meta metav1.TypeMeta
		decodeLoose(t, f, &meta)
		switch meta.Kind {
		case "Deployment":
			m.deployment = &appsv1.Deployment{}
			decodeStrict(t, f, m.deployment)
		case "Service":
			m.service = &corev1.Service{}
			decodeStrict(t, f, m.service)
		case "PodDisruptionBudget":
			m.pdb = &policyv1.PodDisruptionBudget{}
			decodeStrict(t, f, m.pdb)
		case "ServiceMonitor":
			m.monitor = &serviceMonitor{}
			decodeStrict(t, f, m.monitor)
		default:
			t.Fatalf("%s: kind %q has no decoder in this test", name, meta.Kind)
		}
	}
	if m.deployment == nil || m.service == nil || m.pdb == nil || m.monitor == nil {
		t.Fatalf("want a Deployment, a Service, a PodDisruptionBudget and a ServiceMonitor in %s", manifestDir)
	}
	return m
}

func decodeLoose(t *testing.T, path string, v any) {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if err := yaml.Unmarshal(b, v); err != nil {
		t.Fatalf("%s: %v", path, err)
	}
}

// The manifests decode strictly into Kubernetes' own types and agree with
// the worker: the configuration they set is valid, the probes and the
// scrape reach the ops server, SIGKILL comes after the shutdown budget, and
// several replicas run in multi-instance mode.
func TestKubernetesManifestsMatchTheWorker(t *testing.T) {
	t.Parallel()
	m := loadManifests(t)
	pod := m.deployment.Spec.Template.Spec
	if len(pod.Containers) != 1 {
		t.Fatalf("%d containers, want the worker alone", len(pod.Containers))
	}
	c := pod.Containers[0]

	cfg := manifestConfig(t, c)
	if !cfg.MultiInstance.Enabled || cfg.Lock.Provider != ProviderPostgres {
		t.Errorf("multi_instance.enabled=%v lock.provider=%q; replicas share the database, so want true and postgres",
			cfg.MultiInstance.Enabled, cfg.Lock.Provider)
	}
	if r := m.deployment.Spec.Replicas; r == nil || *r < 2 {
		t.Errorf("replicas unset or under 2; want at least 2 in multi-instance mode")
	}

	// Probes and the scrape reach the port the ops server listens on.
	_, port, _ := net.SplitHostPort(cfg.HTTP.Addr)
	var opsPort *corev1.ContainerPort
	for i, p := range c.Ports {
		if strconv.Itoa(int(p.ContainerPort)) == port {
			opsPort = &c.Ports[i]
		}
	}
	if opsPort == nil || opsPort.Name == "" {
		t.Fatalf("no named container port for the ops server's %s (APP_HTTP_ADDR)", cfg.HTTP.Addr)
	}
	probes := []struct {
		name  string
		probe *corev1.Probe
		path  string
	}{{"startup", c.StartupProbe, "/readyz"}, {"readiness", c.ReadinessProbe, "/readyz"}, {"liveness", c.LivenessProbe, "/livez"}}
	for _, p := range probes {
		if p.probe == nil || p.probe.HTTPGet == nil {
			t.Errorf("%s probe: want an HTTP GET on %s", p.name, p.path)
			continue
		}
		if g := p.probe.HTTPGet; g.Path != p.path || g.Port.String() != opsPort.Name && g.Port.String() != port {
			t.Errorf("%s probe: GET %s on port %s, want %s on %s (%s)", p.name, g.Path, g.Port.String(), p.path, opsPort.Name, port)
		}
	}
	svcPort := m.service.Spec.Ports
	if len(svcPort) != 1 || svcPort[0].TargetPort.String() != opsPort.Name {
		t.Errorf("service ports %+v; want one whose targetPort is %s", svcPort, opsPort.Name)
	}
	if ep := m.monitor.Spec.Endpoints; len(ep) != 1 || ep[0].Port != svcPort[0].Name || ep[0].Path != "/metrics" {
		t.Errorf("ServiceMonitor endpoints %+v; want /metrics on the service port %s", ep, svcPort[0].Name)
	}
	// The alerts select up{job="worker"}; the Operator names the scrape job
	// after the Service.
	if m.service.Name != "worker" {
		t.Errorf("service %q; deploy/prometheus/alerts.yaml expects the scrape job (the service name) to be worker", m.service.Name)
	}

	// Selectors pick the worker's pods, and the monitor picks the service.
	podLabels := labels.Set(m.deployment.Spec.Template.Labels)
	for name, sel := range map[string]*metav1.LabelSelector{
		"deployment": m.deployment.Spec.Selector, "pod disruption budget": m.pdb.Spec.Selector,
		"service": {MatchLabels: m.service.Spec.Selector},
	} {
		if s, err := metav1.LabelSelectorAsSelector(sel); err != nil || s.Empty() || !s.Matches(podLabels) {
			t.Errorf("%s selector %v does not select the pods (%v)", name, sel, podLabels)
		}
	}
	if s, err := metav1.LabelSelectorAsSelector(&m.monitor.Spec.Selector); err != nil || !s.Matches(labels.Set(m.service.Labels)) {
		t.Errorf("ServiceMonitor selector does not select the service")
	}

	// SIGKILL only after the shutdown budget, with margin for the exit.
	grace := pod.TerminationGracePeriodSeconds
	if grace == nil || time.Duration(*grace)*time.Second < cfg.Shutdown.Timeout+5*time.Second {
		t.Errorf("terminationGracePeriodSeconds unset or under APP_SHUTDOWN_TIMEOUT (%s) + 5s", cfg.Shutdown.Timeout)
	}

	// Restricted pod security.
	sc, psc := c.SecurityContext, pod.SecurityContext
	restricted := sc != nil && psc != nil &&
		psc.RunAsNonRoot != nil && *psc.RunAsNonRoot &&
		psc.SeccompProfile != nil && psc.SeccompProfile.Type == corev1.SeccompProfileTypeRuntimeDefault &&
		sc.ReadOnlyRootFilesystem != nil && *sc.ReadOnlyRootFilesystem &&
		sc.AllowPrivilegeEscalation != nil && !*sc.AllowPrivilegeEscalation &&
		sc.Capabilities != nil && slices.Equal(sc.Capabilities.Drop, []corev1.Capability{"ALL"})
	if !restricted {
		t.Errorf("security context not restricted: pod %+v, container %+v", psc, sc)
	}
	for _, r := range []corev1.ResourceName{corev1.ResourceCPU, corev1.ResourceMemory} {
		if _, ok := c.Resources.Requests[r]; !ok {
			t.Errorf("no %s request", r)
		}
	}
	if _, ok := c.Resources.Limits[corev1.ResourceMemory]; !ok {
		t.Error("no memory limit")
	}
}

// manifestConfig checks that every APP_* variable of the container is a
// configuration key and loads the configuration the container would get.
// Values from the downward API or a Secret get a stand-in.
func manifestConfig(t *testing.T, c corev1.Container) *Config {
	t.Helper()
	known := map[string]bool{"APP_CONFIG_FILE": true}
	for _, s := range settings() {
		known[s.Env()] = true
	}
	var env []string
	from := map[string]*corev1.EnvVarSource{}
	for _, e := range c.Env {
		if strings.HasPrefix(e.Name, "APP_") && !known[e.Name] {
			t.Errorf("%s is not a configuration key (see the README's table)", e.Name)
		}
		v := e.Value
		if e.ValueFrom != nil {
			from[e.Name] = e.ValueFrom
			v = map[string]string{"APP_DATABASE_URL": "postgres://worker:secret@db:5432/app", "APP_INSTANCE_ID": "worker-7d9f-abcde"}[e.Name]
		}
		env = append(env, e.Name+"="+v)
	}
	if f := from["APP_INSTANCE_ID"]; f == nil || f.FieldRef == nil || f.FieldRef.FieldPath != "metadata.name" {
		t.Error("APP_INSTANCE_ID must come from the pod name (fieldRef metadata.name)")
	}
	if f := from["APP_DATABASE_URL"]; f == nil || f.SecretKeyRef == nil {
		t.Error("APP_DATABASE_URL must come from a Secret")
	}
	if f := from["GOMEMLIMIT"]; f == nil || f.ResourceFieldRef == nil || f.ResourceFieldRef.Resource != "limits.memory" || c.Resources.Limits.Memory().IsZero() {
		t.Error("GOMEMLIMIT must come from the container's memory limit (resourceFieldRef limits.memory), so the collector works harder before the kubelet kills it")
	}
	// The image ships configs/ and reads configs/worker.yaml, as here.
	cfg, err := LoadConfig("../../"+DefaultConfigFile, env)
	if err != nil {
		t.Fatalf("the manifest's configuration does not load: %v", err)
	}
	return cfg
}
