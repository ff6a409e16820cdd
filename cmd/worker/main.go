// Command worker runs fixed-delay jobs and a transactional-outbox relay.
package main

import (
	"os"

	"worker/internal/startup"
)

func main() {
	os.Exit(startup.Main(os.Args[1:], os.Stdout, os.Stderr, os.Environ()))
}
