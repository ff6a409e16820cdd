package startup_test

import (
	"bufio"
	"encoding/base64"
	"fmt"
	"net"
	"net/http"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/pgtest"
	"github.com/worker-dev/worker/internal/testkit"
)

// A slow-request attack on the webhook receiver, through the worker: 100
// connections trickle their bodies and 100 their heads, a byte a second,
// more than three times the 64 in-flight slots. A signed sender beside
// them has every request answered 200 within 2s, since a request takes a
// slot only once its body has arrived. The slow ones are cut off (the
// bodies with 408), counted by reason in inbox_webhook_refused_total, and
// logged at a bounded rate with error.code.
func TestInboxWebhookSlowSenders(t *testing.T) {
	t.Parallel()
	pgtest.Need(t, inboxWorkerConns+1+pgtest.PoolConns)
	db := pgtest.New(t)
	ctx := t.Context()
	if _, err := db.Pool.Exec(ctx, `CREATE TABLE applied (event_id text NOT NULL)`); err != nil {
		t.Fatal(err)
	}
	key := []byte("a-receiver-secret-of-32-bytes!!!")
	addr := freeAddr(t)
	cfg := writeConfig(t, fmt.Sprintf(`outbox: {enabled: false}
inbox:
  sources:
    - name: partner
      kind: webhook
      webhook: {addr: %q, path: /hooks, secret: whsec_%s}
      handler:
        kind: sql
        sql: INSERT INTO applied (event_id) VALUES (@id)
`, addr, base64.StdEncoding.EncodeToString(key)))
	p := startWorker(t, append([]string{"APP_DATABASE_URL=" + db.URL, cfg}, inboxWorker...))
	p.waitReady(t, 30*time.Second)

	const slowBodies, slowHeads = 100, 100
	stop := make(chan struct{})
	var wg sync.WaitGroup
	var mu sync.Mutex
	answers := map[string]int{}
	var opened sync.WaitGroup
	opened.Add(slowBodies + slowHeads)
	slow := func(head, rest string) {
		defer wg.Done()
		status := trickleRequest(addr, head, rest, stop, opened.Done)
		mu.Lock()
		answers[status]++
		mu.Unlock()
	}
	for i := range slowBodies {
		wg.Add(1)
		go slow(fmt.Sprintf("POST /hooks HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 4096\r\nWebhook-Id: slow-%d\r\n\r\n", i), `{"pad":"xxxx"}`)
	}
	for range slowHeads {
		wg.Add(1)
		go slow("POST /hooks HTTP/1.1\r\n", "X-Slow: y\r\n")
	}
	defer func() { close(stop); wg.Wait() }()
	opened.Wait()

	send := func(id string) (int, time.Duration) {
		body := fmt.Appendf(nil, `{"id": %q}`, id)
		req := signedWebhookRequest(ctx, "http://"+addr+"/hooks", id, body, key)
		began := time.Now()
		resp, err := http.DefaultClient.Do(req)
		if err != nil {
			t.Fatalf("a signed request: %v", err)
		}
		resp.Body.Close()
		return resp.StatusCode, time.Since(began)
	}
	// Requests spread over the slow senders' lifetime (cut off after 5s).
	var slowest time.Duration
	for i := range 30 {
		code, took := send(fmt.Sprintf("legit-%d", i))
		slowest = max(slowest, took)
		if code != http.StatusOK || took > 2*time.Second {
			t.Errorf("request %d beside %d slow senders: %d after %s; want 200 within 2s", i, slowBodies+slowHeads, code, took.Round(time.Millisecond))
		}
		time.Sleep(200 * time.Millisecond) // a sender's pace, not a wait for the server
	}
	t.Logf("30 signed requests beside %d slow senders: the slowest answered in %s", slowBodies+slowHeads, slowest.Round(time.Millisecond))
	var n int
	if err := db.Pool.QueryRow(ctx, `SELECT count(DISTINCT event_id) FROM applied`).Scan(&n); err != nil || n != 30 {
		t.Fatalf("%d signed requests applied (%v), want 30", n, err)
	}

	refused := regexp.MustCompile(`inbox_webhook_refused_total\{reason="(slow_body|slow_header)",source="partner"\} (\d+)`)
	counts := map[string]int{}
	testkit.Eventually(t, 20*time.Second, "every slow sender cut off and counted", func() bool {
		_, body := p.get("/metrics")
		for _, m := range refused.FindAllStringSubmatch(body, -1) {
			counts[m[1]], _ = strconv.Atoi(m[2])
		}
		return counts["slow_body"] == slowBodies && counts["slow_header"] == slowHeads
	})
	close(stop)
	wg.Wait()
	stop = make(chan struct{}) // for the deferred close
	if answers["HTTP/1.1 408 Request Timeout"] < slowBodies/2 {
		t.Errorf("answers to the slow senders: %v; want 408 for the slow bodies", answers)
	}
	var lines int
	for _, l := range p.out.Lines(t, "inbox webhook request refused") {
		lines++
		if l["error.code"] != "INBOX_WEBHOOK_REFUSED" {
			t.Errorf("a refusal logged without its error.code: %v", l)
		}
	}
	t.Logf("%d refusals (slow_body %d, slow_header %d) made %d log lines", slowBodies+slowHeads, counts["slow_body"], counts["slow_header"], lines)
	if lines == 0 || lines > 40 {
		t.Errorf("%d log lines for %d refusals within seconds, want some, and no more than a burst and one a second", lines, slowBodies+slowHeads)
	}
}

// trickleRequest opens a connection to addr, writes head, calls opened,
// then writes one byte of rest a second until the server answers or closes
// the connection, or stop is closed. It returns the status line, if any.
func trickleRequest(addr, head, rest string, stop <-chan struct{}, opened func()) string {
	c, err := net.Dial("tcp", addr)
	if err != nil {
		opened()
		return "dial error"
	}
	defer c.Close()
	_, err = c.Write([]byte(head))
	opened()
	if err != nil {
		return ""
	}
	answered := make(chan string, 1)
	go func() {
		line, _ := bufio.NewReader(c).ReadString('\n')
		answered <- strings.TrimSpace(line)
	}()
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for i := 0; ; i++ {
		select {
		case line := <-answered:
			return line
		case <-stop:
			return "still open"
		case <-tick.C:
		}
		if _, err := c.Write([]byte{rest[i%len(rest)]}); err != nil {
			select {
			case line := <-answered:
				return line
			case <-time.After(time.Second):
				return ""
			}
		}
	}
}
