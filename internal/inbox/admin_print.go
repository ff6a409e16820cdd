package inbox

import (
	"encoding/json"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"
	"unicode/utf8"
)

// PrintStats writes s as a table, one source per line and one column per
// state, then the oldest unfinished claim and what waits for an operator.
func PrintStats(w io.Writer, s Stats) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "SOURCE\t"+strings.Join(AllStates, "\t"))
	for _, name := range s.Sources() {
		fmt.Fprint(tw, name)
		for _, st := range AllStates {
			fmt.Fprintf(tw, "\t%d", s.BySource[name][st])
		}
		fmt.Fprintln(tw)
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if len(s.BySource) == 0 {
		fmt.Fprintln(w, "no inbox messages, and no source configured")
	}
	if s.Oldest.IsZero() {
		fmt.Fprintln(w, "oldest unfinished claim: none")
	} else {
		fmt.Fprintf(w, "oldest unfinished claim: %s old (source %s, received_at %s)\n",
			s.OldestAge.Round(time.Millisecond), s.OldestSource, s.Oldest.UTC().Format(time.RFC3339))
	}
	_, err := fmt.Fprintf(w, "DEAD: %d (worker inbox dead list); RECOVERY_REQUIRED: %d (worker inbox recovery list)\n",
		s.Total(StateDead), s.Total(StateRecoveryRequired))
	return err
}

// PrintEntries writes the listed messages as a table, then how many there
// are in all and, when some are not shown, how to see them.
func PrintEntries(w io.Writer, state string, list []Entry, total int64) error {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "SOURCE\tMSG SOURCE\tMSG ID\tTYPE\tATTEMPTS\tSINCE\tLAST ERROR")
	for _, e := range list {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%d\t%s\t%s\n", e.Source, orDash(e.MsgSource), e.ID, orDash(e.Type), e.Attempts,
			e.FinishedAt.UTC().Format(time.RFC3339), strings.Join(strings.Fields(e.LastError), " "))
	}
	if err := tw.Flush(); err != nil {
		return err
	}
	if int64(len(list)) < total {
		_, err := fmt.Fprintf(w, "%d of %d %s messages shown, oldest first; see more with --limit %d\n", len(list), total, state, total)
		return err
	}
	_, err := fmt.Fprintf(w, "%d %s message(s)\n", total, state)
	return err
}

// PrintEntriesJSON writes one JSON object per message, its body included:
// as JSON when it is JSON, else as a string when it is text, else base64.
func PrintEntriesJSON(w io.Writer, list []Entry) error {
	enc := json.NewEncoder(w)
	for _, e := range list {
		out := struct {
			Entry
			Body       any    `json:"body,omitempty"`
			BodyBase64 []byte `json:"body_base64,omitempty"`
		}{Entry: e}
		switch {
		case len(e.Body) == 0:
		case json.Valid(e.Body):
			out.Body = json.RawMessage(e.Body)
		case utf8.Valid(e.Body):
			out.Body = string(e.Body)
		default:
			out.BodyBase64 = e.Body
		}
		if err := enc.Encode(out); err != nil {
			return err
		}
	}
	return nil
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
