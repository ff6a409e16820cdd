// Package migrations embeds the worker's SQL migrations into the binary.
// Files are goose migrations named NNNNN_what.sql and apply in order.
package migrations

import "embed"

//go:embed *.sql
var FS embed.FS
