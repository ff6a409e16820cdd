package rabbitmq

import "github.com/worker-dev/worker/internal/broker"

// RoutingWord escapes one value so that it stays one word of a topic
// routing key: '%', '.', '*', '#', whitespace, control characters and
// non-ASCII bytes become %XY, and an empty value becomes "_".
func RoutingWord(v string) string {
	if v == "" {
		return "_"
	}
	return broker.PercentEncode(v, func(c byte) bool {
		return c > ' ' && c < 0x7f && c != '.' && c != '*' && c != '#'
	})
}
