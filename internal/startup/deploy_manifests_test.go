package startup

import (
	"bytes"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	monitoringv1 "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	appsv1 "k8s.io/api/apps/v1"
	corev1 "k8s.io/api/core/v1"
	networkingv1 "k8s.io/api/networking/v1"
	policyv1 "k8s.io/api/policy/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	kjson "sigs.k8s.io/json"
	"sigs.k8s.io/kustomize/api/krusty"
	"sigs.k8s.io/kustomize/kyaml/filesys"
	"sigs.k8s.io/yaml"

	"github.com/worker-dev/worker/internal/config"
)

const (
	manifestDir = "../../deploy/kubernetes"
	// exampleOverlay is the complete deployment, relative to manifestDir.
	exampleOverlay = "overlays/example"
	// prometheusRuleFile is generated from deploy/prometheus's rule files.
	prometheusRuleFile = "components/monitoring/prometheusrule.yaml"
	// monitorSelectorLabel is the label the monitoring component's objects
	// carry for a Prometheus to select them; docs/deploy.md names it.
	monitorSelectorLabel, monitorSelectorValue = "release", "prometheus"
	// uiPort is the port the NetworkPolicy opens to operators for River UI
	// on its own address (ui.addr).
	uiPort = 9091
)

// apiTypes maps each kind the manifests may hold to its apiVersion and its
// API type: Kubernetes' own, or the Prometheus Operator's.
var apiTypes = map[string]struct {
	apiVersion string
	newObject  func() any
}{
	"ConfigMap":           {"v1", func() any { return &corev1.ConfigMap{} }},
	"Namespace":           {"v1", func() any { return &corev1.Namespace{} }},
	"Secret":              {"v1", func() any { return &corev1.Secret{} }},
	"Service":             {"v1", func() any { return &corev1.Service{} }},
	"Deployment":          {"apps/v1", func() any { return &appsv1.Deployment{} }},
	"PodDisruptionBudget": {"policy/v1", func() any { return &policyv1.PodDisruptionBudget{} }},
	"NetworkPolicy":       {"networking.k8s.io/v1", func() any { return &networkingv1.NetworkPolicy{} }},
	"ServiceMonitor":      {monitoringv1.SchemeGroupVersion.String(), func() any { return &monitoringv1.ServiceMonitor{} }},
	"PrometheusRule":      {monitoringv1.SchemeGroupVersion.String(), func() any { return &monitoringv1.PrometheusRule{} }},
}

// builtObjects is what `kubectl apply -k` would send: every object decoded
// into its API type, by kind.
type builtObjects map[string][]any

// one returns the only object of type T, failing unless there is exactly one.
func one[T any](t *testing.T, b builtObjects) *T {
	t.Helper()
	var found []*T
	for _, objs := range b {
		for _, o := range objs {
			if v, ok := o.(*T); ok {
				found = append(found, v)
			}
		}
	}
	if len(found) != 1 {
		var zero T
		t.Fatalf("%d objects of type %T, want 1", len(found), zero)
	}
	return found[0]
}

// deployFS is an in-memory copy of deploy/kubernetes at /deploy/kubernetes,
// plus extra files (path relative to it: content). A database-url someone
// created on disk for the example overlay is left out: tests never read a
// real secret.
func deployFS(t *testing.T, extra map[string]string) filesys.FileSystem {
	t.Helper()
	mem := filesys.MakeFsInMemory()
	err := filepath.WalkDir(manifestDir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() || d.Name() == "database-url" {
			return err
		}
		rel, _ := filepath.Rel(manifestDir, path)
		b, err := os.ReadFile(path)
		if err != nil {
			return err
		}
		return mem.WriteFile(filepath.Join("/deploy/kubernetes", rel), b)
	})
	if err != nil {
		t.Fatal(err)
	}
	for rel, content := range extra {
		if err := mem.WriteFile(filepath.Join("/deploy/kubernetes", rel), []byte(content)); err != nil {
			t.Fatal(err)
		}
	}
	return mem
}

