package kafka

import (
	"testing"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/worker-dev/worker/internal/broker"
	"github.com/worker-dev/worker/internal/broker/brokertest"
)

// Decode reverses Encode for every attribute, odd values included, sent
// in the ce_ headers as they are.
func TestBindingRoundTrip(t *testing.T) {
	t.Parallel()
	for _, want := range brokertest.Odd {
		var h []kgo.RecordHeader
		Encode(want, func(k, v string) { h = append(h, kgo.RecordHeader{Key: k, Value: []byte(v)}) })
		if h[0].Key != "ce_specversion" || string(h[0].Value) != broker.SpecVersion {
			t.Errorf("first header %s=%q, want ce_specversion=%s", h[0].Key, h[0].Value, broker.SpecVersion)
		}
		for _, r := range h {
			if r.Key == "ce_subject" && want.Subject == "" {
				t.Errorf("%+v: ce_subject sent for an empty subject", want)
			}
		}
		if got := Decode(h); got != want {
			t.Errorf("Decode(Encode(%+v)) = %+v", want, got)
		}
	}
	// Of a header given twice, the last counts.
	got := Decode([]kgo.RecordHeader{{Key: "ce_id", Value: []byte("first")}, {Key: "ce_id", Value: []byte("last")}})
	if got.ID != "last" {
		t.Errorf("ce_id twice: %q, want the last", got.ID)
	}
}
