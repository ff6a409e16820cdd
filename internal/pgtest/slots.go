package pgtest

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"log"
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
// packages run in parallel processes. So that the suite never opens more
// connections than its share, every connection it opens takes a slot of
// the share first, waiting until one is free:
//
//   - A test is admitted for a number of slots before its first database
//     (New admits for that database's admin session and pool). Every
//     connection opened through this package's databases, pools and
//     connections, and through anything that copies their configuration
//     (listeners, River's pool, a lease pool), takes one of its slots while
//     it is open. A test that needs more waits for them.
//   - What a test cannot see connect, a worker process, it reserves
//     (Reserve): the most that process can hold.
//   - Tests waiting for admission queue behind one gate, so a large
//     request is not starved by a stream of small ones. A running test
//     that needs more takes them as they free up, ahead of that queue. It
//     can only be kept waiting by others that hold slots and wait for more;
//     after growWait (dialWait for a connection the code under test
//     dials) it goes on without them and says so. A test that
//     starts several worker processes declares its peak with Need before
//     its first database, and is admitted for all of it; one that measures
//     the worker under a load of its own runs Alone.
//   - Subtests count against the nearest admitted test above them. A test
//     with none admits itself. An admitted test must not wait for parallel
//     subtests: they would need one of go test's -parallel places, which
//     tests waiting for admission hold.
//
// The slots are files locked with flock, shared by every test process on
// the machine, and released by the kernel when a process dies.

// DefaultMaxConns is the suite's share of the server when
// WORKER_TEST_MAX_CONNS is unset: PostgreSQL's default max_connections of
// 100 less 75 held by others. Every connection the suite opens is counted
// in it, the short admin sessions that create and drop databases included.
const DefaultMaxConns = 25

// PoolConns is the size of a test database's pool, and of NewPool's when it
// is given 0: pgxpool's own default grows with the machine's cores.
const PoolConns = 4

// admitWait bounds a wait for slots. Waiting longer means tests
// hold slots without running (see above).
const admitWait = 10 * time.Minute

// growWait bounds a wait for more slots by a test that holds some.
// dialWait is the shorter bound for a connection the code under test dials
// beyond its test's slots: a wait there stalls that code (a relay, a
// listener), and a cancel request, which takes no server connection, dials
// the same way.
const (
	growWait = 30 * time.Second
	dialWait = time.Second
)

var errGrowWait = errors.New("pgtest: waited too long to grow")

// admission is what an admitted test and its subtests may hold: the slots
// it locked, the connections it dials and those it reserved (Reserve).
// Admitted for a database (New), its first slots stay for what it dials,
// so that starting a worker process, which waits for the slots it
// reserves before it starts, leaves the test's own queries none to wait
// for.
type admission struct {
	files            []*os.File
	dialed, reserved int
	base             int // slots kept for what it dials
	// overdrawn counts the connections it went on with after waiting
	// growWait in vain: they need no slot, or every later reservation of
	// the same size would wait as long again.
	overdrawn int
	ended     bool
}

// need is how many slots the admission's connections take.
func (a *admission) need() int { return a.reserved + max(a.dialed, a.base) }

var (
	admittedMu sync.Mutex
	admitted   = map[string]*admission{} // by test name
)

// admittedFor returns the admission t counts against: its own or its
// nearest admitted ancestor's, and that test's name.
func admittedFor(t testing.TB) (string, *admission) {
	for name := t.Name(); ; {
		if a, ok := admitted[name]; ok {
			return name, a
		}
		i := strings.LastIndex(name, "/")
		if i < 0 {
			return "", nil
		}
		name = name[:i]
	}
}

// Need admits t for n connections: the most it and its subtests hold at
// once, so that it never waits for more while it holds some. It waits
// until they are free in the suite's share, and must come before t's first
// reservation.
func Need(t testing.TB, n int) {
	t.Helper()
	admittedMu.Lock()
	name, a := admittedFor(t)
	admittedMu.Unlock()
	if a != nil {
		t.Fatalf("pgtest: Need(%d) in %s, already admitted as part of %s: call Need before the test opens its first database", n, t.Name(), name)
	}
	admit(t, n, 0)
}

