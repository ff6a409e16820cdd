package sink

import (
	"net/url"
	"strings"
)

// PercentEncode replaces each byte of s for which keep is false with %XY
// (upper-case hex), as CloudEvents' HTTP binding does for header values.
// '%' itself is always encoded, so the result decodes back unambiguously.
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

// HeaderSafe keeps printable ASCII other than '"' (CloudEvents HTTP
// binding 3.1.3.2, which the NATS binding follows for ce- headers).
func HeaderSafe(c byte) bool { return c > ' ' && c < 0x7f && c != '"' }

// RedactURLs returns a comma-separated list of broker URLs with any user
// information replaced by "xxxxx" (a user name alone may be a token).
func RedactURLs(list string) string {
	parts := strings.Split(list, ",")
	for i, p := range parts {
		p = strings.TrimSpace(p)
		u, err := url.Parse(p)
		switch {
		case err != nil && strings.Contains(p, "@"):
			p = "xxxxx@" + p[strings.LastIndex(p, "@")+1:]
		case err == nil && u.User != nil:
			u.User = url.User("xxxxx")
			p = u.String()
		}
		parts[i] = p
	}
	return strings.Join(parts, ",")
}
