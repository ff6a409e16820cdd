package startup

import (
	"os"
	"strings"
	"testing"
	"time"
)

// Every duration setting has a bound in code, validation refuses a value
// just below it (naming the setting), and docs/configuration.md states it
// in the setting's row: "positive", "at least `1m`" or "longer than `1s`".
func TestDurationBoundsAreDocumented(t *testing.T) {
	t.Parallel()
	doc, err := os.ReadFile("../../docs/configuration.md")
	if err != nil {
		t.Fatal(err)
	}
	rows := map[string]string{}
	for line := range strings.SplitSeq(string(doc), "\n") {
		if cells := strings.Split(line, " | "); len(cells) > 1 && strings.HasPrefix(line, "| `APP_") {
			rows[strings.Trim(cells[0], "| `")] = line
		}
	}
	bounds := durationBounds()
	for _, s := range settings() {
		if _, ok := s.Default.(time.Duration); !ok {
			continue
		}
		b, ok := bounds[s.Key]
		if !ok {
			t.Errorf("%s: a duration setting without a bound in code (DurationMinimums, ownDurationBounds)", s.Key)
			continue
		}
		if row := rows[s.Env()]; !strings.Contains(row, b.doc()) {
			t.Errorf("%s: its row in docs/configuration.md does not say %q:\n%s", s.Env(), b.doc(), row)
		}
		below := b.min - time.Nanosecond
		if b.above {
			below = b.min
		}
		env := append(sinkFor(s.Key), s.Env()+"="+below.String())
		if _, err := LoadConfig(writeFile(t, "{}"), env); err == nil || !strings.Contains(err.Error(), s.Env()+"="+below.String()) {
			t.Errorf("%s=%s: LoadConfig = %v, want a refusal that names it", s.Env(), below, err)
		}
	}
}

// sinkFor selects the sink whose section key belongs to: its keys are
// checked only when it is the sink.
func sinkFor(key string) []string {
	for _, sink := range []string{"webhook", "nats", "rabbitmq", "kafka"} {
		if strings.HasPrefix(key, "outbox."+sink+".") {
			env := []string{"APP_OUTBOX_SINK=" + sink}
			if sink == "webhook" {
				env = append(env, "APP_OUTBOX_WEBHOOK_URL=http://127.0.0.1:1/hook")
			}
			return env
		}
	}
	return nil
}