// kustomizeBuild builds dir (relative to deploy/kubernetes) through the
// kustomize API with kubectl's defaults (files only from within each
// kustomization's root) and decodes every object strictly: an unknown,
// misspelt or duplicated field fails, as does a kind without an API type.
func kustomizeBuild(t *testing.T, fsys filesys.FileSystem, dir string) builtObjects {
	t.Helper()
	resources, err := krusty.MakeKustomizer(krusty.MakeDefaultOptions()).Run(fsys, filepath.Join("/deploy/kubernetes", dir))
	if err != nil {
		t.Fatalf("kustomize build %s: %v", dir, err)
	}
	out := builtObjects{}
	for _, r := range resources.Resources() {
		kind, where := r.GetKind(), dir+": "+r.GetKind()+" "+r.GetName()
		typ, ok := apiTypes[kind]
		if !ok {
			t.Fatalf("%s: kind %q has no API type in this test", where, kind)
		}
		if r.GetApiVersion() != typ.apiVersion {
			t.Errorf("%s: apiVersion %s, want %s", where, r.GetApiVersion(), typ.apiVersion)
		}
		j, err := r.MarshalJSON()
		if err != nil {
			t.Fatalf("%s: %v", where, err)
		}
		v := typ.newObject()
		strict, err := kjson.UnmarshalStrict(j, v)
		if err != nil {
			t.Fatalf("%s: %v", where, err)
		}
		for _, e := range strict {
			t.Errorf("%s: %v", where, e)
		}
		out[kind] = append(out[kind], v)
	}
	return out
}

// exampleOverlayFS holds the file the example overlay's Secret is made of,
// as an operator would create it.
func exampleOverlayFS(t *testing.T) filesys.FileSystem {
	return deployFS(t, map[string]string{exampleOverlay + "/database-url": "postgres://worker:secret@db.example:5432/app?sslmode=require"})
}

// The base applies to a plain cluster: only built-in kinds, none of the
// Prometheus Operator's, and it agrees with the worker.
func TestKubernetesBaseAppliesToAPlainCluster(t *testing.T) {
	t.Parallel()
	base := kustomizeBuild(t, deployFS(t, nil), ".")
	for kind := range base {
		if apiTypes[kind].apiVersion == monitoringv1.SchemeGroupVersion.String() {
			t.Errorf("the base holds a %s: it needs the Prometheus Operator's CRDs, so it belongs in components/monitoring", kind)
		}
	}
	for _, kind := range []string{"Deployment", "Service", "PodDisruptionBudget", "ConfigMap"} {
		if len(base[kind]) != 1 {
			t.Errorf("the base holds %d %s, want 1", len(base[kind]), kind)
		}
	}
	checkWorkerManifests(t, base)
}

