package webhook

import (
	"net/http"
	"testing"

	"github.com/worker-dev/worker/internal/broker"
	"github.com/worker-dev/worker/internal/broker/brokertest"
)

// Decode reverses Encode for every attribute, odd values included, and
// the encoded values are ones an HTTP header carries (HTTP binding
// 3.1.3.2).
func TestBindingRoundTrip(t *testing.T) {
	t.Parallel()
	for _, want := range brokertest.Odd {
		h := http.Header{}
		Encode(want, func(k, v string) { h[k] = []string{v} })
		if got := h.Get("Ce-Specversion"); got != broker.SpecVersion {
			t.Errorf("Ce-Specversion %q, want %q", got, broker.SpecVersion)
		}
		for k, v := range h {
			if http.CanonicalHeaderKey(k) != k {
				t.Errorf("header %q is not in canonical form", k)
			}
			for _, c := range []byte(v[0]) {
				if !broker.HeaderSafe(c) {
					t.Errorf("%s: %q has byte %q, which the binding percent-encodes", k, v[0], c)
				}
			}
		}
		if _, ok := h["Ce-Subject"]; ok && want.Subject == "" {
			t.Errorf("%+v: Ce-Subject sent for an empty subject", want)
		}
		if got := Decode(h); got != want {
			t.Errorf("Decode(Encode(%+v)) = %+v", want, got)
		}
	}
}
