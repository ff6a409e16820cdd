package cli

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"time"

	"github.com/worker-dev/worker/internal/config"
	"github.com/worker-dev/worker/internal/startup"
)

// healthcheckCmd asks the worker running beside it whether it is ready, for
// a container HEALTHCHECK (the distroless image has no curl). It finds the
// ops server the way `run` does: same configuration file and APP_*
// variables.
type healthcheckCmd struct {
	Timeout time.Duration `default:"3s" help:"Give up after this long."`
}

// unhealthyError is a failed health check: exit 1, which container
// runtimes read as "unhealthy".
type unhealthyError struct{ err error }

func (e *unhealthyError) Error() string { return "not ready: " + e.err.Error() }
func (e *unhealthyError) Unwrap() error { return e.err }

func (c healthcheckCmd) Run(e *cmdEnv) error {
	if c.Timeout <= 0 {
		// A zero budget would fail every check as "context deadline
		// exceeded", which reads like a worker that does not answer.
		return &startup.ExitError{Code: startup.ExitUsage, Msg: fmt.Sprintf("--timeout %s: want a positive duration, such as 3s", c.Timeout)}
	}
	if err := c.check(e); err != nil {
		return &unhealthyError{err}
	}
	fmt.Fprintln(e.Stdout, "ready")
	return nil
}

func (c healthcheckCmd) check(e *cmdEnv) error {
	cfg, err := e.loadConfig(config.CheckAll)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithTimeout(context.Background(), c.Timeout)
	defer cancel()
	url := "http://" + localAddr(cfg.HTTP.Addr) + "/readyz"
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	if err != nil {
		return err
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s answered %s", url, resp.Status)
	}
	return nil
}

// localAddr turns the ops server's listen address into one to dial from
// the same host: no host, or a wildcard, means the loopback interface.
func localAddr(listen string) string {
	host, port, err := net.SplitHostPort(listen)
	if err != nil {
		return listen // validated when the configuration was read; not reached
	}
	if ip := net.ParseIP(host); host == "" || ip != nil && ip.IsUnspecified() {
		host = "127.0.0.1"
	}
	return net.JoinHostPort(host, port)
}

// exitCode is startup.ExitCode with the one code the wiring does not
// know: a failed health check's.
func exitCode(err error) int {
	var uh *unhealthyError
	if errors.As(err, &uh) {
		return startup.ExitUnhealthy
	}
	return startup.ExitCode(err)
}