// The example overlay is a complete deployment: everything in its own
// namespace, the Secret generated from a file and referenced, monitoring
// that selects the Service and carries the rules, and the NetworkPolicy.
func TestKubernetesExampleOverlay(t *testing.T) {
	t.Parallel()
	objs := kustomizeBuild(t, exampleOverlayFS(t), exampleOverlay)
	opsPort := checkWorkerManifests(t, objs)

	ns := one[corev1.Namespace](t, objs)
	for kind, list := range objs {
		for _, o := range list {
			meta := reflect.ValueOf(o).Elem().FieldByName("ObjectMeta").Interface().(metav1.ObjectMeta)
			if kind != "Namespace" && meta.Namespace != ns.Name {
				t.Errorf("%s %s is in namespace %q, want %q", kind, meta.Name, meta.Namespace, ns.Name)
			}
		}
	}

	// The Deployment reads the URL from the generated Secret, by its
	// hashed name.
	d := one[appsv1.Deployment](t, objs)
	secret := one[corev1.Secret](t, objs)
	var ref *corev1.SecretKeySelector
	for _, e := range d.Spec.Template.Spec.Containers[0].Env {
		if e.Name == "APP_DATABASE_URL" && e.ValueFrom != nil {
			ref = e.ValueFrom.SecretKeyRef
		}
	}
	if ref == nil || ref.Name != secret.Name {
		t.Errorf("APP_DATABASE_URL reads %+v; want the generated Secret %s", ref, secret.Name)
	} else if _, ok := secret.Data[ref.Key]; !ok {
		t.Errorf("Secret %s has no key %q", secret.Name, ref.Key)
	}

	// The ServiceMonitor scrapes the Service's ops port in its own
	// namespace, and a Prometheus can select it and the rules by the
	// documented label.
	svc, mon, rule := one[corev1.Service](t, objs), one[monitoringv1.ServiceMonitor](t, objs), one[monitoringv1.PrometheusRule](t, objs)
	if s, err := metav1.LabelSelectorAsSelector(&mon.Spec.Selector); err != nil || s.Empty() || !s.Matches(labels.Set(svc.Labels)) {
		t.Errorf("ServiceMonitor selector %v does not select the Service (%v)", mon.Spec.Selector, svc.Labels)
	}
	if n := mon.Spec.NamespaceSelector; n.Any || len(n.MatchNames) > 0 {
		t.Errorf("ServiceMonitor namespaceSelector %+v; want the Service in its own namespace", n)
	}
	if ep := mon.Spec.Endpoints; len(ep) != 1 || ep[0].Port != svc.Spec.Ports[0].Name || ep[0].Path != "/metrics" {
		t.Errorf("ServiceMonitor endpoints %+v; want /metrics on the Service's port %s", ep, svc.Spec.Ports[0].Name)
	}
	readme := readFile(t, "../../docs/deploy.md")
	for _, m := range []metav1.ObjectMeta{mon.ObjectMeta, rule.ObjectMeta} {
		if m.Labels[monitorSelectorLabel] != monitorSelectorValue {
			t.Errorf("%s has labels %v; want %s: %s for a Prometheus to select it", m.Name, m.Labels, monitorSelectorLabel, monitorSelectorValue)
		}
	}
	if !strings.Contains(readme, monitorSelectorLabel+": "+monitorSelectorValue) {
		t.Errorf("docs/deploy.md does not document the monitoring selector label %s: %s", monitorSelectorLabel, monitorSelectorValue)
	}
	// The rules are deploy/prometheus's, group for group.
	if want := prometheusRuleGroups(t); !reflect.DeepEqual(rule.Spec.Groups, want) {
		t.Errorf("the PrometheusRule's groups differ from deploy/prometheus's rule files; regenerate %s (see TestPrometheusRuleIsGenerated)", prometheusRuleFile)
	}

	checkNetworkPolicy(t, objs, opsPort)
}

// An overlay customizes the deployment as docs/deploy.md shows: its own image
// with images:, its own worker.yaml (jobs configured without a rebuild),
// and the label its Prometheus selects on.
func TestKubernetesOverlayCustomizes(t *testing.T) {
	t.Parallel()
	base := kustomizeBuild(t, deployFS(t, nil), ".")
	image := one[appsv1.Deployment](t, base).Spec.Template.Spec.Containers[0].Image
	name, _, _ := strings.Cut(image, ":")
	fsys := deployFS(t, map[string]string{
		"../mine/kustomization.yaml": `resources: [../kubernetes]
components: [../kubernetes/components/monitoring]
images:
  - name: ` + name + `
    newName: ghcr.io/acme/worker
    newTag: 9.9.9
configMapGenerator:
  - name: worker-config
    behavior: replace
    files: [worker.yaml]
patches:
  - target: {group: monitoring.coreos.com}
    patch: |
      - op: replace
        path: /metadata/labels/release
        value: kube-prometheus-stack
`,
		"../mine/worker.yaml": `multi_instance: {enabled: true}
lock: {provider: postgres}
jobs:
  - {name: purge-sessions, kind: sql, delay: 1m, sql: "DELETE FROM session WHERE expires_at < now()"}
`,
	})
	mine := kustomizeBuild(t, fsys, "../mine")
	pod := one[appsv1.Deployment](t, mine).Spec.Template.Spec
	if got := pod.Containers[0].Image; got != "ghcr.io/acme/worker:9.9.9" {
		t.Errorf("overlay image %q, want ghcr.io/acme/worker:9.9.9", got)
	}
	cfg := manifestConfig(t, pod, one[corev1.ConfigMap](t, mine))
	if len(cfg.Jobs) != 1 || cfg.Jobs[0].Name != "purge-sessions" {
		t.Errorf("jobs %+v; want the overlay's purge-sessions", cfg.Jobs)
	}
	for _, m := range []metav1.ObjectMeta{one[monitoringv1.ServiceMonitor](t, mine).ObjectMeta, one[monitoringv1.PrometheusRule](t, mine).ObjectMeta} {
		if m.Labels[monitorSelectorLabel] != "kube-prometheus-stack" {
			t.Errorf("%s labels %v; want the overlay's %s: kube-prometheus-stack", m.Name, m.Labels, monitorSelectorLabel)
		}
	}

	readme := readFile(t, "../../docs/deploy.md")
	for _, want := range []string{"kubectl apply -k deploy/kubernetes\n", "kubectl apply -k deploy/kubernetes/" + exampleOverlay,
		"kubectl create secret generic worker-database", "- name: " + name, "behavior: replace",
		"- target: {group: monitoring.coreos.com}"} {
		if !strings.Contains(readme, want) {
			t.Errorf("docs/deploy.md's Kubernetes section lacks %q", strings.TrimSpace(want))
		}
	}
}

