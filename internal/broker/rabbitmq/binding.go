package rabbitmq

import (
	"cmp"
	"fmt"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/worker-dev/worker/internal/broker"
)

// Prefix starts the application property names of the CloudEvents
// attributes (the AMQP binding). Decode also takes JMS's "cloudEvents_",
// which the binding allows.
const Prefix = "cloudEvents:"

// keys are the property names of the CloudEvents attributes.
var (
	keys    = broker.Keys(Prefix)
	jmsKeys = broker.Keys("cloudEvents_")
)

// Encode writes a's attributes into h as cloudEvents: application
// properties, values as they are.
func Encode(a broker.Attributes, h amqp.Table) {
	for _, at := range a.List() {
		h[keys[at.Name]] = at.Value
	}
}

// Decode reads the CloudEvents attributes Encode wrote, or their
// cloudEvents_ form. A property that is missing leaves its attribute "".
func Decode(h amqp.Table) broker.Attributes {
	var a broker.Attributes
	for _, name := range broker.Names {
		a.Set(name, cmp.Or(Text(h[keys[name]]), Text(h[jmsKeys[name]])))
	}
	return a
}

// Text is an AMQP field value as a string.
func Text(v any) string {
	switch v := v.(type) {
	case string:
		return v
	case []byte:
		return string(v)
	case time.Time:
		return v.UTC().Format(time.RFC3339Nano)
	case nil:
		return ""
	}
	return fmt.Sprint(v)
}
