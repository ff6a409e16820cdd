package kafka

import (
	"strings"

	"github.com/worker-dev/worker/internal/broker"
)

// TopicPart escapes one value into legal topic characters: letters,
// digits, '.' and '-' stay, every other byte (including '_', the escape
// character) becomes _XY (its hex), and so does a leading '.'; an empty
// value becomes "_". So a value never renders as "." or ".." (names Kafka
// refuses), and never starts with "__", "_." or "._": Kafka reads '.' as
// '_' when it compares names, and "__" starts its own topics.
func TopicPart(v string) string {
	if v == "" {
		return "_"
	}
	part := strings.ReplaceAll(broker.PercentEncode(v, func(c byte) bool {
		return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '.' || c == '-'
	}), "%", "_")
	if part[0] == '.' {
		return "_2E" + part[1:]
	}
	return part
}
