package load

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/sha256"
	"encoding/base64"
	"fmt"
	"net/http"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/jackc/pgx/v5/pgxpool"
)

// Sender posts signed webhook deliveries to the replicas' inboxes in turn,
// perSecond a second, each until one answers 200 (after its work
// committed): a replica whose database is away answers an error, and the
// delivery goes to the next one, as a partner's retries would.
type Sender struct {
	sent atomic.Int64
	stop context.CancelFunc
	done chan struct{}
}

// StartSender starts posting to urls with secret (raw bytes) until Stop.
func StartSender(urls []string, secret []byte, perSecond int) *Sender {
	ctx, stop := context.WithCancel(context.Background())
	s := &Sender{stop: stop, done: make(chan struct{})}
	go func() {
		defer close(s.done)
		c := &http.Client{Timeout: 5 * time.Second}
		pace := time.NewTicker(time.Second / time.Duration(perSecond))
		defer pace.Stop()
		for k := 0; ; k++ {
			id := fmt.Sprintf("in-%d", k)
			body := fmt.Appendf(nil, `{"k":%d}`, k)
			for try := k; ; try++ {
				if post(ctx, c, urls[try%len(urls)], id, body, secret) {
					break
				}
				if !sleep(ctx, 100*time.Millisecond) {
					return
				}
			}
			s.sent.Store(int64(k + 1))
			select {
			case <-ctx.Done():
				return
			case <-pace.C:
			}
		}
	}()
	return s
}

// post sends one delivery signed as Standard Webhooks asks and reports
// whether it was taken (200).
func post(ctx context.Context, c *http.Client, url, id string, body, secret []byte) bool {
	ts := strconv.FormatInt(time.Now().Unix(), 10)
	mac := hmac.New(sha256.New, secret)
	mac.Write([]byte(id + "." + ts + "."))
	mac.Write(body)
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return false
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("webhook-id", id)
	req.Header.Set("webhook-timestamp", ts)
	req.Header.Set("webhook-signature", "v1,"+base64.StdEncoding.EncodeToString(mac.Sum(nil)))
	resp, err := c.Do(req)
	if err != nil {
		return false
	}
	resp.Body.Close()
	return resp.StatusCode == http.StatusOK
}

// Sent is how many deliveries were taken.
func (s *Sender) Sent() int { return int(s.sent.Load()) }

// Stop stops posting and returns how many deliveries were taken.
func (s *Sender) Stop() int {
	s.stop()
	<-s.done
	return s.Sent()
}

// Enqueuer enqueues sql tasks perSecond a second, each with its number n,
// marked in load_task_sent in the same statement so that a retry after an
// unknown outcome does not enqueue it again.
type Enqueuer struct {
	sent atomic.Int64
	stop context.CancelFunc
	done chan struct{}
}

func StartEnqueuer(pool *pgxpool.Pool, perSecond int) *Enqueuer {
	ctx, stop := context.WithCancel(context.Background())
	e := &Enqueuer{stop: stop, done: make(chan struct{})}
	go func() {
		defer close(e.done)
		pace := time.NewTicker(time.Second / time.Duration(perSecond))
		defer pace.Stop()
		for n := int64(0); ; n++ {
			err := retry(ctx, func() error {
				_, err := pool.Exec(ctx, `WITH s AS (INSERT INTO load_task_sent VALUES ($1) ON CONFLICT DO NOTHING RETURNING n)
					SELECT worker_enqueue($2, jsonb_build_object('n', n)) FROM s`, n, TaskKind)
				return err
			}, func() (bool, error) {
				return exists(ctx, pool, `SELECT EXISTS (SELECT 1 FROM load_task_sent WHERE n = $1)`, n)
			})
			if err != nil {
				return
			}
			e.sent.Store(n + 1)
			select {
			case <-ctx.Done():
				return
			case <-pace.C:
			}
		}
	}()
	return e
}

func (e *Enqueuer) Sent() int { return int(e.sent.Load()) }

func (e *Enqueuer) Stop() int {
	e.stop()
	<-e.done
	return e.Sent()
}
