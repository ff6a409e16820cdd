package startup_test

import (
	"encoding/json"
	"net/http"
	"strings"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// A first start on an empty database, at the default log level, logs its
// migrations as one line, then a ready line that says where to look, and
// the /metrics URL it gives answers: a newcomer's first screen is a few
// lines, not a list of migrations.
func TestFirstStartLogIsShortAndSaysWhereToLook(t *testing.T) {
	t.Parallel()
	db := pgtest.NewEmpty(t)
	p := startWorker(t, []string{"APP_DATABASE_URL=" + db.URL, "APP_LOG_LEVEL=info"})
	p.waitReady(t, 60*time.Second)
	var ready map[string]any
	testkit.Eventually(t, 10*time.Second, "the ready line", func() bool {
		ready = nil
		for _, l := range strings.Split(p.out.String(), "\n") {
			if strings.Contains(l, `"msg":"worker ready"`) {
				_ = json.Unmarshal([]byte(l), &ready)
			}
		}
		return ready != nil
	})
	before, _, _ := strings.Cut(p.out.String(), `"msg":"worker ready"`)
	lines := strings.Split(strings.TrimSpace(before), "\n")
	if n := strings.Count(before, `"msg":"migrations applied"`); n != 1 {
		t.Errorf("%d migrations summary lines before ready, want 1", n)
	}
	if strings.Contains(before, `"msg":"migration applied"`) || strings.Contains(before, `"msg":"river migration applied"`) {
		t.Error("per-migration lines at the info level")
	}
	if len(lines) > 8 {
		t.Errorf("%d lines before the ready line, want a screen's top of at most 8:\n%s", len(lines), before)
	}
	if ready["ops_url"] != "http://"+p.addr || ready["metrics_url"] != "http://"+p.addr+"/metrics" {
		t.Errorf("ready line's ops_url %v and metrics_url %v, want http://%s and its /metrics", ready["ops_url"], ready["metrics_url"], p.addr)
	}
	if _, ok := ready["riverui_url"]; ok {
		t.Errorf("riverui_url %v with River UI off", ready["riverui_url"])
	}
	resp, err := http.Get(ready["metrics_url"].(string))
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("GET %s: %d", ready["metrics_url"], resp.StatusCode)
	}
}
