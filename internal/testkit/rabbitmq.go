package testkit

import (
	"net"
	"net/url"
	"os"
	"testing"
)

// The RabbitMQ of the tests that need one: RabbitMQURLEnv, by default the
// local broker with guest/guest. They fail when it is unreachable, unless
// RabbitMQSkipEnv says to skip them.
const (
	RabbitMQURLEnv  = "WORKER_TEST_RABBITMQ_URL"
	RabbitMQSkipEnv = "WORKER_TEST_RABBITMQ_SKIP"
)

// RabbitMQURL is the tests' broker URL.
func RabbitMQURL() string {
	if u := os.Getenv(RabbitMQURLEnv); u != "" {
		return u
	}
	return "amqp://guest:guest@127.0.0.1:5672/"
}

// ParseRabbitMQURL is RabbitMQURL with its port spelled out, so that its
// Host can be dialled (or replaced) as is.
func ParseRabbitMQURL(tb testing.TB) *url.URL {
	tb.Helper()
	u, err := url.Parse(RabbitMQURL())
	if err != nil {
		tb.Fatalf("%s: %v", RabbitMQURLEnv, err)
	}
	if u.Port() == "" {
		port := "5672"
		if u.Scheme == "amqps" {
			port = "5671"
		}
		u.Host = net.JoinHostPort(u.Hostname(), port)
	}
	return u
}

// SkipWithoutRabbitMQ skips tb when RabbitMQSkipEnv is set.
func SkipWithoutRabbitMQ(tb testing.TB) {
	tb.Helper()
	if os.Getenv(RabbitMQSkipEnv) != "" {
		tb.Skipf("%s is set: RabbitMQ tests skipped", RabbitMQSkipEnv)
	}
}
