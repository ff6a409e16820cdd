package inbox

import (
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"
)

// ErrUnstorable is the reason a message is dead-lettered at once when the
// database cannot store its text: PostgreSQL's text and jsonb refuse a NUL
// byte and a byte sequence that is not UTF-8. Left in, such a message
// would fail every claim as a database error, for ever, and hold back the
// messages of its batch.
var ErrUnstorable = errors.New("unstorable message")

// checkStorable returns why m cannot be stored as it is, naming the first
// field at fault, or nil. The body is stored as bytes and always can be.
func checkStorable(m *Message) error {
	fields := []struct{ name, value string }{
		{"source", m.Source}, {"id", m.ID}, {"type", m.Type}, {"order key (subject)", m.OrderKey}, {"origin", m.Origin},
	}
	for _, f := range fields {
		if why := unstorable(f.value); why != "" {
			return fmt.Errorf("%w: its %s %s %s", ErrUnstorable, f.name, escape(f.value), why)
		}
	}
	for _, name := range slices.Sorted(maps.Keys(m.Headers)) {
		if why := unstorable(name); why != "" {
			return fmt.Errorf("%w: its header name %s %s", ErrUnstorable, escape(name), why)
		}
		if v := m.Headers[name]; unstorable(v) != "" {
			return fmt.Errorf("%w: its header %s = %s %s", ErrUnstorable, escape(name), escape(v), unstorable(v))
		}
	}
	return nil
}

// unstorable says what keeps s out of a text column, or "".
func unstorable(s string) string {
	switch {
	case strings.IndexByte(s, 0) >= 0:
		return "has a NUL byte"
	case !utf8.ValidString(s):
		return "is not UTF-8"
	}
	return ""
}

// makeStorable replaces m's text with an escaped form the database takes,
// so that the dead letter itself can be written: a NUL as \x00, a byte
// that is not UTF-8 as \xNN (Go's quoting, without the quotes).
func makeStorable(m *Message) {
	for _, p := range []*string{&m.Source, &m.ID, &m.Type, &m.OrderKey, &m.Origin} {
		*p = storable(*p)
	}
	if len(m.Headers) == 0 {
		return
	}
	h := make(map[string]string, len(m.Headers))
	for k, v := range m.Headers {
		h[storable(k)] = storable(v)
	}
	m.Headers = h
}

func storable(s string) string {
	if unstorable(s) == "" {
		return s
	}
	q := escape(s)
	return q[1 : len(q)-1]
}

// escape quotes s with Go's rules: printable, valid UTF-8, never a NUL.
func escape(s string) string { return strconv.Quote(s) }
