package startup_test

import (
	"context"
	"encoding/hex"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	coltracepb "go.opentelemetry.io/proto/otlp/collector/trace/v1"
	tracepb "go.opentelemetry.io/proto/otlp/trace/v1"
	"google.golang.org/grpc"
	"google.golang.org/protobuf/proto"
)

// otlpReceiver is an OTLP trace receiver for tests: OTLP/HTTP with
// protobuf bodies on /v1/traces, and OTLP/gRPC, decoded with the
// protocol's published Go types. It keeps every span it is sent and
// counts the connections made to it.
type otlpReceiver struct {
	httpURL  string // for OTEL_EXPORTER_OTLP_ENDPOINT with http/protobuf
	grpcURL  string // for OTEL_EXPORTER_OTLP_ENDPOINT with grpc
	conns    atomic.Int64
	mu       sync.Mutex
	spans    []*tracepb.Span
	services map[string]bool // service.name of every resource sent
}

func startOTLPReceiver(t *testing.T) *otlpReceiver {
	t.Helper()
	r := &otlpReceiver{services: map[string]bool{}}
	hs := httptest.NewUnstartedServer(http.HandlerFunc(r.serveHTTP))
	hs.Config.ConnState = func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			r.conns.Add(1)
		}
	}
	hs.Start()
	t.Cleanup(hs.Close)
	r.httpURL = hs.URL

	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	coltracepb.RegisterTraceServiceServer(gs, grpcTraces{r: r})
	go func() { _ = gs.Serve(countingListener{ln, &r.conns}) }()
	t.Cleanup(gs.Stop)
	r.grpcURL = "http://" + ln.Addr().String()
	return r
}

func (r *otlpReceiver) serveHTTP(w http.ResponseWriter, req *http.Request) {
	if req.URL.Path != "/v1/traces" || req.Header.Get("Content-Type") != "application/x-protobuf" {
		http.Error(w, "want a protobuf POST to /v1/traces", http.StatusBadRequest)
		return
	}
	body, err := io.ReadAll(req.Body)
	if err != nil {
		return
	}
	var msg coltracepb.ExportTraceServiceRequest
	if err := proto.Unmarshal(body, &msg); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	r.add(&msg)
	out, _ := proto.Marshal(&coltracepb.ExportTraceServiceResponse{})
	w.Header().Set("Content-Type", "application/x-protobuf")
	_, _ = w.Write(out)
}

type grpcTraces struct {
	coltracepb.UnimplementedTraceServiceServer
	r *otlpReceiver
}

func (g grpcTraces) Export(_ context.Context, req *coltracepb.ExportTraceServiceRequest) (*coltracepb.ExportTraceServiceResponse, error) {
	g.r.add(req)
	return &coltracepb.ExportTraceServiceResponse{}, nil
}

type countingListener struct {
	net.Listener
	n *atomic.Int64
}

func (l countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		l.n.Add(1)
	}
	return c, err
}

func (r *otlpReceiver) add(req *coltracepb.ExportTraceServiceRequest) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, rs := range req.GetResourceSpans() {
		for _, a := range rs.GetResource().GetAttributes() {
			if a.GetKey() == "service.name" {
				r.services[a.GetValue().GetStringValue()] = true
			}
		}
		for _, ss := range rs.GetScopeSpans() {
			r.spans = append(r.spans, ss.GetSpans()...)
		}
	}
}

// waitSpan returns the first span match accepts, failing the test if
// none arrives within limit.
func (r *otlpReceiver) waitSpan(t *testing.T, what string, limit time.Duration, match func(*tracepb.Span) bool) *tracepb.Span {
	t.Helper()
	deadline := time.Now().Add(limit)
	for {
		r.mu.Lock()
		for _, s := range r.spans {
			if match(s) {
				r.mu.Unlock()
				return s
			}
		}
		n := len(r.spans)
		r.mu.Unlock()
		if time.Now().After(deadline) {
			t.Fatalf("no %s span arrived within %s (%d spans did: %s)", what, limit, n, r.names())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func (r *otlpReceiver) names() []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for _, s := range r.spans {
		out = append(out, s.GetName()+"("+hex.EncodeToString(s.GetTraceId())[:8]+")")
	}
	return out
}