// Alone admits t for the suite's whole share, so that no other test that
// uses the database runs meanwhile: for a test that measures the worker
// under a load of its own making, which the suite's other tests, competing
// for the same cores, would distort. Like Need, it comes first.
func Alone(t testing.TB) {
	t.Helper()
	n, err := maxConns()
	if err != nil {
		t.Fatal(err)
	}
	Need(t, n)
}

// Reserve counts n connections that t is about to open outside this
// package (a worker process's) until release is called or t ends. A test
// not admitted yet is admitted for n; one whose admission has fewer than n
// free waits for the rest.
func Reserve(t testing.TB, n int) (release func()) {
	t.Helper()
	a := admissionOf(t, n, 0)
	if err := a.take(context.Background(), t.Name(), &a.reserved, n, growWait); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	release = func() { once.Do(func() { a.give(&a.reserved, n) }) }
	t.Cleanup(release)
	return release
}

// admissionOf returns the admission t counts against, admitting t for n
// slots, base of them kept for what it dials, if it has none.
func admissionOf(t testing.TB, n, base int) *admission {
	t.Helper()
	admittedMu.Lock()
	_, a := admittedFor(t)
	admittedMu.Unlock()
	if a == nil {
		a = admit(t, n, base)
	}
	return a
}

// take adds n connections to count (a.dialed or a.reserved), waiting up to
// wait for the slots the admission lacks.
func (a *admission) take(ctx context.Context, test string, count *int, n int, wait time.Duration) error {
	admittedMu.Lock()
	if a.ended {
		admittedMu.Unlock()
		return fmt.Errorf("pgtest: %s has ended: no connection slot for it", test)
	}
	before := a.need()
	*count += n
	short := a.need() - max(before, len(a.files)+a.overdrawn)
	admittedMu.Unlock()
	if short <= 0 {
		return nil
	}
	ctx, cancel := context.WithTimeoutCause(ctx, wait, errGrowWait)
	defer cancel()
	more, err := lockAll(ctx, short)
	if errors.Is(err, errGrowWait) {
		// Tests that hold slots and wait for more may be waiting for each
		// other: go on beyond the share rather than never.
		admittedMu.Lock()
		a.overdrawn += short
		admittedMu.Unlock()
		log.Printf("pgtest: %s waited %s for %d more connections; going on without their slots (declare its peak with Need)", test, wait, short)
		return nil
	}
	admittedMu.Lock()
	defer admittedMu.Unlock()
	if err != nil || a.ended {
		*count -= n
		for _, f := range more {
			f.Close()
		}
		if err == nil {
			err = fmt.Errorf("pgtest: %s has ended: no connection slot for it", test)
		}
		return err
	}
	a.files = append(a.files, more...)
	return nil
}

// give takes n connections off count. Their slots stay with the admission
// until its test ends.
func (a *admission) give(count *int, n int) {
	admittedMu.Lock()
	*count -= n
	admittedMu.Unlock()
}

// admit waits for n of the share's slots and records t's admission, base
// of them kept for what it dials, given back when t ends.
func admit(t testing.TB, n, base int) *admission {
	t.Helper()
	start := time.Now()
	files, err := lockSlots(context.Background(), t.Name(), n)
	if err != nil {
		t.Fatal(err)
	}
	if waited := time.Since(start); waited > time.Second {
		t.Logf("pgtest: waited %s for %d of the suite's connections (WORKER_TEST_MAX_CONNS)", waited.Round(time.Millisecond), n)
	}
	a := &admission{files: files, base: base}
	admittedMu.Lock()
	admitted[t.Name()] = a
	admittedMu.Unlock()
	// Registered before anything the test opens, so it runs after their
	// cleanups: pools closed, processes killed, databases dropped (which
	// waits until their server sessions are gone).
	t.Cleanup(func() {
		admittedMu.Lock()
		delete(admitted, t.Name())
		a.ended = true
		files := a.files
		admittedMu.Unlock()
		for _, f := range files {
			f.Close() // closing the last descriptor releases the flock
		}
	})
	return a
}

