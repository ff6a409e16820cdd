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
// set, values percent-encoded (see broker.EncodeHeaders).
func Encode(a broker.Attributes, set func(key, value string)) { broker.EncodeHeaders(a, keys, set) }

// Decode reads the CloudEvents attributes Encode wrote.
func Decode(h http.Header) broker.Attributes { return broker.DecodeHeaders(keys, h.Get) }
