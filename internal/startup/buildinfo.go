package startup

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"regexp"
	"runtime"
	"runtime/debug"
	"strings"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/worker-dev/worker/internal/opsserver"
)

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

// build describes the running binary.
type build struct {
	version, revision, date, goVersion, platform string
	// development is true for every build that is not a release: see
	// isRelease.
	development bool
}

func currentBuild() build {
	b := build{version: Version, revision: Revision, date: BuildDate,
		goVersion: runtime.Version(), platform: runtime.GOOS + "/" + runtime.GOARCH}
	bi, ok := debug.ReadBuildInfo()
	if b.version == "dev" && ok && isRelease(bi.Main.Version) {
		// `go install github.com/worker-dev/worker/cmd/worker@v0.1.0`
		// stamps no ldflags, but the toolchain records the module version.
		b.version = bi.Main.Version
	}
	if b.revision == "" {
		b.revision = "unknown"
		if ok {
			for _, s := range bi.Settings {
				if s.Key == "vcs.revision" && s.Value != "" {
					b.revision = s.Value
				}
			}
		}
	}
	if b.date == "" {
		b.date = "unknown"
	}
	b.development = !isRelease(b.version)
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

// versionInfo is what `worker version --output json` prints. Its shape is
// pinned by TestVersionJSONShape: scripts read it.
type versionInfo struct {
	Version     string `json:"version"`
	Revision    string `json:"revision"`
	BuildDate   string `json:"build_date"`
	GoVersion   string `json:"go_version"`
	Platform    string `json:"platform"`
	Development bool   `json:"development"`
}

type versionCmd struct{ outputFlag }

func (c versionCmd) Run(e *cmdEnv) error {
	b := currentBuild()
	if c.json() {
		enc := json.NewEncoder(e.Stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(versionInfo{Version: b.version, Revision: b.revision, BuildDate: b.date,
			GoVersion: b.goVersion, Platform: b.platform, Development: b.development})
	}
	title := "worker " + b.version
	if b.development {
		title += " (development build)"
	}
	_, err := fmt.Fprintf(e.Stdout, "%s\nrevision:   %s\nbuilt:      %s\ngo:         %s %s\n",
		title, b.revision, b.date, b.goVersion, b.platform)
	return err
}

// registerOpsMetrics adds the metrics about the process itself:
// worker_build_info, and worker_ready, which is what /readyz would answer
// at scrape time, so an alert can tell a replica that runs but is not ready
// from one that is gone.
func registerOpsMetrics(reg prometheus.Registerer, ready *opsserver.Readiness) {
	b := currentBuild()
	reg.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{
			Name:        "worker_build_info",
			Help:        "Always 1; the labels name the running build.",
			ConstLabels: prometheus.Labels{"version": b.version, "revision": b.revision, "build_date": b.date, "goversion": b.goVersion},
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
	log.Info("worker starting", "version", b.version, "revision", b.revision, "build_date", b.date, "goversion", b.goVersion,
		"config_file", configFile, "mode", mode, "lock_provider", cfg.Lock.Provider, "sink", sink,
		"db_conns_max", cfg.MaxDBConns())
}
