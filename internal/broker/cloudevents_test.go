package broker_test

import (
	"testing"

	"github.com/worker-dev/worker/internal/broker"
	"github.com/worker-dev/worker/internal/broker/brokertest"
)

func TestListAndSetRoundTrip(t *testing.T) {
	t.Parallel()
	for _, want := range brokertest.Odd {
		var got broker.Attributes
		for _, a := range want.List() {
			if !got.Set(a.Name, a.Value) && a.Name != "specversion" {
				t.Errorf("Set(%q) refused a name List returned", a.Name)
			}
		}
		if got != want {
			t.Errorf("List then Set: %+v, want %+v", got, want)
		}
	}
	attrs := brokertest.Odd[0].List()
	if len(attrs) != len(broker.Names) {
		t.Fatalf("all attributes set: List returned %d, want %d", len(attrs), len(broker.Names))
	}
	for i, a := range attrs {
		if a.Name != broker.Names[i] {
			t.Errorf("List()[%d] = %q, want %q (broker.Names' order)", i, a.Name, broker.Names[i])
		}
	}
	if a := attrs[0]; a.Value != broker.SpecVersion {
		t.Errorf("specversion %q, want %q", a.Value, broker.SpecVersion)
	}
}

func TestPercentDecodeReversesPercentEncode(t *testing.T) {
	t.Parallel()
	for _, a := range brokertest.Odd {
		for _, v := range []string{a.ID, a.Source, a.Type, a.Subject, a.Time} {
			if got := broker.PercentDecode(broker.PercentEncode(v, broker.HeaderSafe)); got != v {
				t.Errorf("broker.PercentDecode(broker.PercentEncode(%q)) = %q", v, got)
			}
		}
	}
	// A foreign sender's raw '%' is kept as it came.
	if got := broker.PercentDecode("100%"); got != "100%" {
		t.Errorf("broker.PercentDecode(%q) = %q", "100%", got)
	}
}
