package startup_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/chromedp/cdproto/fetch"
	"github.com/chromedp/chromedp"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// screenshotEnv asks the browser test to write its screenshot to
// docs/images (for the docs) instead of a temporary directory.
const screenshotEnv = "WORKER_UPDATE_SCREENSHOTS"

// A real browser (headless Chromium) logs in to River UI through the basic
// auth challenge, opens the job list and finds a dead-lettered task by its
// kind, retries it from the UI itself, and then, logged in, opens a page
// on another site whose form posts itself to the UI's cancel API: the
// worker refuses it and the task stays as it was.
func TestRiverUIInABrowserShowsDeadLetters(t *testing.T) {
	t.Parallel()
	chromium := "/usr/bin/chromium" // Debian's chromium package; .ci/run installs it
	if _, err := os.Stat(chromium); err != nil {
		t.Fatalf("this test needs Chromium at %s (apt-get install -y chromium): %v", chromium, err)
	}
	db := pgtest.New(t)
	failing := httptest.NewServer(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		w.WriteHeader(http.StatusInternalServerError) // the task's own failure; a 503 would hold it as an outage
	}))
	t.Cleanup(failing.Close)
	const user, password = "ops", "browser-secret"
	env := []string{"APP_DATABASE_URL=" + db.URL, "APP_OUTBOX_ENABLED=false",
		"APP_UI_ENABLED=true", "APP_UI_USERNAME=" + user, "APP_UI_PASSWORD=" + password,
		writeConfig(t, fmt.Sprintf("tasks:\n  kinds:\n    - {name: sync-invoices, type: http, url: %s, max_attempts: 1}\n", failing.URL))}
	w := startWorker(t, env)
	w.waitReady(t, 15*time.Second)
	if _, err := db.Pool.Exec(context.Background(), `SELECT worker_enqueue('sync-invoices', '{"invoice": 7}')`); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 15*time.Second, "the task dead-lettered", func() bool {
		var n int
		_ = db.Pool.QueryRow(context.Background(), "SELECT count(*) FROM river_job WHERE state = 'discarded'").Scan(&n)
		return n == 1
	})

	alloc, cancelAlloc := chromedp.NewExecAllocator(context.Background(),
		chromedp.ExecPath(chromium),
		chromedp.Flag("headless", true),
		chromedp.Flag("no-sandbox", true),
		chromedp.Flag("disable-gpu", true),
		chromedp.Flag("disable-background-networking", true),
		chromedp.Flag("disable-component-update", true),
		chromedp.Flag("no-first-run", true),
		chromedp.UserDataDir(t.TempDir()),
		chromedp.WindowSize(1280, 800),
	)
	defer cancelAlloc()
	ctx, cancel := chromedp.NewContext(alloc)
	defer cancel()
	ctx, cancelTimeout := context.WithTimeout(ctx, 60*time.Second)
	defer cancelTimeout()

	// Answer the basic auth challenge the way a person does in the
	// browser's login dialog. The listener must not call the browser
	// itself; a goroutine answers.
	var challenges atomic.Int32
	paused := make(chan any, 256)
	if err := chromedp.Listen(ctx, func(ev any) {
		switch ev.(type) {
		case *fetch.EventAuthRequired, *fetch.EventRequestPaused:
			paused <- ev
		}
	}); err != nil {
		t.Fatal(err)
	}
	go func() {
		for {
			var ev any
			select {
			case <-ctx.Done():
				return
			case ev = <-paused:
			}
			switch e := ev.(type) {
			case *fetch.EventAuthRequired:
				challenges.Add(1)
				_, _ = chromedp.Call(ctx, fetch.ContinueWithAuth, fetch.ContinueWithAuthParams{RequestID: e.RequestID,
					AuthChallengeResponse: &fetch.AuthChallengeResponse{
						Response: fetch.AuthChallengeResponseResponseProvideCredentials, Username: user, Password: password}})
			case *fetch.EventRequestPaused:
				_, _ = chromedp.Call(ctx, fetch.ContinueRequest, fetch.ContinueRequestParams{RequestID: e.RequestID})
			}
		}
	}()
	handleAuth := true
	if _, err := chromedp.Call(ctx, fetch.Enable, fetch.EnableParams{HandleAuthRequests: &handleAuth}); err != nil {
		t.Fatal(err)
	}
	err := chromedp.Do(ctx,
		chromedp.Navigate("http://"+w.addr+"/riverui/jobs?state=discarded"),
		chromedp.WaitVisible(chromedp.Search(`//*[contains(text(), "sync-invoices")]`)),
	)
	if err != nil {
		t.Fatalf("browser: %v\nworker output:\n%s", err, w.out.String())
	}
	shot, err := chromedp.Run(ctx, chromedp.CaptureScreenshot())
	if err != nil {
		t.Fatal(err)
	}
	if challenges.Load() == 0 {
		t.Error("the UI was served without an auth challenge")
	}
	dir := t.TempDir()
	if os.Getenv(screenshotEnv) != "" {
		dir = "../../docs/images"
	}
	path := filepath.Join(dir, "river-ui-dead-letter.png")
	if err := os.WriteFile(path, shot, 0o644); err != nil {
		t.Fatal(err)
	}
	t.Logf("screenshot: %s", path)

	// The UI's own write: Retry on the task's page. River gives a task
	// without attempts left one more, so max_attempts shows the retry
	// whatever the run does next.
	var deadID int64
	if err := db.Pool.QueryRow(context.Background(), "SELECT id FROM river_job WHERE kind = 'sync-invoices'").Scan(&deadID); err != nil {
		t.Fatal(err)
	}
	err = chromedp.Do(ctx,
		chromedp.Navigate(fmt.Sprintf("http://%s/riverui/jobs/%d", w.addr, deadID)),
		chromedp.Click(`//button[contains(., "Retry")]`, chromedp.NodeEnabled),
	)
	if err != nil {
		t.Fatalf("retry from the UI: %v\nworker output:\n%s", err, w.out.String())
	}
	testkit.Eventually(t, 15*time.Second, "the retry from the UI to reach the task", func() bool {
		var maxAttempts int
		_ = db.Pool.QueryRow(context.Background(), "SELECT max_attempts FROM river_job WHERE id = $1", deadID).Scan(&maxAttempts)
		return maxAttempts == 2
	})
	testkit.Eventually(t, 5*time.Second, "the audit line of the UI's retry", func() bool {
		return hasAuditLine(w.out.String(), "jobs/retry", http.StatusOK)
	})

	// Another site's page posts a form to the cancel API while the browser
	// holds the UI's credentials. text/plain lets a form send JSON.
	var scheduledID int64
	if err := db.Pool.QueryRow(context.Background(), `INSERT INTO river_job (args, kind, max_attempts, queue, state, scheduled_at)
		VALUES ('{}', 'sync-invoices', 1, 'default', 'scheduled', now() + interval '1 day') RETURNING id`).Scan(&scheduledID); err != nil {
		t.Fatal(err)
	}
	evil := httptest.NewServer(http.HandlerFunc(func(rw http.ResponseWriter, _ *http.Request) {
		rw.Header().Set("Content-Type", "text/html; charset=utf-8")
		fmt.Fprintf(rw, `<form method="POST" action="http://%s/riverui/api/jobs/cancel" enctype="text/plain">
<input type="hidden" name='{"ids":["%d"],"x":"' value='"}'></form><script>document.forms[0].submit()</script>`, w.addr, scheduledID)
	}))
	t.Cleanup(evil.Close)
	// localhost against the worker's 127.0.0.1: another site, not just
	// another origin.
	evilURL := strings.Replace(evil.URL, "127.0.0.1", "localhost", 1)
	if err := chromedp.Do(ctx, chromedp.Navigate(evilURL)); err != nil {
		t.Fatal(err)
	}
	testkit.Eventually(t, 15*time.Second, "the cross-site post to reach the worker and be refused", func() bool {
		return hasAuditLine(w.out.String(), "jobs/cancel", http.StatusForbidden)
	})
	var state string
	if err := db.Pool.QueryRow(context.Background(), "SELECT state FROM river_job WHERE id = $1", scheduledID).Scan(&state); err != nil || state != "scheduled" {
		t.Errorf("after the cross-site post the task is %q (%v), want scheduled", state, err)
	}
	if hasAuditLine(w.out.String(), "jobs/cancel", http.StatusOK) {
		t.Error("a cross-site cancel was carried out")
	}
}

// hasAuditLine reports whether the worker logged River UI's action with
// this HTTP status.
func hasAuditLine(out, action string, status int) bool {
	for line := range strings.SplitSeq(out, "\n") {
		if strings.Contains(line, `"msg":"river UI action"`) && strings.Contains(line, `"action":"`+action+`"`) &&
			strings.Contains(line, fmt.Sprintf(`"status":%d`, status)) {
			return true
		}
	}
	return false
}
