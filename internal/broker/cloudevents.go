package broker

// ContentType is the datacontenttype of every event the outbox sends: the
// payload is jsonb.
const ContentType = "application/json"

// SpecVersion is the CloudEvents version of every event the outbox sends.
const SpecVersion = "1.0"

// Attributes are the CloudEvents context attributes a binding carries
// other than datacontenttype, which each binding puts in its own
// content-type field. The outbox sets them from an event (id = event_id,
// source = aggregate_type, subject = aggregate_id, type = event_type,
// time = occurred_at in RFC 3339); the inbox reads its dedupe and order
// keys from them. Subject and Time are optional: "" leaves them out.
type Attributes struct {
	ID, Source, Type, Subject, Time string
}

// Attribute is one CloudEvents context attribute by name.
type Attribute struct{ Name, Value string }

// Names are the names of the attributes List can return, in its order.
var Names = []string{"specversion", "id", "source", "type", "subject", "time"}

// List returns the attributes to send, in the order every binding writes
// them: specversion, id, source, type, then subject and time when set.
func (a Attributes) List() []Attribute {
	attrs := make([]Attribute, 0, len(Names))
	attrs = append(attrs,
		Attribute{"specversion", SpecVersion},
		Attribute{"id", a.ID},
		Attribute{"source", a.Source},
		Attribute{"type", a.Type},
	)
	if a.Subject != "" {
		attrs = append(attrs, Attribute{"subject", a.Subject})
	}
	if a.Time != "" {
		attrs = append(attrs, Attribute{"time", a.Time})
	}
	return attrs
}

// Set sets the attribute called name; other names (specversion, any
// extension) are ignored. It reports whether name was one of Attributes'.
func (a *Attributes) Set(name, value string) bool {
	switch name {
	case "id":
		a.ID = value
	case "source":
		a.Source = value
	case "type":
		a.Type = value
	case "subject":
		a.Subject = value
	case "time":
		a.Time = value
	default:
		return false
	}
	return true
}

// Keys maps each name in Names to prefix + name, a binding's header or
// property name, so that a binding builds those names once instead of
// for every message.
func Keys(prefix string) map[string]string {
	keys := make(map[string]string, len(Names))
	for _, n := range Names {
		keys[n] = prefix + n
	}
	return keys
}

// EncodeHeaders writes a's attributes through set under their names in
// keys, values percent-encoded as the CloudEvents HTTP binding does
// (3.1.3.2): space, '"', '%' and every byte outside printable ASCII become
// %XY, so any UTF-8 value survives the trip. The HTTP and NATS bindings
// write their headers so.
func EncodeHeaders(a Attributes, keys map[string]string, set func(key, value string)) {
	for _, at := range a.List() {
		set(keys[at.Name], PercentEncode(at.Value, HeaderSafe))
	}
}

// DecodeHeaders reads the attributes EncodeHeaders wrote, each header's
// value through get. A header that is missing leaves its attribute "".
func DecodeHeaders(keys map[string]string, get func(key string) string) Attributes {
	var a Attributes
	for _, name := range Names {
		a.Set(name, PercentDecode(get(keys[name])))
	}
	return a
}