// checkWorkerManifests checks that the built manifests agree with the
// worker: the image is pinned, the configuration they give is valid and
// comes from the ConfigMap, the probes and the Service reach the ops
// server, GOMEMLIMIT sits under the memory limit, SIGKILL comes after the
// shutdown budget, and several replicas run in multi-instance mode.
// It returns the ops server's container port.
func checkWorkerManifests(t *testing.T, objs builtObjects) corev1.ContainerPort {
	t.Helper()
	d := one[appsv1.Deployment](t, objs)
	svc, pdb := one[corev1.Service](t, objs), one[policyv1.PodDisruptionBudget](t, objs)
	pod := d.Spec.Template.Spec
	if len(pod.Containers) != 1 {
		t.Fatalf("%d containers, want the worker alone", len(pod.Containers))
	}
	c := pod.Containers[0]
	checkImage(t, c)

	cfg := manifestConfig(t, pod, one[corev1.ConfigMap](t, objs))
	if !cfg.MultiInstance.Enabled || cfg.Lock.Provider != config.ProviderPostgres {
		t.Errorf("multi_instance.enabled=%v lock.provider=%q; replicas share the database, so want true and postgres",
			cfg.MultiInstance.Enabled, cfg.Lock.Provider)
	}
	if r := d.Spec.Replicas; r == nil || *r < 2 {
		t.Errorf("replicas unset or under 2; want at least 2 in multi-instance mode")
	}

	// Probes and the Service reach the port the ops server listens on.
	opsPort := containerPort(t, c, cfg.HTTP.Addr)
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
		if g := p.probe.HTTPGet; g.Path != p.path || g.Port.String() != opsPort.Name && g.Port.IntValue() != int(opsPort.ContainerPort) {
			t.Errorf("%s probe: GET %s on port %s, want %s on %s (%d)", p.name, g.Path, g.Port.String(), p.path, opsPort.Name, opsPort.ContainerPort)
		}
	}
	if p := svc.Spec.Ports; len(p) != 1 || p[0].TargetPort.String() != opsPort.Name {
		t.Errorf("service ports %+v; want one whose targetPort is %s", p, opsPort.Name)
	}
	// The alerts select up{job="worker"}; the Operator names the scrape job
	// after the Service.
	if svc.Name != "worker" {
		t.Errorf("service %q; deploy/prometheus/alerts.yaml expects the scrape job (the service name) to be worker", svc.Name)
	}

	// Selectors pick the worker's pods.
	podLabels := labels.Set(d.Spec.Template.Labels)
	for name, sel := range map[string]*metav1.LabelSelector{
		"deployment": d.Spec.Selector, "pod disruption budget": pdb.Spec.Selector,
		"service": {MatchLabels: svc.Spec.Selector},
	} {
		if s, err := metav1.LabelSelectorAsSelector(sel); err != nil || s.Empty() || !s.Matches(podLabels) {
			t.Errorf("%s selector %v does not select the pods (%v)", name, sel, podLabels)
		}
	}

	// SIGKILL only after the shutdown budget, with margin for the exit.
	grace := pod.TerminationGracePeriodSeconds
	if grace == nil || time.Duration(*grace)*time.Second < cfg.Shutdown.Timeout+5*time.Second {
		t.Errorf("terminationGracePeriodSeconds unset or under shutdown.timeout (%s) + 5s", cfg.Shutdown.Timeout)
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
	checkMemoryLimit(t, c)
	return opsPort
}

