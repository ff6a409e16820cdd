package kafka

import (
	"strings"

	"github.com/twmb/franz-go/pkg/kgo"

	"github.com/worker-dev/worker/internal/broker"
)

// keys are the ce_ header names of the CloudEvents attributes.
var keys = broker.Keys("ce_")

// Encode writes a's attributes as ce_ headers (binary mode), values as
// they are, through add: the sink gives every value a slice of one
// buffer.
func Encode(a broker.Attributes, add func(key, value string)) {
	for _, at := range a.List() {
		add(keys[at.Name], at.Value)
	}
}

// Decode reads the CloudEvents attributes Encode wrote. Of a header given
// twice, the last counts; one that is missing leaves its attribute "".
func Decode(headers []kgo.RecordHeader) broker.Attributes {
	var a broker.Attributes
	for _, h := range headers {
		if name, ok := strings.CutPrefix(h.Key, "ce_"); ok {
			a.Set(name, string(h.Value))
		}
	}
	return a
}
