// Command worker runs fixed-delay jobs, the transactional-outbox relay and
// background tasks beside PostgreSQL.
package main

import (
	"os"

	"github.com/worker-dev/worker"
)

func main() { os.Exit(worker.Run(os.Args[1:])) }
