// Command tasks is the Go task kind of docs/tasks.md: the stock worker plus
// a river.Worker that resizes images.
package main

import (
	"context"
	"errors"
	"os"
	"path"
	"strings"

	"github.com/riverqueue/river"

	"github.com/worker-dev/worker"
)

type ResizeImageArgs struct {
	Image string `json:"image"`
}

func (ResizeImageArgs) Kind() string { return "resize-image" }

type ResizeImageWorker struct {
	river.WorkerDefaults[ResizeImageArgs]
}

func (w *ResizeImageWorker) Work(ctx context.Context, job *river.Job[ResizeImageArgs]) error {
	if unsupported(job.Args.Image) {
		return river.JobCancel(errors.New("unsupported format")) // permanent: dead letter now
	}
	return resize(ctx, job.Args.Image) // an error is retried
}

func main() {
	os.Exit(worker.Run(os.Args[1:], worker.WithTaskKind(&ResizeImageWorker{})))
}

// unsupported reports whether no retry can help: the format is one this
// program has no code for.
func unsupported(image string) bool {
	switch strings.ToLower(path.Ext(image)) {
	case ".jpeg", ".jpg", ".png":
		return false
	}
	return true
}

// resize stands for the program's own image code; it honours ctx, which
// the kind's timeout and the worker's shutdown cancel.
func resize(ctx context.Context, image string) error {
	return ctx.Err()
}
