package startup_test

import (
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

const uiUser, uiPassword = "ops", "guard-secret-41"

// startUIWorker runs a worker serving River UI and returns it with a task
// that waits a day, for the actions to act on.
func startUIWorker(t *testing.T, extraEnv ...string) (*proc, *pgtest.DB, int64) {
	t.Helper()
	db := pgtest.New(t)
	w := startWorker(t, append([]string{"APP_DATABASE_URL=" + db.URL, "APP_OUTBOX_ENABLED=false",
		"APP_UI_ENABLED=true", "APP_UI_USERNAME=" + uiUser, "APP_UI_PASSWORD=" + uiPassword}, extraEnv...))
	w.waitReady(t, 15*time.Second)
	var id int64
	if err := db.Pool.QueryRow(context.Background(), `INSERT INTO river_job (args, kind, max_attempts, queue, state, scheduled_at)
		VALUES ('{}', 'report', 3, 'default', 'scheduled', now() + interval '1 day') RETURNING id`).Scan(&id); err != nil {
		t.Fatal(err)
	}
	return w, db, id
}

// uiRequest is one request to the UI: from the loopback address from (or
// any), with basic auth unless pass is empty, and the given headers.
type uiRequest struct {
	method, url, body string
	from              string
	user, pass        string
	headers           map[string]string
}

func (r uiRequest) do(t *testing.T) (int, http.Header, string) {
	t.Helper()
	req, err := http.NewRequest(r.method, r.url, strings.NewReader(r.body))
	if err != nil {
		t.Fatal(err)
	}
	if r.pass != "" {
		req.SetBasicAuth(r.user, r.pass)
	}
	for k, v := range r.headers {
		req.Header.Set(k, v)
	}
	dialer := &net.Dialer{Timeout: 5 * time.Second}
	if r.from != "" {
		dialer.LocalAddr = &net.TCPAddr{IP: net.ParseIP(r.from)}
	}
	c := http.Client{Timeout: 10 * time.Second, Transport: &http.Transport{DialContext: dialer.DialContext, DisableKeepAlives: true}}
	resp, err := c.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, resp.Header, string(b)
}

func taskState(t *testing.T, db *pgtest.DB, id int64) string {
	t.Helper()
	var state string
	if err := db.Pool.QueryRow(context.Background(), "SELECT state FROM river_job WHERE id = $1", id).Scan(&state); err != nil {
		t.Fatal(err)
	}
	return state
}

// A write under /riverui/ from another site is refused, whatever its
// credentials; an API write without a JSON body type is refused unless
// the browser vouched for the UI's own page; every write, done or refused,
// logs one audit line naming the operator, the address, the action, the
// task ids and the outcome.
func TestRiverUIRefusesCrossSiteWritesAndAuditsThem(t *testing.T) {
	t.Parallel()
	w, db, id := startUIWorker(t)
	cancelURL := "http://" + w.addr + "/riverui/api/jobs/cancel"
	body := fmt.Sprintf(`{"ids":["%d"]}`, id)
	for _, c := range []struct {
		name    string
		headers map[string]string
		want    int
	}{
		{"cross-site by Sec-Fetch-Site", map[string]string{"Origin": "http://evil.example", "Sec-Fetch-Site": "cross-site", "Content-Type": "text/plain"}, http.StatusForbidden},
		{"same site, other origin", map[string]string{"Origin": "http://evil.example", "Sec-Fetch-Site": "same-site", "Content-Type": "application/json"}, http.StatusForbidden},
		{"cross-origin by Origin alone", map[string]string{"Origin": "http://evil.example", "Content-Type": "application/json"}, http.StatusForbidden},
		{"no JSON body type", map[string]string{"Content-Type": "text/plain"}, http.StatusUnsupportedMediaType},
		{"form body type", map[string]string{"Content-Type": "application/x-www-form-urlencoded"}, http.StatusUnsupportedMediaType},
	} {
		code, _, answer := uiRequest{method: http.MethodPost, url: cancelURL, body: body, user: uiUser, pass: uiPassword, headers: c.headers}.do(t)
		if code != c.want {
			t.Errorf("%s: %d %q, want %d", c.name, code, answer, c.want)
		}
		if state := taskState(t, db, id); state != "scheduled" {
			t.Fatalf("%s: the task is %s, want it untouched", c.name, state)
		}
	}
	// The UI's own page: the browser says same-origin; River UI posts its
	// JSON as text/plain.
	code, _, answer := uiRequest{method: http.MethodPost, url: cancelURL, body: body, user: uiUser, pass: uiPassword,
		headers: map[string]string{"Origin": "http://" + w.addr, "Sec-Fetch-Site": "same-origin", "Content-Type": "text/plain;charset=UTF-8"}}.do(t)
	if code != http.StatusOK || taskState(t, db, id) != "cancelled" {
		t.Fatalf("the UI's own cancel: %d %q, task %s; want 200 and cancelled", code, answer, taskState(t, db, id))
	}

	// A script with JSON and no browser headers, as curl sends it.
	code, _, answer = uiRequest{method: http.MethodPost, url: "http://" + w.addr + "/riverui/api/jobs/retry", body: body,
		user: uiUser, pass: uiPassword, headers: map[string]string{"Content-Type": "application/json"}}.do(t)
	if code != http.StatusOK || taskState(t, db, id) != "available" {
		t.Errorf("a script's retry: %d %q, task %s; want 200 and available", code, answer, taskState(t, db, id))
	}

	// The audit line is written once the handler returns, which can be
	// after the client has read the answer.
	testkit.Eventually(t, 5*time.Second, "the retry's audit line", func() bool {
		return strings.Contains(w.out.String(), `"action":"jobs/retry"`)
	})
	out := w.out.String()
	want := map[string]int{`"action":"jobs/cancel"` + `|403`: 3, `"action":"jobs/cancel"` + `|415`: 2, `"action":"jobs/cancel"` + `|200`: 1, `"action":"jobs/retry"` + `|200`: 1}
	got := map[string]int{}
	for line := range strings.SplitSeq(out, "\n") {
		if !strings.Contains(line, `"msg":"river UI action"`) {
			continue
		}
		for _, field := range []string{`"level":"INFO"`, `"operator":"ops"`, `"remote_addr":"127.0.0.1:`, fmt.Sprintf(`"task_ids":["%d"]`, id), `"outcome":`} {
			if !strings.Contains(line, field) {
				t.Errorf("audit line without %s: %s", field, line)
			}
		}
		for _, action := range []string{"jobs/cancel", "jobs/retry"} {
			for _, status := range []int{200, 403, 415} {
				if strings.Contains(line, `"action":"`+action+`"`) && strings.Contains(line, `"status":`+strconv.Itoa(status)) {
					got[`"action":"`+action+`"`+"|"+strconv.Itoa(status)]++
				}
			}
		}
	}
	for k, n := range want {
		if got[k] != n {
			t.Errorf("audit lines %s: %d, want %d\n%s", k, got[k], n, out)
		}
	}
}

// Wrong passwords from one address get a small burst, then 429 with
// Retry-After without being checked, then about one more a second; the
// right password from another address works meanwhile; the failures are
// logged, but not one line each.
func TestRiverUISlowsPasswordGuessing(t *testing.T) {
	t.Parallel()
	w, _, _ := startUIWorker(t)
	url := "http://" + w.addr + "/riverui/api/states"
	const guesses = 40
	checked, limited := 0, 0
	for i := range guesses {
		code, h, _ := uiRequest{method: http.MethodGet, url: url, from: "127.0.0.1", user: uiUser, pass: fmt.Sprintf("guess-%d", i)}.do(t)
		switch code {
		case http.StatusUnauthorized:
			checked++
		case http.StatusTooManyRequests:
			limited++
			if s, err := strconv.Atoi(h.Get("Retry-After")); err != nil || s < 1 {
				t.Errorf("429 with Retry-After %q, want whole seconds", h.Get("Retry-After"))
			}
		default:
			t.Fatalf("guess %d: %d", i, code)
		}
	}
	// The burst is 10, and one more a second: however slow this machine,
	// 40 quick guesses cannot all be checked.
	if checked < 5 || checked > 20 || limited == 0 {
		t.Errorf("%d of %d wrong passwords checked, %d answered 429; want a small burst, then 429", checked, guesses, limited)
	}
	// The right password, but from the guessing address: not checked.
	if code, _, _ := (uiRequest{method: http.MethodGet, url: url, from: "127.0.0.1", user: uiUser, pass: uiPassword}).do(t); code != http.StatusTooManyRequests {
		t.Errorf("the right password from the guessing address during the attack: %d, want 429", code)
	}
	// From another address the operator gets in at once.
	if code, _, _ := (uiRequest{method: http.MethodGet, url: url, from: "127.0.0.2", user: uiUser, pass: uiPassword}).do(t); code != http.StatusOK {
		t.Errorf("the right password from another address during the attack: %d, want 200", code)
	}
	// A request without credentials is the browser asking for the dialog,
	// not a guess: 401 with the challenge, even from the limited address.
	if code, h, _ := (uiRequest{method: http.MethodGet, url: url, from: "127.0.0.1"}).do(t); code != http.StatusUnauthorized || h.Get("WWW-Authenticate") == "" {
		t.Errorf("no credentials: %d, challenge %q; want 401 with a challenge", code, h.Get("WWW-Authenticate"))
	}
	// The limit refills: the guessing address is checked again.
	testkit.Eventually(t, 10*time.Second, "the guessing address to be checked again", func() bool {
		code, _, _ := uiRequest{method: http.MethodGet, url: url, from: "127.0.0.1", user: uiUser, pass: uiPassword}.do(t)
		return code == http.StatusOK
	})
	lines := strings.Count(w.out.String(), `"msg":"river UI login failed"`)
	if lines == 0 || lines > 3 {
		t.Errorf("%d log lines for %d failed logins; want a few, each counting the failures", lines, guesses)
	}
	if strings.Contains(w.out.String(), "guess-") {
		t.Error("a tried password reached the log")
	}
}

// With ui.addr the UI is served there and not on http.addr, which keeps
// /metrics and the probes.
func TestRiverUIOnItsOwnAddress(t *testing.T) {
	t.Parallel()
	uiAddr := freeAddr(t)
	w, _, _ := startUIWorker(t, "APP_UI_ADDR="+uiAddr)
	get := func(addr, path, pass string) int {
		code, _, _ := uiRequest{method: http.MethodGet, url: "http://" + addr + path, user: uiUser, pass: pass}.do(t)
		return code
	}
	if code := get(uiAddr, "/riverui/api/states", uiPassword); code != http.StatusOK {
		t.Errorf("UI on ui.addr with credentials: %d, want 200", code)
	}
	if code := get(uiAddr, "/riverui/api/states", ""); code != http.StatusUnauthorized {
		t.Errorf("UI on ui.addr without credentials: %d, want 401", code)
	}
	if code := get(w.addr, "/riverui/api/states", uiPassword); code != http.StatusNotFound {
		t.Errorf("UI on http.addr: %d, want 404", code)
	}
	for _, path := range []string{"/metrics", "/livez", "/readyz"} {
		if code := get(w.addr, path, ""); code != http.StatusOK {
			t.Errorf("%s on http.addr: %d, want 200", path, code)
		}
		if code := get(uiAddr, path, ""); code != http.StatusNotFound {
			t.Errorf("%s on ui.addr: %d, want 404", path, code)
		}
	}
}