// checkImage: a full registry reference with a pinned tag (or a digest), so
// the node pulls it once and from where it is, not docker.io/library/worker.
func checkImage(t *testing.T, c corev1.Container) {
	t.Helper()
	ref := c.Image
	// name@sha256:digest, or name:tag where the tag follows the last "/"
	// (a registry's host:port has a colon too).
	name, pin, hasDigest := strings.Cut(ref, "@sha256:")
	if i := strings.LastIndex(ref, ":"); !hasDigest && i > strings.LastIndex(ref, "/") {
		name, pin = ref[:i], ref[i+1:]
	}
	registry, _, hasPath := strings.Cut(name, "/")
	if !hasPath || !strings.ContainsAny(registry, ".:") && registry != "localhost" {
		t.Errorf("image %q does not name its registry (host/path:tag)", ref)
	}
	if pin == "" || pin == "latest" {
		t.Errorf("image %q has no pinned tag or digest", ref)
	}
	if c.ImagePullPolicy == corev1.PullAlways {
		t.Errorf("imagePullPolicy Always for a pinned image; leave it to IfNotPresent")
	}
}

// containerPort returns the named container port the ops server's address
// listens on.
func containerPort(t *testing.T, c corev1.Container, addr string) corev1.ContainerPort {
	t.Helper()
	_, port, _ := net.SplitHostPort(addr)
	for _, p := range c.Ports {
		if strconv.Itoa(int(p.ContainerPort)) == port && p.Name != "" {
			return p
		}
	}
	t.Fatalf("no named container port for the ops server's %s (http.addr)", addr)
	return corev1.ContainerPort{}
}

// checkMemoryLimit: GOMEMLIMIT at 80–90% of the memory limit, so the
// collector works harder before the kubelet would kill the pod, with room
// for what the Go runtime does not manage.
func checkMemoryLimit(t *testing.T, c corev1.Container) {
	t.Helper()
	limit := c.Resources.Limits.Memory()
	if limit.IsZero() {
		t.Fatal("no memory limit")
	}
	var soft string
	for _, e := range c.Env {
		if e.Name == "GOMEMLIMIT" {
			soft = e.Value
		}
	}
	bytes, ok := parseGoMemLimit(soft)
	if !ok {
		t.Fatalf("GOMEMLIMIT %q is not a byte count Go reads (like 218MiB)", soft)
	}
	if r := float64(bytes) / float64(limit.Value()); r < 0.80 || r > 0.90 {
		t.Errorf("GOMEMLIMIT %s is %.0f%% of the memory limit %s; want 80–90%%", soft, 100*r, limit)
	}
}

// parseGoMemLimit reads GOMEMLIMIT's syntax: an integer with an optional
// B, KiB, MiB, GiB or TiB suffix.
func parseGoMemLimit(s string) (int64, bool) {
	for _, u := range []struct {
		suffix string
		shift  uint
	}{{"TiB", 40}, {"GiB", 30}, {"MiB", 20}, {"KiB", 10}, {"B", 0}} {
		if n, ok := strings.CutSuffix(s, u.suffix); ok {
			v, err := strconv.ParseInt(n, 10, 64)
			return v << u.shift, err == nil && v > 0
		}
	}
	v, err := strconv.ParseInt(s, 10, 64)
	return v, err == nil && v > 0
}

