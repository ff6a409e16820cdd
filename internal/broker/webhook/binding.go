package webhook

import (
	"net/http"

	"github.com/worker-dev/worker/internal/broker"
)

// keys are the Ce- header names of the CloudEvents attributes, in
// canonical form, so that a sink can write them into an http.Header
// directly.
var keys = func() map[string]string {
	k := broker.Keys("ce-")
	for n, v := range k {
		k[n] = http.CanonicalHeaderKey(v)
	}
	return k
}()

// Encode writes a's attributes as Ce- headers (HTTP binary mode) through
// set, values percent-encoded (HTTP binding 3.1.3.2): space, '"', '%' and
// every byte outside printable ASCII become %XY, so any UTF-8 value
// survives the trip.
func Encode(a broker.Attributes, set func(key, value string)) {
	for _, at := range a.List() {
		set(keys[at.Name], broker.PercentEncode(at.Value, broker.HeaderSafe))
	}
}

// Decode reads the CloudEvents attributes Encode wrote. A header that is
// missing leaves its attribute "".
func Decode(h http.Header) broker.Attributes {
	var a broker.Attributes
	for _, name := range broker.Names {
		a.Set(name, broker.PercentDecode(h.Get(keys[name])))
	}
	return a
}
