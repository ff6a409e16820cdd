package startup

import (
	"runtime/debug"
	"testing"
)

// GOGC set by the operator wins over the worker's default; an empty GOGC
// is unset, as the runtime reads it.
func TestTuneGCLeavesAnOperatorsGOGC(t *testing.T) {
	prev := debug.SetGCPercent(123) // stands for what the runtime took from GOGC
	t.Cleanup(func() { debug.SetGCPercent(prev) })

	t.Setenv("GOGC", "50")
	tuneGC()
	if got := debug.SetGCPercent(123); got != 123 {
		t.Errorf("with GOGC=50 the GC percent became %d, want it left at 123", got)
	}

	t.Setenv("GOGC", "")
	tuneGC()
	if got := debug.SetGCPercent(123); got != defaultGCPercent {
		t.Errorf("with GOGC empty the GC percent is %d, want %d", got, defaultGCPercent)
	}
}
