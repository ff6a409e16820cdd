package main

import (
	"errors"
	"fmt"
	"net"
	"net/http"
	"sync"
	"time"
)

// receiver is the local webhook endpoint: it notes when each request
// arrives and the event's ce-time, and answers 204, after a delay when
// armed with one (the slow webhook).
type receiver struct {
	url string
	srv *http.Server

	mu       sync.Mutex
	delay    time.Duration
	arrivals []time.Time
	lat      []float64 // ms, arrival minus ce-time
	more     chan struct{}
}

func startReceiver() (*receiver, error) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	r := &receiver{url: "http://" + l.Addr().String() + "/events", more: make(chan struct{}, 1)}
	r.srv = &http.Server{Handler: r, ReadHeaderTimeout: 10 * time.Second}
	go r.srv.Serve(l) //nolint:errcheck // ends with close
	return r, nil
}

func (r *receiver) close() { _ = r.srv.Close() }

func (r *receiver) ServeHTTP(w http.ResponseWriter, req *http.Request) {
	now := time.Now()
	r.mu.Lock()
	delay := r.delay
	r.mu.Unlock()
	if delay > 0 {
		time.Sleep(delay)
		now = time.Now()
	}
	var lat float64
	if t, err := time.Parse(time.RFC3339Nano, req.Header.Get("Ce-Time")); err == nil {
		lat = float64(now.Sub(t)) / float64(time.Millisecond)
	}
	r.mu.Lock()
	r.arrivals = append(r.arrivals, now)
	r.lat = append(r.lat, lat)
	r.mu.Unlock()
	select {
	case r.more <- struct{}{}:
	default:
	}
	w.WriteHeader(http.StatusNoContent)
}

// arm forgets what arrived and sets the answer delay for the next phase.
func (r *receiver) arm(delay time.Duration) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.delay, r.arrivals, r.lat = delay, nil, nil
}

// wait returns the arrival times, in order, once n requests arrived.
func (r *receiver) wait(n int, within time.Duration) ([]time.Time, error) {
	deadline := time.Now().Add(within)
	for {
		r.mu.Lock()
		got := len(r.arrivals)
		r.mu.Unlock()
		if got >= n {
			break
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("%d of %d events arrived at the webhook in %s", got, n, within)
		}
		select {
		case <-r.more:
		case <-time.After(100 * time.Millisecond):
		}
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	out := append([]time.Time(nil), r.arrivals...)
	if len(out) == 0 {
		return nil, errors.New("nothing arrived")
	}
	sortTimes(out)
	return out, nil
}

func (r *receiver) latencies() []float64 {
	r.mu.Lock()
	defer r.mu.Unlock()
	return append([]float64(nil), r.lat...)
}
