package inbox

import (
	"encoding/json"
	"errors"
	"fmt"
	"net/textproto"

	"github.com/worker-dev/worker/internal/broker"
	"github.com/worker-dev/worker/internal/inbox/inboxconfig"
)

// CloudEvent returns the message a delivery with CloudEvents attributes a
// makes, before its source adds where it came from: its dedupe key is
// a's source and id, and its order key a's source and subject (the
// outbox's aggregate), "" when a has no subject. Every source derives
// both here, so that one event keys alike whichever broker brought it.
func CloudEvent(a broker.Attributes) Message {
	m := Message{Source: a.Source, ID: a.ID, Type: a.Type}
	if a.Subject != "" {
		m.OrderKey = a.Source + "/" + a.Subject
	}
	return m
}

// ErrNoKey is the reason a message without a dedupe key is dead-lettered.
var ErrNoKey = errors.New("no dedupe key: the message has no CloudEvents id")

// ApplyKey fills m's key from the header or field k names when the source
// found no CloudEvents id, and returns why m cannot be keyed, if it
// cannot.
func ApplyKey(k inboxconfig.KeySpec, m *Message) error {
	if m.ID != "" {
		return nil
	}
	switch {
	case k.Header != "":
		want := textproto.CanonicalMIMEHeaderKey(k.Header)
		for name, v := range m.Headers {
			if textproto.CanonicalMIMEHeaderKey(name) == want && v != "" {
				m.Source, m.ID = "", v
				return nil
			}
		}
		return fmt.Errorf("%w, and no header %s", ErrNoKey, k.Header)
	case k.Field != "":
		var obj map[string]json.RawMessage
		if err := json.Unmarshal(m.Body, &obj); err != nil {
			return fmt.Errorf("%w, and the body is not a JSON object to read field %s from", ErrNoKey, k.Field)
		}
		raw, ok := obj[k.Field]
		if !ok {
			return fmt.Errorf("%w, and the body has no field %s", ErrNoKey, k.Field)
		}
		var s string
		if json.Unmarshal(raw, &s) != nil {
			s = string(raw) // a number or other scalar keys by its JSON text
		}
		if s == "" || s == "null" {
			return fmt.Errorf("%w, and field %s is empty", ErrNoKey, k.Field)
		}
		m.Source, m.ID = "", s
		return nil
	}
	return ErrNoKey
}
