package pgtest

import (
	"context"
	"fmt"
	"net/url"
	"runtime"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"
)

// A test waits for admission until another gives its slots back.
func TestAdmissionWaitsForFreeSlots(t *testing.T) {
	// A server URL of its own gives this test slots of its own.
	t.Setenv("WORKER_TEST_DATABASE_URL", AdminURL()+"&application_name=slots-test")
	t.Setenv("WORKER_TEST_MAX_CONNS", "5")
	taken := make(chan int)
	t.Run("holder", func(h *testing.T) {
		Need(h, 3)
		go func() {
			files, err := lockSlots(context.Background(), "waiter", 3)
			if err != nil {
				t.Error(err)
			}
			for _, f := range files {
				f.Close()
			}
			taken <- len(files)
		}()
		select {
		case n := <-taken:
			h.Fatalf("took %d slots while 3 of 5 were held", n)
		case <-time.After(300 * time.Millisecond):
		}
	}) // the holder's slots are given back here
	select {
	case n := <-taken:
		if n != 3 {
			t.Fatalf("took %d slots, want 3", n)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("3 slots still not taken 10s after the holder gave its back")
	}
}

// fatalRecorder is a test that records its fatal failure instead of
// failing the real one.
type fatalRecorder struct {
	testing.TB
	name  string
	fatal string
}

func (r *fatalRecorder) Name() string { return r.name }

func (r *fatalRecorder) Fatalf(format string, args ...any) { r.Fatal(fmt.Sprintf(format, args...)) }

func (r *fatalRecorder) Fatal(args ...any) {
	r.fatal = fmt.Sprint(args...)
	runtime.Goexit()
}

// run calls f as r's body, on a goroutine of its own as go test does, so
// that Fatalf ends only f.
func (r *fatalRecorder) run(f func(testing.TB)) {
	done := make(chan struct{})
	go func() {
		defer close(done)
		f(r)
	}()
	<-done
}

// A test that opens more than it was admitted for waits for the rest;
// what a subtest opens counts against its admitted parent until the subtest
// gives it back.
func TestReservationsBeyondTheAdmissionWait(t *testing.T) {
	t.Setenv("WORKER_TEST_DATABASE_URL", AdminURL()+"&application_name=slots-test-2")
	t.Setenv("WORKER_TEST_MAX_CONNS", "10")
	parent := &fatalRecorder{TB: t, name: t.Name() + "/parent"}
	child := &fatalRecorder{TB: t, name: parent.name + "/child"}
	parent.run(func(tb testing.TB) { Need(tb, 5) })
	child.run(func(tb testing.TB) { Reserve(tb, 4)() })
	child.run(func(tb testing.TB) { Reserve(tb, 5) })
	if parent.fatal != "" || child.fatal != "" {
		t.Fatalf("within the admission: %q %q", parent.fatal, child.fatal)
	}
	holds := func() int {
		admittedMu.Lock()
		defer admittedMu.Unlock()
		return len(admitted[parent.name].files)
	}
	if n := holds(); n != 5 {
		t.Fatalf("the parent holds %d slots after its subtests' reservations, want its 5", n)
	}
	other := &fatalRecorder{TB: t, name: t.Name() + "/other"}
	other.run(func(tb testing.TB) { Reserve(tb, 5) })
	grown := make(chan struct{})
	go parent.run(func(tb testing.TB) { Reserve(tb, 1); close(grown) })
	select {
	case <-grown:
		t.Fatal("grew beyond the admission while the share had no free slot")
	case <-time.After(300 * time.Millisecond):
	}
	// other's slots are its admission's: they are given back when it ends,
	// which a fatalRecorder's never does; give one back by hand.
	admittedMu.Lock()
	for _, f := range admitted[other.name].files[:1] {
		f.Close()
	}
	admittedMu.Unlock()
	select {
	case <-grown:
	case <-time.After(10 * time.Second):
		t.Fatal("still waiting to grow 10s after a slot was free")
	}
	if n := holds(); n != 6 {
		t.Errorf("the parent holds %d slots, want 6", n)
	}
	parent.run(func(tb testing.TB) { Need(tb, 8) })
	if !strings.Contains(parent.fatal, "call Need before the test opens its first database") {
		t.Errorf("Need after admission: %q", parent.fatal)
	}
	greedy := &fatalRecorder{TB: t, name: t.Name() + "/greedy"}
	greedy.run(func(tb testing.TB) { Need(tb, 11) })
	if !strings.Contains(greedy.fatal, "needs 11 more connections, more than the suite's share of 10") {
		t.Errorf("beyond the share: %q", greedy.fatal)
	}
}

// A test that went on beyond the share after waiting in vain does not wait
// again for the same connections, each time it reserves them anew; it
// still waits for more than those.
func TestGoingOnBeyondTheShareIsNotWaitedForAgain(t *testing.T) {
	t.Setenv("WORKER_TEST_DATABASE_URL", AdminURL()+"&application_name=slots-test-overdrawn")
	t.Setenv("WORKER_TEST_MAX_CONNS", "6")
	grower := &fatalRecorder{TB: t, name: t.Name() + "/grower"}
	other := &fatalRecorder{TB: t, name: t.Name() + "/other"}
	grower.run(func(tb testing.TB) { Need(tb, 3) })
	other.run(func(tb testing.TB) { Need(tb, 3) }) // the share is full
	admittedMu.Lock()
	a := admitted[grower.name]
	admittedMu.Unlock()
	if err := a.take(context.Background(), grower.name, &a.reserved, 5, 100*time.Millisecond); err != nil {
		t.Fatalf("after growWait: %v, want to go on", err)
	}
	a.give(&a.reserved, 5)
	// Waiting now would outlast ctx, and fail.
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	if err := a.take(ctx, grower.name, &a.reserved, 5, time.Hour); err != nil {
		t.Fatalf("the same reservation again: %v, want no wait", err)
	}
	short, cancel2 := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel2()
	if err := a.take(short, grower.name, &a.reserved, 1, time.Hour); err == nil {
		t.Fatal("one more than it went on with was not waited for")
	}
}

// A server with no free connection is reported as that, not as a server
// that is not running. A role's connection limit gets the same refusal
// (SQLSTATE 53300) as max_connections without exhausting the server.
func TestNoFreeConnectionIsReportedAsSuch(t *testing.T) {
	ctx := context.Background()
	admin := connect(t, ctx, AdminURL())
	role := "worker_test_full_" + randHex(4)
	if _, err := admin.Exec(ctx, fmt.Sprintf("CREATE ROLE %s LOGIN CONNECTION LIMIT 0", role)); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if _, err := admin.Exec(ctx, "DROP ROLE "+role); err != nil {
			t.Errorf("drop role %s: %v", role, err)
		}
		admin.Close(ctx)
	})
	u, err := url.Parse(AdminURL())
	if err != nil {
		t.Fatal(err)
	}
	u.User = url.User(role)
	_, err = pgx.Connect(ctx, u.String())
	if !tooManyClients(err) {
		t.Fatalf("want SQLSTATE 53300, got %v", err)
	}
	msg := connectFailure(u.String(), err)
	if !strings.Contains(msg, "no free connection (too many clients, SQLSTATE 53300)") || strings.Contains(msg, "is required") {
		t.Errorf("message: %s", msg)
	}
}

