package startup

import (
	"context"
	"log/slog"
	"regexp"
	"runtime"
	"runtime/debug"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/opsserver"
)

// Version is set at build time with -ldflags "-X github.com/worker-dev/worker/internal/startup.Version=...".
var Version = "dev"

// Revision and BuildDate, like Version, are stamped at link time by a
// release build (.goreleaser.yaml, the Dockerfile):
//
//	-ldflags "-X github.com/worker-dev/worker/internal/startup.Version=v0.1.0
//	          -X github.com/worker-dev/worker/internal/startup.Revision=<commit>
//	          -X github.com/worker-dev/worker/internal/startup.BuildDate=<RFC 3339 time>"
//
// Unset, Revision is read from the Go toolchain's vcs.revision stamp (a
// build context usually has no .git), else "unknown"; BuildDate is
// "unknown".
var (
	Revision  = ""
	BuildDate = ""
)

// Build describes the running binary.
type Build struct {
	Version, Revision, Date, GoVersion, Platform string
	// Development is true for every build that is not a release: see
	// isRelease.
	Development bool
}

// CurrentBuild is the running binary's Build: what `worker version`, the
// startup line and worker_build_info report.
func CurrentBuild() Build {
	b := Build{Version: Version, Revision: Revision, Date: BuildDate,
		GoVersion: runtime.Version(), Platform: runtime.GOOS + "/" + runtime.GOARCH}
	bi, ok := debug.ReadBuildInfo()
	if b.Version == "dev" && ok && isRelease(bi.Main.Version) {
		// `go install github.com/worker-dev/worker/cmd/worker@v0.1.0`
		// stamps no ldflags, but the toolchain records the module version.
		b.Version = bi.Main.Version
	}
	if b.Revision == "" {
		b.Revision = "unknown"
		if ok {
			for _, s := range bi.Settings {
				if s.Key == "vcs.revision" && s.Value != "" {
					b.Revision = s.Value
				}
			}
		}
	}
	if b.Date == "" {
		b.Date = "unknown"
	}
	b.Development = !isRelease(b.Version)
	return b
}

var (
	// semverTag is a release tag: vMAJOR.MINOR.PATCH with an optional
	// pre-release (v0.2.0-rc.1), and no build metadata.
	semverTag = regexp.MustCompile(`^v?(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)\.(0|[1-9][0-9]*)(-[0-9A-Za-z.-]+)?$`)
	// pseudoVersion is the tail of a Go pseudo-version
	// (v0.0.0-20261206063516-e573868abcd1): a commit, not a tag.
	pseudoVersion = regexp.MustCompile(`[0-9]{14}-[0-9a-f]{12}$`)
)

// isRelease tells a release's version from a development build's: "dev"
// (nothing stamped), a snapshot ("v0.2.0-dev+e573868"), a Go pseudo-version
// or a "+dirty" tree are all development builds.
func isRelease(v string) bool {
	return semverTag.MatchString(v) && !pseudoVersion.MatchString(v) && !strings.Contains(v, "-dev")
}

// registerOpsMetrics adds the metrics about the process itself:
// worker_build_info, and worker_ready, which is what /readyz would answer
// at scrape time, so an alert can tell a replica that runs but is not ready
// from one that is gone.
func registerOpsMetrics(reg prometheus.Registerer, ready *opsserver.Readiness) {
	b := CurrentBuild()
	reg.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name:        "worker_build_info",
			Help:        "Always 1; the labels name the running build.",
			ConstLabels: prometheus.Labels{"version": b.Version, "revision": b.Revision, "build_date": b.Date, "goversion": b.GoVersion},
		}, func() float64 { return 1 }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name: "worker_ready",
			Help: "1 when /readyz answers 200 (database reachable, migrations current, schema version this build's, lock provider reachable, started, not draining; never the sink), else 0.",
		}, func() float64 {
			if ok, _ := ready.Check(context.Background()); ok {
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
func logStartup(log *slog.Logger, cfg *runConfig, configFile string) {
	b := CurrentBuild()
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
	log.Info("worker starting", "version", b.Version, "revision", b.Revision, "build_date", b.Date, "goversion", b.GoVersion,
		"config_file", configFile, "mode", mode, "lock_provider", cfg.Lock.Provider, "sink", sink,
		"db_conns_max", cfg.MaxDBConns())
}
