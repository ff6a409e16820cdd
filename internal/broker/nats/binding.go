package nats

import (
	"github.com/nats-io/nats.go"

	"github.com/worker-dev/worker/internal/broker"
)

// keys are the ce- header names of the CloudEvents attributes.
var keys = broker.Keys("ce-")

// Encode writes a's attributes as ce- headers (binary mode), values
// percent-encoded as in the HTTP binding, through set: the sink gives
// every header one slot of a shared array.
func Encode(a broker.Attributes, set func(key, value string)) { broker.EncodeHeaders(a, keys, set) }

// Decode reads the CloudEvents attributes Encode wrote.
func Decode(h nats.Header) broker.Attributes { return broker.DecodeHeaders(keys, h.Get) }