// Every connection a test's pools open takes one of its slots while it is
// open, beyond its admission too: the pool's size is not what counts.
func TestPoolConnectionsTakeSlots(t *testing.T) {
	t.Setenv("WORKER_TEST_DATABASE_URL", AdminURL()+"&application_name=slots-test-3")
	t.Setenv("WORKER_TEST_MAX_CONNS", "10")
	db := New(t)
	pool := db.NewPool(t, 8)
	ctx := context.Background()
	state := func() (dialed, slots int) {
		admittedMu.Lock()
		defer admittedMu.Unlock()
		a := admitted[t.Name()]
		return a.dialed, len(a.files)
	}
	if dialed, slots := state(); dialed != 0 || slots != 1+PoolConns {
		t.Fatalf("after New: %d dialed of %d slots, want 0 of %d", dialed, slots, 1+PoolConns)
	}
	var conns []*pgxpool.Conn
	for range 8 {
		c, err := pool.Acquire(ctx)
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	if dialed, slots := state(); dialed != 8 || slots != 8 {
		t.Errorf("8 connections open: %d dialed of %d slots, want 8 of 8", dialed, slots)
	}
	for _, c := range conns {
		c.Release()
	}
	pool.Close()
	if dialed, _ := state(); dialed != 0 {
		t.Errorf("pool closed: %d dialed, want 0", dialed)
	}
}

// A worker process reserved beside a test's database takes slots of its
// own: the database's stay for what the test dials, so its queries never
// wait while the worker runs.
func TestReservationsKeepTheDatabasesSlots(t *testing.T) {
	t.Setenv("WORKER_TEST_DATABASE_URL", AdminURL()+"&application_name=slots-test-4")
	t.Setenv("WORKER_TEST_MAX_CONNS", "20")
	db := New(t)
	Reserve(t, 7)
	slots := func() int {
		admittedMu.Lock()
		defer admittedMu.Unlock()
		return len(admitted[t.Name()].files)
	}
	if n := slots(); n != 1+PoolConns+7 {
		t.Fatalf("holds %d slots with a reservation of 7, want %d", n, 1+PoolConns+7)
	}
	var conns []*pgxpool.Conn
	for range PoolConns {
		c, err := db.Pool.Acquire(context.Background())
		if err != nil {
			t.Fatal(err)
		}
		conns = append(conns, c)
	}
	defer func() {
		for _, c := range conns {
			c.Release()
		}
	}()
	if n := slots(); n != 1+PoolConns+7 {
		t.Errorf("holds %d slots with its pool full, want still %d", n, 1+PoolConns+7)
	}
}

// A test alone holds the whole share.
func TestAloneHoldsTheShare(t *testing.T) {
	t.Setenv("WORKER_TEST_DATABASE_URL", AdminURL()+"&application_name=slots-test-5")
	t.Setenv("WORKER_TEST_MAX_CONNS", "10")
	Alone(t)
	admittedMu.Lock()
	defer admittedMu.Unlock()
	if n := len(admitted[t.Name()].files); n != 10 {
		t.Errorf("holds %d slots, want the share of 10", n)
	}
}
