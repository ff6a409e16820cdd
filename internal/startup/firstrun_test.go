package startup

import (
	"fmt"
	"net"
	"regexp"
	"strconv"
	"strings"
	"testing"

	"github.com/worker-dev/worker/internal/opsserver"
	"github.com/worker-dev/worker/internal/tasks"
)

// The ready line says where to look: the ops server's URL, its /metrics,
// and River UI's URL where the UI is on, from the addresses bound.
func TestReadyLineSaysWhereToLook(t *testing.T) {
	t.Parallel()
	listen := func(addr string) net.Listener {
		ln, err := net.Listen("tcp", addr)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { ln.Close() })
		return ln
	}
	ops, wild, ui := listen("127.0.0.1:0"), listen(":0"), listen("127.0.0.1:0")
	port := func(ln net.Listener) string { return strconv.Itoa(ln.Addr().(*net.TCPAddr).Port) }
	for _, c := range []struct {
		name    string
		servers []listening
		want    string
	}{
		{"UI off", []listening{{ln: ops, name: "ops"}},
			"ops_url=http://127.0.0.1:" + port(ops) + " metrics_url=http://127.0.0.1:" + port(ops) + "/metrics"},
		{"every interface", []listening{{ln: wild, name: "ops"}},
			"ops_url=http://localhost:" + port(wild) + " metrics_url=http://localhost:" + port(wild) + "/metrics"},
		{"UI on the ops server", []listening{{ln: ops, name: "ops", ui: true}},
			"ops_url=http://127.0.0.1:" + port(ops) + " metrics_url=http://127.0.0.1:" + port(ops) + "/metrics riverui_url=http://127.0.0.1:" + port(ops) + "/riverui/"},
		{"UI on its own address", []listening{{ln: ops, name: "ops"}, {ln: ui, name: "River UI", ui: true}},
			"ops_url=http://127.0.0.1:" + port(ops) + " metrics_url=http://127.0.0.1:" + port(ops) + "/metrics riverui_url=http://127.0.0.1:" + port(ui) + "/riverui/"},
	} {
		attrs := whereToLook(c.servers)
		var got []string
		for i := 0; i+1 < len(attrs); i += 2 {
			got = append(got, fmt.Sprintf("%v=%v", attrs[i], attrs[i+1]))
		}
		if strings.Join(got, " ") != c.want {
			t.Errorf("%s: %s, want %s", c.name, strings.Join(got, " "), c.want)
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

var connRow = regexp.MustCompile(`(?m)^\| (.+?) \| \**(\d+)\**(?: \+ 1 to Redis)? \|`)

// docs/operations.md's table of a replica's connections holds the sizes
// the code uses, and its total is what MaxDBConns counts for the busiest
// default replica: multi-instance with postgres leases, the outbox and
// tasks on.
func TestConnectionTableAsCounted(t *testing.T) {
	t.Parallel()
	page := readFile(t, "../../docs/operations.md")
	_, section, _ := strings.Cut(page, "\n## Connections\n")
	section, _, _ = strings.Cut(section, "\n## ")
	rows := map[string]int{}
	for _, m := range connRow.FindAllStringSubmatch(section, -1) {
		n, _ := strconv.Atoi(m[2])
		rows[m[1]] = n
	}
	cfg, err := LoadConfig("", []string{"APP_MULTI_INSTANCE_ENABLED=true", "APP_LOCK_PROVIDER=postgres"})
	if err != nil {
		t.Fatal(err)
	}
	total := cfg.MaxDBConns()
	for part, want := range map[string]int{
		"main pool (`database.max_conns`)": cfg.Database.MaxConns,
		"readiness probe":                  opsserver.ProbePoolConns,
		"lease pool":                       leasePoolConns,
		"**total**":                        total,
	} {
		if got, ok := rows[part]; !ok || got != want {
			t.Errorf("docs/operations.md, connections of %q: %d (found: %v), want %d", part, got, ok, want)
		}
	}
	sum := 0
	for part, n := range rows {
		if part != "**total**" && !strings.HasPrefix(part, "Redis") {
			sum += n
		}
	}
	if sum != total {
		t.Errorf("docs/operations.md: the PostgreSQL rows add up to %d, want the total %d (%v)", sum, total, rows)
	}
	if want := fmt.Sprintf("(replicas + maxSurge) × %d", total); !strings.Contains(section, want) {
		t.Errorf("docs/operations.md: no %q", want)
	}
	riverPool := tasks.MaxConns - 1 // its listener is the one more
	if rows["River's pool"] != riverPool || rows["River's listener"] != 1 {
		t.Errorf("docs/operations.md: River's pool %d and listener %d, want %d and 1", rows["River's pool"], rows["River's listener"], riverPool)
	}
	yaml := readFile(t, "../../configs/worker.yaml")
	for block, wants := range map[[2]string][]string{
		{"database:", "max_conns:"}: {
			fmt.Sprintf("a pool of %d for leases", leasePoolConns),
			fmt.Sprintf("River's own pool of %d and one LISTEN connection", riverPool),
			fmt.Sprintf("at most %d connections", total),
		},
		{"tasks:", "queues:"}: {fmt.Sprintf("River's connection pool holds %d", riverPool)},
	} {
		comment := commentBefore(t, yaml, block[0], block[1])
		for _, want := range wants {
			if !strings.Contains(comment, want) {
				t.Errorf("configs/worker.yaml, %s's comment: no %q in %q", block[1], want, comment)
			}
		}
	}
	config := strings.Join(strings.Fields(readFile(t, "../../docs/configuration.md")), " ")
	for _, want := range []string{
		fmt.Sprintf("a pool of %d for leases", leasePoolConns),
		fmt.Sprintf("River's own pool of %d and its LISTEN connection: %d in all", riverPool, total),
	} {
		if !strings.Contains(config, want) {
			t.Errorf("docs/configuration.md, database.max_conns: no %q", want)
		}
	}
}
