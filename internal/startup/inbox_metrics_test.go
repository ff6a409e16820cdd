package startup_test

import (
	"bytes"
	"log/slog"
	"maps"
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/common/expfmt"

	"github.com/worker-dev/worker/internal/inbox"
)

// withInboxSeries adds the inbox's series to what a worker exported, when
// it exported none of them: they exist only with a source configured, and
// no source kind is built into this binary yet to configure one. They are
// then taken from the inbox package's own registrations, as a replica with
// one source (named orders) serves them before its first message, so the
// docs and deploy/ are still held to the real names and labels. Once a
// source kind is built in, give the tests' worker a source instead, and
// this adds nothing.
func withInboxSeries(t *testing.T, have exported, families map[string][]string) (exported, map[string][]string) {
	t.Helper()
	for name := range families {
		if strings.HasPrefix(name, "inbox_") {
			return have, families
		}
	}
	reg := prometheus.NewRegistry()
	m, err := inbox.NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	inbox.NewConsumer(nil, inbox.SourceConfig{Name: "orders", Kind: inbox.KindNATS}, inbox.DefaultConfig(), nil, "test",
		slog.New(slog.DiscardHandler), m)
	gathered, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var body bytes.Buffer
	enc := expfmt.NewEncoder(&body, expfmt.NewFormat(expfmt.TypeTextPlain))
	for _, mf := range gathered {
		if strings.HasPrefix(mf.GetName(), "inbox_") {
			if err := enc.Encode(mf); err != nil {
				t.Fatal(err)
			}
		}
	}
	series, fams := parseMetrics(t, body.String())
	if len(fams) < 8 {
		t.Fatalf("the inbox package registers %d inbox_ families; expected its 8", len(fams))
	}
	outSeries, outFams := maps.Clone(have), maps.Clone(families)
	if outSeries == nil {
		outSeries = exported{}
	}
	maps.Copy(outSeries, series)
	maps.Copy(outFams, fams)
	return outSeries, outFams
}
