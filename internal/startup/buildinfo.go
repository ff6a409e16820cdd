package startup

import (
	"context"
	"log/slog"
	"runtime"
	"runtime/debug"

	"github.com/prometheus/client_golang/prometheus"
)

// Revision is the source revision the binary was built from. Set it at
// build time with -ldflags "-X github.com/worker-dev/worker/internal/startup.Revision=...", as the
// Dockerfile does (a build context usually has no .git); otherwise it is
// read from the Go toolchain's vcs.revision stamp, or "unknown".
var Revision = ""

// build describes the running binary.
type build struct{ version, revision, goVersion string }

func currentBuild() build {
	b := build{version: Version, revision: Revision, goVersion: runtime.Version()}
	if b.revision == "" {
		b.revision = "unknown"
		if bi, ok := debug.ReadBuildInfo(); ok {
			for _, s := range bi.Settings {
				if s.Key == "vcs.revision" && s.Value != "" {
					b.revision = s.Value
				}
			}
		}
	}
	return b
}

// registerOpsMetrics adds the metrics about the process itself:
// worker_build_info, and worker_ready, which is what /readyz would answer
// at scrape time, so an alert can tell a replica that runs but is not ready
// from one that is gone.
func registerOpsMetrics(reg prometheus.Registerer, ready *readiness) {
	b := currentBuild()
	reg.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name:        "worker_build_info",
			Help:        "Always 1; the labels name the running build.",
			ConstLabels: prometheus.Labels{"version": b.version, "revision": b.revision, "goversion": b.goVersion},
		}, func() float64 { return 1 }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "worker_ready",
			Help: "1 when /readyz answers 200 (database reachable, migrations current, schema version this build's, lock provider reachable, started, not draining; never the sink), else 0.",
		}, func() float64 {
			if ok, _ := ready.check(context.Background()); ok {
				return 1
			}
			return 0
		}),
	)
}

// logStartup writes the one line that says what is starting: which build,
// with which configuration file, in which mode, with which lock provider
// and sink, and the most database connections it will hold (for sizing
// max_connections).
func logStartup(log *slog.Logger, cfg *Config, configFile string) {
	b := currentBuild()
	mode := "single-instance"
	if cfg.MultiInstance.Enabled {
		mode = "multi-instance"
	}
	sink := "off"
	if cfg.Outbox.Enabled {
		sink = cfg.Outbox.Sink
	}
	if configFile == "" {
		configFile = "none"
	}
	log.Info("worker starting", "version", b.version, "revision", b.revision, "goversion", b.goVersion,
		"config_file", configFile, "mode", mode, "lock_provider", cfg.Lock.Provider, "sink", sink,
		"db_conns_max", cfg.MaxDBConns())
}
