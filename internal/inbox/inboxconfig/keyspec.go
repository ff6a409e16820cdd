package inboxconfig

import (
	"fmt"
	"strings"
)

// KeySpec says where a foreign message, one without a CloudEvents id,
// keeps its dedupe key (inbox.sources[].key).
type KeySpec struct {
	Header string // a header or property name, matched without case
	Field  string // a top-level field of a JSON object body
}

// ParseKey reads "header:<name>", "field:<name>" or "".
func ParseKey(s string) (KeySpec, error) {
	kind, name, _ := strings.Cut(s, ":")
	switch {
	case s == "":
		return KeySpec{}, nil
	case kind == "header" && name != "":
		return KeySpec{Header: name}, nil
	case kind == "field" && name != "":
		return KeySpec{Field: name}, nil
	}
	return KeySpec{}, fmt.Errorf("%q: want header:<name> or field:<name>, or nothing to use the CloudEvents id only", s)
}
