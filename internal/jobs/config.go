// Package jobs runs named fixed-delay jobs on gocron, each run guarded by a
// lease from the lock port when several replicas run.
package jobs

import "time"

// Definition is one job under `jobs:` in configs/worker.yaml.
type Definition struct {
	Name         string            `koanf:"name" yaml:"name"`
	Kind         string            `koanf:"kind" yaml:"kind"` // sql | http
	Delay        time.Duration     `koanf:"delay" yaml:"delay"`
	InitialDelay time.Duration     `koanf:"initial_delay" yaml:"initial_delay"`
	Timeout      time.Duration     `koanf:"timeout" yaml:"timeout"`
	LeaseTTL     time.Duration     `koanf:"lease_ttl" yaml:"lease_ttl"`
	Enabled      *bool             `koanf:"enabled" yaml:"enabled"`
	SQL          string            `koanf:"sql" yaml:"sql,omitempty"`
	URL          string            `koanf:"url" yaml:"url,omitempty"`
	Method       string            `koanf:"method" yaml:"method,omitempty"`
	Headers      map[string]string `koanf:"headers" yaml:"headers,omitempty"`
}
