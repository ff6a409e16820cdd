package nats

import (
	"testing"

	"github.com/nats-io/nats.go"

	"github.com/worker-dev/worker/internal/broker"
	"github.com/worker-dev/worker/internal/broker/brokertest"
)

// Decode reverses Encode for every attribute, odd values included, and
// the encoded values are ones a NATS header carries.
func TestBindingRoundTrip(t *testing.T) {
	t.Parallel()
	for _, want := range brokertest.Odd {
		h := nats.Header{}
		Encode(want, func(k, v string) { h[k] = []string{v} })
		if got := h["ce-specversion"]; len(got) != 1 || got[0] != broker.SpecVersion {
			t.Errorf("ce-specversion %q, want %q", got, broker.SpecVersion)
		}
		for k, v := range h {
			for _, c := range []byte(v[0]) {
				if !broker.HeaderSafe(c) {
					t.Errorf("%s: %q has byte %q, which a header may not carry unescaped", k, v[0], c)
				}
			}
		}
		if want.Subject == "" {
			if _, ok := h["ce-subject"]; ok {
				t.Errorf("%+v: ce-subject sent for an empty subject", want)
			}
		}
		if got := Decode(h); got != want {
			t.Errorf("Decode(Encode(%+v)) = %+v", want, got)
		}
	}
}