// lockSlots locks n of the share's slot files, all at once, waiting behind
// the gate until they are free, ctx ends, or admitWait has passed. The
// first waiter keeps the gate while it waits, so no one else takes the
// slots that free up meanwhile.
func lockSlots(ctx context.Context, test string, n int) ([]*os.File, error) {
	limit, err := maxConns()
	if err != nil {
		return nil, err
	}
	if n > limit {
		return nil, fmt.Errorf("pgtest: %s needs %d more connections, more than the suite's share of %d (WORKER_TEST_MAX_CONNS)", test, n, limit)
	}
	dir, err := slotDir()
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeoutCause(ctx, admitWait, fmt.Errorf("pgtest: %s waited %s for %d of the suite's %d connections: tests hold them without running "+
		"(an admitted test waiting for its parallel subtests, tests that grow without declaring their peak with Need?)", test, admitWait, n, limit))
	defer cancel()
	gate, err := os.OpenFile(filepath.Join(dir, "gate"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, fmt.Errorf("pgtest: connection slots: %w", err)
	}
	defer gate.Close()
	for {
		ok, err := tryLock(gate)
		if err != nil {
			return nil, err
		}
		if ok {
			break
		}
		if err := pause(ctx); err != nil {
			return nil, err
		}
	}
	return lockAll(ctx, n)
}

// lockAll locks n of the share's slot files, all at once, as soon as they
// are free. A test that grows calls it without queueing behind the gate: a
// running test must finish before those waiting to start. Holding some
// while it waits for the rest would let two growing tests split the free
// slots and wait for each other.
func lockAll(ctx context.Context, n int) ([]*os.File, error) {
	limit, err := maxConns()
	if err != nil {
		return nil, err
	}
	dir, err := slotDir()
	if err != nil {
		return nil, err
	}
	for {
		files, err := lockFree(dir, limit, n)
		if err == nil && len(files) == n {
			return files, nil
		}
		for _, f := range files {
			f.Close()
		}
		if err == nil {
			err = pause(ctx)
		}
		if err != nil {
			return nil, err
		}
	}
}

// maxConns is the suite's share: WORKER_TEST_MAX_CONNS or DefaultMaxConns.
func maxConns() (int, error) {
	v := os.Getenv("WORKER_TEST_MAX_CONNS")
	if v == "" {
		return DefaultMaxConns, nil
	}
	n, err := strconv.Atoi(v)
	if err != nil || n < PoolConns+1 {
		return 0, fmt.Errorf("pgtest: WORKER_TEST_MAX_CONNS=%q: want a whole number of connections, at least %d", v, PoolConns+1)
	}
	return n, nil
}

// lockFree locks up to n of the slot files that are free now.
func lockFree(dir string, limit, n int) ([]*os.File, error) {
	var files []*os.File
	for i := 0; i < limit && len(files) < n; i++ {
		f, err := os.OpenFile(filepath.Join(dir, fmt.Sprintf("slot-%03d", i)), os.O_CREATE|os.O_RDWR, 0o600)
		if err != nil {
			return files, fmt.Errorf("pgtest: connection slots: %w", err)
		}
		ok, err := tryLock(f)
		if ok {
			files = append(files, f)
			continue
		}
		f.Close()
		if err != nil {
			return files, err
		}
	}
	return files, nil
}

// slotDir is one directory of slots per server, so suites against
// different servers do not wait for each other.
func slotDir() (string, error) {
	sum := sha256.Sum256([]byte(AdminURL()))
	dir := filepath.Join(os.TempDir(), "worker-pgtest-slots-"+hex.EncodeToString(sum[:6]))
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", fmt.Errorf("pgtest: connection slots: %w", err)
	}
	return dir, nil
}

// tryLock takes f's exclusive flock without waiting. flock locks belong to
// the open file, so two opens in one process exclude each other too.
func tryLock(f *os.File) (bool, error) {
	switch err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err {
	case nil:
		return true, nil
	case syscall.EWOULDBLOCK:
		return false, nil
	default:
		return false, fmt.Errorf("pgtest: connection slots: flock %s: %w", f.Name(), err)
	}
}

// pause is the poll period while waiting for a slot.
func pause(ctx context.Context) error {
	select {
	case <-ctx.Done():
		return context.Cause(ctx)
	case <-time.After(20 * time.Millisecond):
		return nil
	}
}
