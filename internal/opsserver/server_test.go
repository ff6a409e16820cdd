package opsserver

import (
	"net/http"
	"net/http/httptest"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/pgtest"
)

// A /readyz flood costs the database at most one ping a second, on the
// probe's own one-connection pool: the worker's pool, which the relay and
// jobs use, is not touched.
func TestReadyzPingsAtMostOnceASecond(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	probe, err := NewProbePool(db.Pool, "test")
	if err != nil {
		t.Fatal(err)
	}
	defer probe.Close()
	ready := &Readiness{}
	ready.db.Store(probe)
	ready.started.Store(true)
	srv := httptest.NewServer(New("", prometheus.NewRegistry(), ready, nil, false).Handler)
	defer srv.Close()
	get := func() int {
		resp, err := srv.Client().Get(srv.URL + "/readyz")
		if err != nil {
			t.Error(err)
			return 0
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	if code := get(); code != http.StatusOK { // the first check also reads the migrations
		t.Fatalf("/readyz = %d, want 200", code)
	}
	workerAcquires, probeAcquires := db.Pool.Stat().AcquireCount(), probe.Stat().AcquireCount()

	start := time.Now()
	var wg sync.WaitGroup
	for range 20 {
		wg.Go(func() {
			for range 100 {
				if code := get(); code != http.StatusOK {
					t.Errorf("/readyz = %d during the flood, want 200", code)
					return
				}
			}
		})
	}
	wg.Wait()
	elapsed := time.Since(start)

	pings := probe.Stat().AcquireCount() - probeAcquires
	if most := int64(elapsed/readyCheckEvery) + 1; pings > most {
		t.Errorf("2,000 probes in %s pinged the database %d times, want at most %d (one a second)", elapsed, pings, most)
	}
	if n := db.Pool.Stat().AcquireCount() - workerAcquires; n != 0 {
		t.Errorf("the probes took %d connections from the worker's pool, want none", n)
	}
	if n := probe.Stat().MaxConns(); n != 1 {
		t.Errorf("the probe pool allows %d connections, want 1", n)
	}
}
