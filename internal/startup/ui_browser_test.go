package startup_test

import (
	"context"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"github.com/chromedp/cdproto/fetch"
	"github.com/chromedp/chromedp"

	"worker/internal/pgtest"
	"worker/internal/testkit"
)

// screenshotEnv asks the browser test to write its screenshot to
// docs/images (for the docs) instead of a temporary directory.
const screenshotEnv = "WORKER_UPDATE_SCREENSHOTS"

// A real browser (headless Chromium) logs in to River UI through the basic
// auth challenge, opens the job list and finds a dead-lettered task by its
// kind.
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
}
