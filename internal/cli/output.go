package cli

import (
	"encoding/json"
	"fmt"
	"io"

	"github.com/alecthomas/kong"
)

// The output formats of the list and stats commands (docs/operations.md,
// "Output formats").
const (
	outputTable = "table"
	outputJSON  = "json"
)

// outputFormat is the value of --output. It is a kong mapper so that every
// command refuses a bad value the same way, at parse time (exit 64).
type outputFormat string

func (o *outputFormat) Decode(ctx *kong.DecodeContext) error {
	var v string
	if err := ctx.Scan.PopValueInto("output", &v); err != nil {
		return err
	}
	switch v {
	case outputTable, "text": // text: the table's former name, kept for scripts
		*o = outputTable
	case outputJSON:
		*o = outputJSON
	default:
		return fmt.Errorf("%q is not an output format; want table or json", v)
	}
	return nil
}

// outputFlag is --output, embedded in every command that lists or counts.
type outputFlag struct {
	Output outputFormat `default:"table" placeholder:"table|json" help:"Output format: table (the default, for people) or json (one document, for scripts; docs/operations.md shows its shape)."`
}

func (o outputFlag) json() bool { return o.Output == outputJSON }

// render writes v as one indented JSON document with --output json, and
// calls table otherwise. A list must reach here as a non-nil slice (see
// jsonList): scripts read an empty list as [], never null.
func (o outputFlag) render(w io.Writer, v any, table func(io.Writer) error) error {
	if !o.json() {
		return table(w)
	}
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	return enc.Encode(v)
}

// jsonList converts each item of list for JSON, returning an empty slice
// (never nil) for an empty list.
func jsonList[T, J any](list []T, conv func(T) J) []J {
	out := make([]J, 0, len(list))
	for _, item := range list {
		out = append(out, conv(item))
	}
	return out
}
