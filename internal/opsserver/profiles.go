package opsserver

import (
	"fmt"
	"net/http"
	"runtime/pprof"
	"strconv"
	"time"
)

// serveProfiles serves Go's profiles under /debug/pprof/ (http.pprof).
// net/http/pprof would do it, but importing it registers the same handlers
// on http.DefaultServeMux, which a program embedding the worker may serve
// to the world.
func serveProfiles(mux *http.ServeMux) {
	mux.HandleFunc("GET /debug/pprof/{$}", func(w http.ResponseWriter, _ *http.Request) {
		w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		fmt.Fprintln(w, "profile?seconds=N (CPU)")
		for _, p := range pprof.Profiles() {
			fmt.Fprintf(w, "%s (%d)\n", p.Name(), p.Count())
		}
	})
	mux.HandleFunc("GET /debug/pprof/profile", cpuProfile)
	mux.HandleFunc("GET /debug/pprof/{name}", func(w http.ResponseWriter, r *http.Request) {
		p := pprof.Lookup(r.PathValue("name"))
		if p == nil {
			http.NotFound(w, r)
			return
		}
		debug, _ := strconv.Atoi(r.FormValue("debug"))
		if debug > 0 {
			w.Header().Set("Content-Type", "text/plain; charset=utf-8")
		} else {
			w.Header().Set("Content-Type", "application/octet-stream")
		}
		_ = p.WriteTo(w, debug)
	})
}

// cpuProfile profiles the CPU for ?seconds (30 by default) and sends the
// gzipped protocol buffer go tool pprof reads. The answer may take longer
// than the ops server's write bound: the deadline is moved by the
// profile's length.
func cpuProfile(w http.ResponseWriter, r *http.Request) {
	seconds, err := strconv.Atoi(r.FormValue("seconds"))
	if err != nil || seconds <= 0 {
		seconds = 30
	}
	d := time.Duration(seconds) * time.Second
	_ = http.NewResponseController(w).SetWriteDeadline(time.Now().Add(opsWriteTimeout + d))
	w.Header().Set("Content-Type", "application/octet-stream")
	if err := pprof.StartCPUProfile(w); err != nil {
		http.Error(w, "cannot profile the CPU: "+err.Error(), http.StatusInternalServerError)
		return
	}
	select {
	case <-time.After(d):
	case <-r.Context().Done():
	}
	pprof.StopCPUProfile()
}
