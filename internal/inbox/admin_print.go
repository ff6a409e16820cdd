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

// EntryJSON is one item of `worker inbox dead list --output json` and
// `worker inbox recovery list --output json`; docs/operations.md shows it.
// Every key is always present.
type EntryJSON struct {
	Source    string            `json:"source"`     // inbox.sources[].name
	MsgSource string            `json:"msg_source"` // CloudEvents source, "" for a configured key
	ID        string            `json:"msg_id"`
	State     string            `json:"state"`
	Type      string            `json:"type"`
	OrderKey  string            `json:"order_key"`
	Origin    string            `json:"origin"`
	Headers   map[string]string `json:"headers"` // {} when none
	// Body is the body as JSON when it is JSON, else as a string when it
	// is UTF-8 text; null when empty or binary. BodyBase64 is a binary
	// body, else null.
	Body       any       `json:"body"`
	BodyBase64 []byte    `json:"body_base64"`
	Attempts   int       `json:"attempts"`
	LastError  string    `json:"last_error"`
	ReceivedAt time.Time `json:"received_at"`
	FinishedAt time.Time `json:"finished_at"` // when it went DEAD or RECOVERY_REQUIRED
}

// JSON is e as the list commands print it with --output json.
func (e Entry) JSON() EntryJSON {
	out := EntryJSON{Source: e.Source, MsgSource: e.MsgSource, ID: e.ID, State: e.State, Type: e.Type, OrderKey: e.OrderKey,
		Origin: e.Origin, Headers: e.Headers, Attempts: e.Attempts, LastError: e.LastError,
		ReceivedAt: e.ReceivedAt.UTC(), FinishedAt: e.FinishedAt.UTC()}
	if out.Headers == nil {
		out.Headers = map[string]string{}
	}
	switch {
	case len(e.Body) == 0:
	case json.Valid(e.Body):
		out.Body = json.RawMessage(e.Body)
	case utf8.Valid(e.Body):
		out.Body = string(e.Body)
	default:
		out.BodyBase64 = e.Body
	}
	return out
}

// StatsJSON is `worker inbox stats --output json`; docs/operations.md
// shows it.
type StatsJSON struct {
	// Sources counts messages by source, then state; every state present,
	// and every configured source even without messages.
	Sources map[string]map[string]int64 `json:"sources"`
	// Totals counts messages by state over every source listed.
	Totals map[string]int64 `json:"totals"`
	// OldestUnfinished is the oldest unfinished claim (RECEIVED,
	// PROCESSING or FAILED); null when there is none.
	OldestUnfinished *OldestClaimJSON `json:"oldest_unfinished"`
}

// OldestClaimJSON is the oldest unfinished claim of StatsJSON.
type OldestClaimJSON struct {
	Source     string    `json:"source"`
	ReceivedAt time.Time `json:"received_at"`
	AgeSeconds float64   `json:"age_seconds"` // on the database clock
}

// JSON is s as `inbox stats --output json` prints it.
func (s Stats) JSON() StatsJSON {
	out := StatsJSON{Sources: s.BySource, Totals: map[string]int64{}}
	if out.Sources == nil {
		out.Sources = map[string]map[string]int64{}
	}
	for _, st := range AllStates {
		out.Totals[st] = s.Total(st)
	}
	if !s.Oldest.IsZero() {
		out.OldestUnfinished = &OldestClaimJSON{Source: s.OldestSource, ReceivedAt: s.Oldest.UTC(), AgeSeconds: s.OldestAge.Seconds()}
	}
	return out
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
