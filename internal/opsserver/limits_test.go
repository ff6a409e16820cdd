package opsserver

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"
)

// The ops server's limits are written out in configs/worker.yaml and
// docs/operations.md; each figure there is the constant's.
func TestOpsServerLimitsAsDocumented(t *testing.T) {
	t.Parallel()
	secs := func(d time.Duration) string { return fmt.Sprintf("%ds", int(d.Seconds())) }
	kib := fmt.Sprintf("%d KiB", opsMaxHeaderBytes>>10)
	yaml := commentBefore(t, readFile(t, "../../configs/worker.yaml"), "http:", "addr:")
	for _, want := range []string{
		secs(opsReadHeaderTimeout) + " to send the request head",
		secs(opsReadTimeout) + " for the request",
		secs(opsWriteTimeout) + " for the answer",
		secs(opsIdleTimeout) + " idle",
		kib + " of headers",
		fmt.Sprintf("%d connections", opsMaxConns),
		fmt.Sprintf("%d concurrent scrapes", opsMaxScrapes),
	} {
		if !strings.Contains(yaml, want) {
			t.Errorf("configs/worker.yaml, http.addr's comment: no %q in %q", want, yaml)
		}
	}
	ops := strings.Join(strings.Fields(readFile(t, "../../docs/operations.md")), " ")
	for _, want := range []string{
		secs(opsReadHeaderTimeout) + " to send a request head",
		secs(opsReadTimeout) + " to send the request",
		secs(opsWriteTimeout) + " to write the answer",
		secs(opsIdleTimeout) + " idle",
		kib + " of headers",
		fmt.Sprintf("At most %d scrapes", opsMaxScrapes),
		fmt.Sprintf("At most %d connections", opsMaxConns),
		fmt.Sprintf("had %s to send it", opsHeadGrace),
	} {
		if !strings.Contains(ops, want) {
			t.Errorf("docs/operations.md, the ops server: no %q", want)
		}
	}
}

// commentBefore is the comment above key in the YAML block that starts
// with the top-level line block, its lines joined without their "#".
func commentBefore(t *testing.T, yaml, block, key string) string {
	t.Helper()
	_, rest, ok := strings.Cut(yaml, "\n"+block+"\n")
	if !ok {
		t.Fatalf("no %q block", block)
	}
	var words []string
	for _, line := range strings.Split(rest, "\n") {
		line = strings.TrimSpace(line)
		if strings.HasPrefix(line, key) {
			return strings.Join(words, " ")
		}
		words = append(words, strings.Fields(strings.TrimPrefix(line, "#"))...)
	}
	t.Fatalf("no %q in the %q block", key, block)
	return ""
}

func readFile(t *testing.T, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
