package broker

import (
	"net/url"
	"strings"
)

// HeaderSafe keeps printable ASCII other than '"' (CloudEvents HTTP
// binding 3.1.3.2, which the NATS binding follows for ce- headers).
func HeaderSafe(c byte) bool { return c > ' ' && c < 0x7f && c != '"' }

// PercentEncode replaces each byte of s for which keep is false with %XY
// (upper-case hex), as CloudEvents' HTTP binding does for header values.
// '%' itself is always encoded, so the result decodes back unambiguously.
// The brokers use it for their header and name escaping too.
func PercentEncode(s string, keep func(c byte) bool) string {
	i := 0
	for i < len(s) && s[i] != '%' && keep(s[i]) {
		i++
	}
	if i == len(s) {
		return s // the common case: nothing to encode, no allocation
	}
	const hex = "0123456789ABCDEF"
	var b strings.Builder
	b.Grow(len(s) + 16)
	b.WriteString(s[:i])
	for ; i < len(s); i++ {
		if c := s[i]; c != '%' && keep(c) {
			b.WriteByte(c)
		} else {
			b.WriteByte('%')
			b.WriteByte(hex[c>>4])
			b.WriteByte(hex[c&0xf])
		}
	}
	return b.String()
}

// PercentDecode reverses PercentEncode. A value that is not valid
// percent-encoding (a foreign sender's raw '%') is taken as it is.
func PercentDecode(v string) string {
	if d, err := url.PathUnescape(v); err == nil {
		return d
	}
	return v
}
