package webhook

import (
	"bufio"
	"fmt"
	"net"
	"net/http"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/worker-dev/worker/internal/testkit"
)

// trickle opens a connection to addr, writes head at once, then one byte
// of rest a second until the server closes the connection or stop is
// closed. It returns the status line the server answered, if any.
func trickle(addr, head, rest string, stop <-chan struct{}) (status string) {
	c, err := net.Dial("tcp", addr)
	if err != nil {
		return "dial: " + err.Error()
	}
	defer c.Close()
	if _, err := c.Write([]byte(head)); err != nil {
		return ""
	}
	answered := make(chan string, 1)
	go func() {
		line, _ := bufio.NewReader(c).ReadString('\n')
		answered <- strings.TrimSpace(line)
	}()
	t := time.NewTicker(time.Second)
	defer t.Stop()
	for i := 0; ; i++ {
		select {
		case line := <-answered:
			return line
		case <-stop:
			return ""
		case <-t.C:
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

// Senders that trickle their heads or bodies at a byte a second hold no
// in-flight slot: with twice as many of them as slots, a signed sender's
// requests are answered 200, each within 2s. The slow bodies are cut off
// with 408 once their grace is spent, the slow heads closed after
// readHeaderTimeout; both are counted and logged at a bounded rate.
func TestSlowSendersHoldNoSlot(t *testing.T) {
	t.Parallel()
	const slots, slow = 4, 40
	f := newFixture(t, func(s *setup) { s.opts.MaxInFlight = slots })
	f.src.bodyGrace = 2 * time.Second
	f.start(t)
	addr := f.src.Addr()
	stop := make(chan struct{})
	var wg sync.WaitGroup
	statuses := make(chan string, 2*slow)
	for i := range slow {
		bodyHead := fmt.Sprintf("POST /inbox HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\nWebhook-Id: slow-%d\r\n\r\n", i)
		wg.Go(func() { statuses <- "body " + trickle(addr, bodyHead, `{"pad":"xxxxxxxx"}`, stop) })
		wg.Go(func() { statuses <- "head " + trickle(addr, "POST /inbox HTTP/1.1\r\n", "X-Slow: y\r\n", stop) })
	}
	defer func() { close(stop); wg.Wait() }()
	// The trickling connections are all open and in the server.
	testkit.Eventually(t, 10*time.Second, "the slow connections to start", func() bool {
		f.src.refused.mu.Lock()
		defer f.src.refused.mu.Unlock()
		return len(f.src.refused.heads) >= slow
	})

	for i := range 3 * slots {
		body := fmt.Appendf(nil, `{"n": %d}`, i)
		id := fmt.Sprintf("legit-%d", i)
		began := time.Now()
		a := post(t, f.url, signed(f.key, id, time.Now(), body), body)
		if took := time.Since(began); a.code != http.StatusOK || took > 2*time.Second {
			t.Errorf("request %d beside %d slow senders: %d %+v after %s; want 200 within 2s", i, 2*slow, a.code, a.body, took.Round(time.Millisecond))
		}
	}
	if n := f.count(t, `SELECT count(*) FROM work`); n != 3*slots {
		t.Errorf("%d pieces of work, want %d", n, 3*slots)
	}

	// The slow ones are cut off: bodies after their grace, heads after
	// readHeaderTimeout.
	testkit.Eventually(t, 20*time.Second, "every slow sender cut off", func() bool {
		return f.refusedCount(t, reasonSlowBody) == slow && f.refusedCount(t, reasonSlowHeader) == slow
	})
	close(stop)
	wg.Wait()
	stop = make(chan struct{}) // for the deferred close
	close(statuses)
	for s := range statuses {
		if strings.HasPrefix(s, "body ") && s != "body HTTP/1.1 408 Request Timeout" {
			t.Errorf("a slow body was answered %q, want 408", s)
		}
		if strings.HasPrefix(s, "head ") && s != "head " && s != "head HTTP/1.1 400 Bad Request" {
			t.Errorf("a slow head was answered %q, want the connection closed, or 400", s)
		}
	}
	lines := f.logs.Lines(t, "inbox webhook request refused")
	if len(lines) == 0 || len(lines) > refusedLogBurst+30 {
		t.Errorf("%d log lines for %d refusals, want at least one and at most a burst and one a second", len(lines), 2*slow)
	}
	for _, l := range lines {
		if l["error.code"] != "INBOX_WEBHOOK_REFUSED" || (l["reason"] != reasonSlowBody && l["reason"] != reasonSlowHeader) {
			t.Errorf("log line %v: want error.code INBOX_WEBHOOK_REFUSED and a slow_* reason", l)
		}
	}
}

// A body that keeps the minimum rate is read whole however long it takes,
// past the grace: the deadline grows with what arrives.
func TestBodyAtTheMinimumRateIsRead(t *testing.T) {
	t.Parallel()
	f := newFixture(t)
	f.src.bodyGrace, f.src.minBodyRate = 500*time.Millisecond, 200
	f.start(t)
	body := []byte(`{"pad": "` + strings.Repeat("x", 400) + `"}`)
	h := signed(f.key, "steady", time.Now(), body)
	pr, pw := net.Pipe()
	go func() {
		// 100 bytes every 250ms: 400 bytes/s, twice the minimum, over 1s.
		for i := 0; i < len(body); i += 100 {
			_, _ = pw.Write(body[i:min(i+100, len(body))])
			time.Sleep(250 * time.Millisecond)
		}
		pw.Close()
	}()
	req, err := http.NewRequest(http.MethodPost, f.url, pr)
	if err != nil {
		t.Fatal(err)
	}
	req.Header, req.ContentLength = h, int64(len(body))
	if a := do(t, req); a.code != http.StatusOK {
		t.Errorf("a body at twice the minimum rate, past its grace: %+v, want 200", a)
	}
}
