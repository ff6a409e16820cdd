package startup_test

import (
	"fmt"
	"testing"
)

// inboxSourceYAML is an inbox section with one webhook source, named
// orders, on a free port: enough for a worker to serve every inbox series
// before its first message, for the tests that hold the docs and deploy/
// to the names and labels the worker exports.
func inboxSourceYAML(t *testing.T) string {
	return fmt.Sprintf(`inbox:
  sources:
    - name: orders
      kind: webhook
      webhook: {addr: %q, secret: whsec_c2VjcmV0LXNlY3JldC1zZWNyZXQ=}
      handler: {kind: sql, sql: "SELECT 1"}
`, freeAddr(t))
}
