package nats

import (
	"fmt"
	"strings"

	"github.com/worker-dev/worker/internal/broker"
)

// SubjectToken escapes one value so that it stays one subject token and
// reads the same for every consumer: '%', '.', '*', '>', whitespace,
// control characters and non-ASCII bytes become %XY (their hex), and so do
// a leading '$' and '_', so that no value makes a token of the server's
// namespaces ($JS, _INBOX) wherever it lands. An empty value becomes "_"
// (the producer rules refuse empty keys anyway), which no other value
// renders.
func SubjectToken(v string) string {
	if v == "" {
		return "_"
	}
	tok := broker.PercentEncode(v, func(c byte) bool {
		return c > ' ' && c < 0x7f && c != '.' && c != '*' && c != '>'
	})
	switch tok[0] {
	case '$':
		return "%24" + tok[1:]
	case '_':
		return "%5F" + tok[1:]
	}
	return tok
}

// ValidSubject rejects a subject (or a fixed part of one) that would
// not name exactly one subject: empty tokens, wildcards, whitespace. key
// names the setting in errors.
func ValidSubject(key, s string) error {
	if s == "" {
		return fmt.Errorf("%s is empty", key)
	}
	for tok := range strings.SplitSeq(s, ".") {
		if tok == "" || tok == "*" || tok == ">" || strings.ContainsFunc(tok, func(r rune) bool { return r <= ' ' || r == 0x7f }) {
			return fmt.Errorf("%s=%q: want dot-separated tokens without wildcards or whitespace", key, s)
		}
	}
	return nil
}
