package obs

import "net/url"

// RedactURL drops user info and the query, which may carry credentials, so
// a URL can go into an error message or a log line.
func RedactURL(raw string) string {
	u, err := url.Parse(raw)
	if err != nil {
		return "(unparsable URL)"
	}
	u.User = nil
	if u.RawQuery != "" {
		u.RawQuery = "..."
	}
	u.Fragment = ""
	return u.String()
}
