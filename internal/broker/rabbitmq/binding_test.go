package rabbitmq

import (
	"testing"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/worker-dev/worker/internal/broker"
	"github.com/worker-dev/worker/internal/broker/brokertest"
)

// Decode reverses Encode for every attribute, odd values included, sent
// as cloudEvents: application properties as they are; a table the client
// refuses to send would fail Validate.
func TestBindingRoundTrip(t *testing.T) {
	t.Parallel()
	for _, want := range brokertest.Odd {
		h := amqp.Table{}
		Encode(want, h)
		if err := h.Validate(); err != nil {
			t.Errorf("%+v: %v", want, err)
		}
		if h["cloudEvents:specversion"] != broker.SpecVersion {
			t.Errorf("cloudEvents:specversion %v, want %s", h["cloudEvents:specversion"], broker.SpecVersion)
		}
		if _, ok := h["cloudEvents:subject"]; ok && want.Subject == "" {
			t.Errorf("%+v: cloudEvents:subject sent for an empty subject", want)
		}
		if got := Decode(h); got != want {
			t.Errorf("Decode(Encode(%+v)) = %+v", want, got)
		}
		// JMS's cloudEvents_ form reads the same.
		jms := amqp.Table{}
		for k, v := range h {
			jms["cloudEvents_"+k[len(Prefix):]] = v
		}
		if got := Decode(jms); got != want {
			t.Errorf("Decode(cloudEvents_ %+v) = %+v", want, got)
		}
	}
}
