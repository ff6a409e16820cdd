package config

import (
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/knadh/koanf/parsers/yaml"
	"github.com/knadh/koanf/providers/file"
	"github.com/knadh/koanf/v2"

	"github.com/worker-dev/worker/internal/inbox/inboxconfig"
)

// configs/worker.yaml's commented example of inbox.sources is a valid list
// of entries, and names every key an entry has.
func TestInboxSourcesExampleIsValidAndComplete(t *testing.T) {
	t.Parallel()
	b, err := os.ReadFile("../../configs/worker.yaml")
	if err != nil {
		t.Fatal(err)
	}
	_, rest, ok := strings.Cut(string(b), "\n  # sources:\n")
	example, _, ok2 := strings.Cut(rest, "\n  sources: []\n")
	if !ok || !ok2 {
		t.Fatal("configs/worker.yaml has no commented `# sources:` example before inbox's `sources: []`")
	}
	text := "inbox:\n  sources:\n"
	for _, line := range strings.Split(example, "\n") {
		text += strings.Replace(line, "  # ", "  ", 1) + "\n"
	}
	path := filepath.Join(t.TempDir(), "example.yaml")
	if err := os.WriteFile(path, []byte(text), 0o600); err != nil {
		t.Fatal(err)
	}
	k := koanf.New(".")
	if err := k.Load(file.Provider(path), yaml.Parser()); err != nil {
		t.Fatalf("the example does not parse: %v\n%s", err, text)
	}
	sources, err := loadInboxSources(k, nil)
	if err != nil {
		t.Fatal(err)
	}
	cfg := inboxconfig.DefaultConfig()
	cfg.Sources = sources
	if err := cfg.Validate(); err != nil {
		t.Fatal(err)
	}
	kinds := map[string]bool{}
	for _, s := range sources {
		kinds[s.Kind] = true
	}
	if len(kinds) != 4 {
		t.Errorf("the example shows kinds %v; want one entry of each of the 4", kinds)
	}
	written := map[string]bool{}
	for _, entry := range k.Slices("inbox.sources") {
		for _, key := range entry.Keys() {
			written[key] = true
			for p := key; strings.Contains(p, "."); { // handler.kind also names handler
				p = p[:strings.LastIndex(p, ".")]
				written[p] = true
			}
		}
	}
	for _, st := range flatten("", reflect.ValueOf(inboxconfig.DefaultSource())) {
		if key := strings.TrimPrefix(st.Key, "."); !written[key] {
			t.Errorf("the example of inbox.sources does not show the key %s", key)
		}
	}
}
