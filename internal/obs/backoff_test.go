package obs

import (
	"context"
	"testing"
	"time"
)

func TestSleep(t *testing.T) {
	t.Parallel()
	ctx, cancel := context.WithCancel(context.Background())
	if !Sleep(ctx, 0) || !Sleep(ctx, time.Millisecond) {
		t.Error("Sleep on a live context = false, want true")
	}
	cancel()
	if Sleep(ctx, 0) || Sleep(ctx, time.Hour) {
		t.Error("Sleep on an ended context = true, want false")
	}
}