// manifestConfig loads the configuration the container would get: the
// ConfigMap's file, mounted where APP_CONFIG_FILE points, under the
// container's APP_* variables. Every APP_* variable must be a setting;
// values from the downward API or a Secret get a stand-in.
func manifestConfig(t *testing.T, pod corev1.PodSpec, cm *corev1.ConfigMap) *runConfig {
	t.Helper()
	c := pod.Containers[0]
	known := map[string]bool{}
	for _, env := range config.Envs() {
		known[env] = true
	}
	var env []string
	vars := map[string]corev1.EnvVar{}
	for _, e := range c.Env {
		if strings.HasPrefix(e.Name, "APP_") && !known[e.Name] {
			t.Errorf("%s is not a configuration key (see docs/configuration.md)", e.Name)
		}
		v := e.Value
		if e.ValueFrom != nil {
			v = map[string]string{"APP_DATABASE_URL": "postgres://worker:secret@db:5432/app", "APP_INSTANCE_ID": "worker-7d9f-abcde"}[e.Name]
		}
		vars[e.Name] = e
		env = append(env, e.Name+"="+v)
	}
	if f := vars["APP_INSTANCE_ID"].ValueFrom; f == nil || f.FieldRef == nil || f.FieldRef.FieldPath != "metadata.name" {
		t.Error("APP_INSTANCE_ID must come from the pod name (fieldRef metadata.name)")
	}
	if f := vars["APP_DATABASE_URL"].ValueFrom; f == nil || f.SecretKeyRef == nil {
		t.Error("APP_DATABASE_URL must come from a Secret")
	}

	// APP_CONFIG_FILE names a key of the ConfigMap, through a volume mount.
	path := vars["APP_CONFIG_FILE"].Value
	var volume string
	for _, m := range c.VolumeMounts {
		if filepath.Dir(path) == filepath.Clean(m.MountPath) {
			volume = m.Name
		}
	}
	var source *corev1.ConfigMapVolumeSource
	for _, v := range pod.Volumes {
		if v.Name == volume && v.ConfigMap != nil {
			source = v.ConfigMap
		}
	}
	if source == nil || source.Name != cm.Name {
		t.Fatalf("APP_CONFIG_FILE %q is not in a volume of the ConfigMap %s", path, cm.Name)
	}
	content, ok := cm.Data[filepath.Base(path)]
	if !ok {
		t.Fatalf("ConfigMap %s has no key %s, which APP_CONFIG_FILE names", cm.Name, filepath.Base(path))
	}
	file := filepath.Join(t.TempDir(), "worker.yaml")
	if err := os.WriteFile(file, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	cfg, err := LoadConfig(file, env)
	if err != nil {
		t.Fatalf("the manifests' configuration does not load: %v", err)
	}
	return cfg
}

// checkNetworkPolicy: the worker's pods accept only what the policy allows:
// the ops port from Prometheus, River UI's port from operators, each from
// selected peers, nothing from everyone.
func checkNetworkPolicy(t *testing.T, objs builtObjects, ops corev1.ContainerPort) {
	t.Helper()
	np := one[networkingv1.NetworkPolicy](t, objs)
	d := one[appsv1.Deployment](t, objs)
	if s, err := metav1.LabelSelectorAsSelector(&np.Spec.PodSelector); err != nil || s.Empty() || !s.Matches(labels.Set(d.Spec.Template.Labels)) {
		t.Errorf("NetworkPolicy podSelector %v does not select the worker's pods", np.Spec.PodSelector)
	}
	if !slices.Equal(np.Spec.PolicyTypes, []networkingv1.PolicyType{networkingv1.PolicyTypeIngress}) {
		t.Errorf("NetworkPolicy policyTypes %v, want [Ingress]", np.Spec.PolicyTypes)
	}
	peers := map[int][]networkingv1.NetworkPolicyPeer{} // port number: who may reach it
	for i, rule := range np.Spec.Ingress {
		if len(rule.From) == 0 || len(rule.Ports) == 0 {
			t.Errorf("ingress rule %d allows every peer or every port: %+v", i, rule)
		}
		for _, from := range rule.From {
			if from.IPBlock == nil && from.NamespaceSelector == nil && from.PodSelector == nil {
				t.Errorf("ingress rule %d has an empty peer", i)
			}
		}
		for _, p := range rule.Ports {
			n := 0
			switch {
			case p.Port == nil:
			case p.Port.String() == ops.Name:
				n = int(ops.ContainerPort)
			default:
				n = p.Port.IntValue()
			}
			if n != int(ops.ContainerPort) && n != uiPort {
				t.Errorf("ingress rule %d opens port %v; want only the ops port %d and River UI's %d", i, p.Port, ops.ContainerPort, uiPort)
			}
			peers[n] = append(peers[n], rule.From...)
		}
	}
	if len(peers[int(ops.ContainerPort)]) == 0 || len(peers[uiPort]) == 0 {
		t.Fatalf("NetworkPolicy opens the ops port to %v and River UI's to %v; want both to selected peers", peers[int(ops.ContainerPort)], peers[uiPort])
	}
	for _, p := range peers[uiPort] {
		if slices.ContainsFunc(peers[int(ops.ContainerPort)], func(q networkingv1.NetworkPolicyPeer) bool { return reflect.DeepEqual(p, q) }) {
			t.Errorf("River UI's port is open to the ops port's peer %+v (Prometheus); want operators only", p)
		}
	}
}

// prometheusRuleGroups reads deploy/prometheus's rule files, strictly, into
// the Prometheus Operator's types: recording rules first, then alerts.
func prometheusRuleGroups(t *testing.T) []monitoringv1.RuleGroup {
	t.Helper()
	var groups []monitoringv1.RuleGroup
	for _, f := range []string{"recording.yaml", "alerts.yaml"} {
		var rules struct {
			Groups []monitoringv1.RuleGroup `json:"groups"`
		}
		decodeStrict(t, filepath.Join("../../deploy/prometheus", f), &rules)
		groups = append(groups, rules.Groups...)
	}
	return groups
}

const generatedHeader = `# Generated from deploy/prometheus/recording.yaml and alerts.yaml; do not edit.
# Regenerate after changing them:
#   WORKER_UPDATE_GENERATED=1 go test ./internal/startup -run TestPrometheusRuleIsGenerated
`

// The monitoring component's PrometheusRule is deploy/prometheus's rule
// files, which promtool checks and tests, wrapped for the Operator: it is
// generated from them, never copied by hand, so the two cannot drift.
// WORKER_UPDATE_GENERATED=1 rewrites it.
func TestPrometheusRuleIsGenerated(t *testing.T) {
	t.Parallel()
	rule := monitoringv1.PrometheusRule{
		TypeMeta: metav1.TypeMeta{APIVersion: monitoringv1.SchemeGroupVersion.String(), Kind: monitoringv1.PrometheusRuleKind},
		ObjectMeta: metav1.ObjectMeta{Name: "worker", Labels: map[string]string{
			"app.kubernetes.io/name": "worker", monitorSelectorLabel: monitorSelectorValue,
		}},
		Spec: monitoringv1.PrometheusRuleSpec{Groups: prometheusRuleGroups(t)},
	}
	b, err := yaml.Marshal(rule)
	if err != nil {
		t.Fatal(err)
	}
	want := append([]byte(generatedHeader), b...)
	path := filepath.Join(manifestDir, prometheusRuleFile)
	if os.Getenv("WORKER_UPDATE_GENERATED") == "1" {
		if err := os.WriteFile(path, want, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if got, err := os.ReadFile(path); err != nil || !bytes.Equal(got, want) {
		t.Errorf("%s is not what deploy/prometheus's rule files generate (%v); regenerate it:\n  WORKER_UPDATE_GENERATED=1 go test ./internal/startup -run TestPrometheusRuleIsGenerated", path, err)
	}
}

// decodeStrict decodes one YAML document into v, failing on an unknown,
// misspelt (also in case) or duplicated field.
func decodeStrict(t *testing.T, path string, v any) {
	t.Helper()
	b := []byte(readFile(t, path))
	if bytes.Contains(b, []byte("\n---")) {
		t.Fatalf("%s: one document per file, please", path)
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

func readFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
