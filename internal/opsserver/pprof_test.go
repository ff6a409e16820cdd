package opsserver

import (
	"bytes"
	"compress/gzip"
	"io"
	"net/http"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
)

// Go's profiles are served only when asked for.
func TestProfilesOnlyWhenAsked(t *testing.T) {
	t.Parallel()
	get := func(t *testing.T, profiling bool, path string) (int, []byte) {
		t.Helper()
		srv := New("127.0.0.1:0", prometheus.NewRegistry(), &Readiness{}, nil, profiling)
		ln, err := srv.Listen()
		if err != nil {
			t.Fatal(err)
		}
		go srv.Serve(ln)
		t.Cleanup(func() { srv.Close() })
		resp, err := http.Get("http://" + ln.Addr().String() + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatal(err)
		}
		return resp.StatusCode, body
	}

	for _, path := range []string{"/debug/pprof/", "/debug/pprof/heap", "/debug/pprof/profile?seconds=1"} {
		if code, _ := get(t, false, path); code != http.StatusNotFound {
			t.Errorf("off: GET %s = %d, want 404", path, code)
		}
	}
	if code, body := get(t, true, "/debug/pprof/goroutine?debug=1"); code != http.StatusOK || !strings.Contains(string(body), "goroutine profile:") {
		t.Errorf("on: goroutine profile = %d %.80q", code, body)
	}
	// A CPU profile is a gzipped protocol buffer.
	code, body := get(t, true, "/debug/pprof/profile?seconds=1")
	if code != http.StatusOK {
		t.Fatalf("on: CPU profile = %d %.200q", code, body)
	}
	if _, err := gzip.NewReader(bytes.NewReader(body)); err != nil {
		t.Errorf("on: CPU profile is not gzipped: %v", err)
	}
}
