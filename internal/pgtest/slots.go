package pgtest

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// The suite shares its PostgreSQL with whatever else runs there, and test
// packages run in parallel processes. So that the suite never asks for more
// connections than its share, every test reserves connection slots before it
// connects and gives them back when it ends: a pool's size for each pool it
// opens, and an estimate for each worker process it starts. The slots are
// files locked with flock, shared by every test process on the machine, and
// released by the kernel when a process dies.

// DefaultMaxConns is the suite's share of the server when
// WORKER_TEST_MAX_CONNS is unset: PostgreSQL's default max_connections of
// 100 less 75 held by others, less room for the connections the slots do
// not count (the short admin sessions that create templates, pools opened
// outside this package).
const DefaultMaxConns = 20

// PoolConns is the size of a test database's pool, and of NewPool's when it
// is given 0: pgxpool's own default grows with the machine's cores.
const PoolConns = 4

// slotWait bounds a test's wait for admission; after it the test goes on
// without its slots and says so. Waiting tests take go test's -parallel
// places, so parents that hold slots while their parallel subtests wait for
// a place could otherwise keep them waiting for good.
const slotWait = 30 * time.Second

// maxConns is the suite's share: WORKER_TEST_MAX_CONNS or DefaultMaxConns.
func maxConns(t testing.TB) int {
	v := os.Getenv("WORKER_TEST_MAX_CONNS")
	if v == "" {
		return DefaultMaxConns
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < PoolConns+1 {
		t.Fatalf("pgtest: WORKER_TEST_MAX_CONNS=%q: want a whole number of connections, at least %d", v, PoolConns+1)
	}
	return n
}

// held is what each running test family (a top-level test and its
// subtests) reserved in this process.
var (
	heldMu sync.Mutex
	held   = map[string]int{}
)

// family is the top-level test t belongs to.
func family(t testing.TB) string {
	name, _, _ := strings.Cut(t.Name(), "/")
	return name
}

// Reserve keeps n more of the suite's connections for t until it ends. A
// test family's first reservation waits until they are free: that is its
// admission. Later reservations of the family
// take the slots that are free and never wait: a running test (or a
// parallel subtest, whose parent holds slots while it waits for it) must
// be able to finish and give its slots back, or tests would wait for each
// other. A family never holds more than the whole share.
func Reserve(t testing.TB, n int) {
	t.Helper()
	limit := maxConns(t)
	fam := family(t)
	heldMu.Lock()
	first := held[fam] == 0
	n = min(n, limit-held[fam])
	held[fam] += max(n, 0)
	heldMu.Unlock()
	if n <= 0 {
		return
	}
	var files []*os.File
	if first {
		var waited time.Duration
		files, waited = admit(t, limit, n)
		if waited > time.Second {
			t.Logf("pgtest: waited %s for %d of the suite's %d connections (WORKER_TEST_MAX_CONNS)", waited.Round(time.Millisecond), n, limit)
		}
	} else {
		files = lockFree(t, slotDir(t), limit, n)
	}
	t.Cleanup(func() {
		for _, f := range files {
			f.Close() // closing the last descriptor releases the flock
		}
		heldMu.Lock()
		if held[fam] -= n; held[fam] <= 0 {
			delete(held, fam)
		}
		heldMu.Unlock()
	})
}

// admit locks n of the limit slot files, all at once. Waiting tests hold
// none, and wait behind the gate, which the first of them keeps while it
// waits: a large request is not starved by a stream of small ones, and the
// running tests, which never wait, finish and give their slots back.
func admit(t testing.TB, limit, n int) ([]*os.File, time.Duration) {
	t.Helper()
	dir := slotDir(t)
	start := time.Now()
	deadline := start.Add(slotWait)
	gate := openSlot(t, filepath.Join(dir, "gate"))
	defer gate.Close()
	for !tryLock(t, gate) {
		if time.Now().After(deadline) {
			t.Logf("pgtest: no connection slot after %s; going on without", slotWait)
			return nil, time.Since(start)
		}
		pause()
	}
	for {
		files := lockFree(t, dir, limit, n)
		if len(files) == n {
			return files, time.Since(start)
		}
		for _, f := range files {
			f.Close()
		}
		if time.Now().After(deadline) {
			t.Logf("pgtest: %d connection slots not free after %s; going on without", n, slotWait)
			return nil, time.Since(start)
		}
		pause()
	}
}

// lockFree locks up to n of the slot files that are free now.
func lockFree(t testing.TB, dir string, limit, n int) []*os.File {
	t.Helper()
	var files []*os.File
	for i := 0; i < limit && len(files) < n; i++ {
		f := openSlot(t, filepath.Join(dir, fmt.Sprintf("slot-%03d", i)))
		if tryLock(t, f) {
			files = append(files, f)
		} else {
			f.Close()
		}
	}
	return files
}

// slotDir is one directory of slots per server, so suites against
// different servers do not wait for each other.
func slotDir(t testing.TB) string {
	sum := sha256.Sum256([]byte(AdminURL()))
	dir := filepath.Join(os.TempDir(), "worker-pgtest-slots-"+hex.EncodeToString(sum[:6]))
	if err := os.MkdirAll(dir, 0o700); err != nil {
		t.Fatalf("pgtest: connection slots: %v", err)
	}
	return dir
}

func openSlot(t testing.TB, path string) *os.File {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		t.Fatalf("pgtest: connection slots: %v", err)
	}
	return f
}

// tryLock takes f's exclusive flock without waiting. flock locks belong to
// the open file, so two opens in one process exclude each other too.
func tryLock(t testing.TB, f *os.File) bool {
	err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
	switch err {
	case nil:
		return true
	case syscall.EWOULDBLOCK:
		return false
	}
	t.Fatalf("pgtest: connection slots: flock %s: %v", f.Name(), err)
	return false
}

// pause is the poll period while waiting for a slot.
func pause() { time.Sleep(20 * time.Millisecond) }
