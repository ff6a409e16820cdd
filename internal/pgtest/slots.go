package pgtest

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
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

// slotWait bounds the wait for slots. Two running tests that hold slots
// and each wait for more than is left would wait for each other; after
// slotWait a test goes on without its slots and says so.
const slotWait = 2 * time.Minute

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

// held is what each running test reserved in this process.
var (
	heldMu sync.Mutex
	held   = map[testing.TB]int{}
)

// Reserve waits until n more of the suite's connections are free and keeps
// them for t until it ends. Call it before opening connections this package
// does not count, such as a worker process's. A test never holds more than
// the whole share: beyond it, Reserve returns at once.
func Reserve(t testing.TB, n int) {
	t.Helper()
	limit := maxConns(t)
	heldMu.Lock()
	first := held[t] == 0
	n = min(n, limit-held[t])
	held[t] += max(n, 0)
	heldMu.Unlock()
	if n <= 0 {
		return
	}
	files, waited := takeSlots(t, limit, n, first)
	if waited > time.Second {
		t.Logf("pgtest: waited %s for %d of the suite's %d connections (WORKER_TEST_MAX_CONNS)", waited.Round(time.Millisecond), n, limit)
	}
	t.Cleanup(func() {
		for _, f := range files {
			f.Close() // closing the last descriptor releases the flock
		}
		heldMu.Lock()
		if held[t] -= n; held[t] <= 0 {
			delete(held, t)
		}
		heldMu.Unlock()
	})
}

// takeSlots locks n of the limit slot files, all at once or none, so a
// waiting test holds nothing the others need. A test's first request waits
// behind the gate, which its holder keeps while it waits: a large request is
// then not starved by a stream of new tests, and the running ones, which
// skip the gate when they ask for more, finish and give their slots back.
func takeSlots(t testing.TB, limit, n int, first bool) ([]*os.File, time.Duration) {
	t.Helper()
	dir := slotDir(t)
	start := time.Now()
	deadline := start.Add(slotWait)
	if first {
		gate := openSlot(t, filepath.Join(dir, "gate"))
		defer gate.Close()
		for !tryLock(t, gate) {
			if time.Now().After(deadline) {
				t.Logf("pgtest: no connection slot after %s; going on without", slotWait)
				return nil, time.Since(start)
			}
			pause()
		}
	}
	for {
		var files []*os.File
		for i := 0; i < limit && len(files) < n; i++ {
			f := openSlot(t, filepath.Join(dir, fmt.Sprintf("slot-%03d", i)))
			if tryLock(t, f) {
				files = append(files, f)
			} else {
				f.Close()
			}
		}
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
