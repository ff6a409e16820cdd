package cli

import (
	"encoding/json"
	"fmt"

	"github.com/worker-dev/worker/internal/startup"
)

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
	b := startup.CurrentBuild()
	if c.json() {
		enc := json.NewEncoder(e.Stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(versionInfo{Version: b.Version, Revision: b.Revision, BuildDate: b.Date,
			GoVersion: b.GoVersion, Platform: b.Platform, Development: b.Development})
	}
	title := "worker " + b.Version
	if b.Development {
		title += " (development build)"
	}
	_, err := fmt.Fprintf(e.Stdout, "%s\nrevision:   %s\nbuilt:      %s\ngo:         %s %s\n",
		title, b.Revision, b.Date, b.GoVersion, b.Platform)
	return err
}
