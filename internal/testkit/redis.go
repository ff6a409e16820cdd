package testkit

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"os"
	"testing"
	"time"

	"github.com/redis/go-redis/v9"
)

// RedisURLEnv names the Redis of the tests that need one; by default the
// local server scripts/services.sh (ensure_redis) starts. They fail, never
// skip, when it is unreachable.
const RedisURLEnv = "WORKER_TEST_REDIS_URL"

// RedisURL is the tests' Redis URL.
func RedisURL() string {
	if u := os.Getenv(RedisURLEnv); u != "" {
		return u
	}
	return "redis://127.0.0.1:6379/0"
}

// RedisClient connects a new client (a pool of its own, as a replica has)
// to the tests' Redis and closes it when tb ends. tb fails if Redis does
// not answer.
func RedisClient(tb testing.TB) *redis.Client {
	tb.Helper()
	opts, err := redis.ParseURL(RedisURL())
	if err != nil {
		tb.Fatalf("%s: %v", RedisURLEnv, err)
	}
	opts.ContextTimeoutEnabled = true
	c := redis.NewClient(opts)
	tb.Cleanup(func() { _ = c.Close() })
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := c.Ping(ctx).Err(); err != nil {
		tb.Fatalf("Redis at %s does not answer (%v): start it with `. scripts/services.sh && ensure_redis`, or point %s at one",
			opts.Addr, err, RedisURLEnv)
	}
	return c
}

// RedisPrefix returns a key prefix of tb's own, so that tests sharing one
// Redis run in parallel without seeing each other's keys, and deletes the
// keys under it when tb ends.
func RedisPrefix(tb testing.TB) string {
	tb.Helper()
	b := make([]byte, 6)
	_, _ = rand.Read(b)
	prefix := "worker-test:" + hex.EncodeToString(b) + ":"
	c := RedisClient(tb) // its Close was registered first, so it runs after the cleanup below
	tb.Cleanup(func() {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		defer cancel()
		iter := c.Scan(ctx, 0, prefix+"*", 1000).Iterator()
		for iter.Next(ctx) {
			c.Del(ctx, iter.Val())
		}
	})
	return prefix
}
