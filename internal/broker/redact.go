package broker

import (
	"net/url"
	"strings"
)

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
