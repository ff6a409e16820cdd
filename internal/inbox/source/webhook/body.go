package webhook

import (
	"errors"
	"io"
	"net/http"
	"os"
	"sync"
	"time"
)

// Body limits. A request takes an in-flight slot only once its body has
// arrived, so a sender that trickles its body holds a connection and a
// goroutine, never a slot; these bound how long it may do so.
const (
	// bodyGrace is how long any body may take, however small.
	bodyGrace = 5 * time.Second
	// minBodyRate is the pace a body must keep past bodyGrace, in bytes
	// per second: each byte received earns 1/minBodyRate more time. A
	// 1 MiB body may take 5s + 64s; one byte a second is cut off at 5s.
	minBodyRate = 16 << 10
	// firstChunk is the buffer a body starts with; it doubles as the
	// body arrives, each growth taken from the body budget first.
	firstChunk = 4 << 10
)

// Reasons a body was not read whole; each is a refusal reason.
var (
	errSlowBody   = errors.New("the body arrived slower than the receiver's minimum rate")
	errTooLarge   = errors.New("the body is larger than the receiver takes")
	errBodyBudget = errors.New("the receiver holds as many request bodies as it can")
	errBadBody    = errors.New("the body could not be read")
)

// budget bounds the bytes of the request bodies held at once, read or
// being read: the memory a flood of fast, large bodies may take, now that
// the in-flight cap no longer bounds the bodies being read. Memory is
// taken as a buffer grows, so a sender holds only what it has sent.
type budget struct {
	mu   sync.Mutex
	left int64
}

func newBudget(n int64) *budget { return &budget{left: n} }

// take reserves n bytes, or reports that they are not there.
func (b *budget) take(n int64) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if n > b.left {
		return false
	}
	b.left -= n
	return true
}

func (b *budget) give(n int64) {
	b.mu.Lock()
	b.left += n
	b.mu.Unlock()
}

// readBody reads r's body whole under the read deadline that the body's
// progress earns: start + grace + received/rate. It returns the body and
// the bytes of budget it holds (to give back once the request is done),
// or one of the errors above.
//
// A body not read whole leaves the connection unusable: the answer to it
// says Connection: close, or the server would read the rest of the body
// at the sender's pace before answering.
func (s *Source) readBody(w http.ResponseWriter, r *http.Request) (body []byte, held int64, err error) {
	rc := http.NewResponseController(w)
	defer func() {
		if err != nil {
			w.Header().Set("Connection", "close")
			return
		}
		// The deadline must not outlive the body: the server's
		// background read, which watches for the sender leaving while the
		// work runs, would take it for a broken connection.
		_ = rc.SetReadDeadline(time.Time{})
	}()
	start := time.Now()
	in := http.MaxBytesReader(w, r.Body, s.cfg.MaxBody)
	buf := make([]byte, 0)
	for {
		if len(buf) == cap(buf) {
			grow := int64(max(cap(buf), firstChunk))
			grow = min(grow, s.cfg.MaxBody+1-int64(cap(buf)))
			if !s.bodies.take(grow) {
				return nil, held, errBodyBudget
			}
			held += grow
			next := make([]byte, len(buf), int64(cap(buf))+grow)
			copy(next, buf)
			buf = next
		}
		earned := time.Duration(float64(len(buf)) / float64(s.minBodyRate) * float64(time.Second))
		// An error means the connection cannot take deadlines (HTTP/2
		// over a proxy); the server's own timeouts still bound it.
		_ = rc.SetReadDeadline(start.Add(s.bodyGrace + earned))
		n, err := in.Read(buf[len(buf):cap(buf)])
		buf = buf[:len(buf)+n]
		var tooLarge *http.MaxBytesError
		switch {
		case err == nil:
		case errors.Is(err, io.EOF):
			return buf, held, nil
		case errors.As(err, &tooLarge):
			return nil, held, errTooLarge
		case errors.Is(err, os.ErrDeadlineExceeded):
			return nil, held, errSlowBody
		default:
			return nil, held, errBadBody
		}
	}
}
