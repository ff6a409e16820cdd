package startup_test

import (
	"strings"
	"testing"
	"time"
)

// Secrets are masked where they sit (a URL's user information, a secret
// setting), never by searching the text for them: with these passwords,
// replacing their text wherever it appeared turned "exiting" into
// "exxxxxiting", "invalid configuration" into "xxxxxvalid configuration",
// "worker starting" into "xxxxx starting" and lock_provider "postgres"
// into "xxxxx". The database is unreachable on purpose: the start gets as
// far as the lines under test and exits 69 naming the database's URL.
func TestLogLinesKeepWordsThatEqualASecret(t *testing.T) {
	t.Parallel()
	cases := []struct {
		name string
		env  []string
		want int
		// check looks at the first and the last (the "exiting") line.
		check func(t *testing.T, first, last map[string]any)
	}{
		{"UI password x", []string{"APP_UI_ENABLED=true", "APP_UI_PASSWORD=x", "APP_LOCK_WAIT_TIME=five"}, 78, checkConfigExit},
		{"UI password in", []string{"APP_UI_ENABLED=true", "APP_UI_PASSWORD=in", "APP_LOCK_WAIT_TIME=five"}, 78, checkConfigExit},
		{"database password worker", []string{
			"APP_DATABASE_URL=postgres://postgres:worker@127.0.0.1:1/worker", "APP_DATABASE_CONNECT_TIMEOUT=1s",
		}, 69, func(t *testing.T, first, last map[string]any) {
			wantField(t, first, "msg", "worker starting")
			checkUnreachableExit(t, last)
		}},
		{"database password postgres", []string{
			"APP_DATABASE_URL=postgres://postgres:postgres@127.0.0.1:1/worker", "APP_DATABASE_CONNECT_TIMEOUT=1s",
			"APP_MULTI_INSTANCE_ENABLED=true", "APP_LOCK_PROVIDER=postgres",
		}, 69, func(t *testing.T, first, last map[string]any) {
			wantField(t, first, "msg", "worker starting")
			wantField(t, first, "lock_provider", "postgres")
			checkUnreachableExit(t, last)
		}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			p := startWorker(t, c.env)
			if code := p.exitCode(t, 30*time.Second); code != c.want {
				t.Fatalf("exit %d, want %d", code, c.want)
			}
			lines := checkLogLines(t, p.out.String())
			c.check(t, lines[0], lines[len(lines)-1])
			if strings.Contains(p.out.String(), "postgres:postgres@") || strings.Contains(p.out.String(), "postgres:worker@") {
				t.Errorf("a URL's password is logged:\n%s", p.out.String())
			}
		})
	}
}

func wantField(t *testing.T, line map[string]any, key, value string) {
	t.Helper()
	if line[key] != value {
		t.Errorf("%s is %q, want %q: %v", key, line[key], value, line)
	}
}

func checkConfigExit(t *testing.T, _, last map[string]any) {
	t.Helper()
	wantField(t, last, "msg", "exiting")
	wantField(t, last, "error", `invalid configuration: APP_LOCK_WAIT_TIME="five" is not a duration; want a number with a unit, such as 3s, 500ms or 5m`)
}

func checkUnreachableExit(t *testing.T, last map[string]any) {
	t.Helper()
	wantField(t, last, "msg", "exiting")
	if msg, _ := last["error"].(string); !strings.HasPrefix(msg, "database postgres://xxxxx@127.0.0.1:1/worker unreachable after") {
		t.Errorf("the error should name the URL without its user information: %q", msg)
	}
}

// `config print` masks secrets by their place too: the UI password and the
// database URL's user information, and nothing else that spells them.
func TestConfigPrintMasksSecretsByPlace(t *testing.T) {
	t.Parallel()
	code, stdout, stderr := runCLI(t, []string{
		writeConfig(t, "{}\n"), "APP_UI_PASSWORD=x", "APP_DATABASE_URL=postgres://postgres:postgres@db:5432/worker?sslmode=disable",
		"APP_MULTI_INSTANCE_ENABLED=true", "APP_LOCK_PROVIDER=postgres",
	}, "config", "print")
	if code != 0 {
		t.Fatalf("exit %d\n%s", code, stderr)
	}
	for _, w := range []string{"  password: xxxxx\n", "  url: postgres://xxxxx@db:5432/worker?xxxxx\n", "  provider: postgres\n", "  format: json\n"} {
		if !strings.Contains(stdout, w) {
			t.Errorf("config print lacks %q:\n%s", w, stdout)
		}
	}
	if strings.Contains(stdout, "postgres:postgres@") {
		t.Errorf("config print shows the database password:\n%s", stdout)
	}
}
