package main

import (
	"context"
	"os"
	"slices"
	"strconv"
	"strings"
	"time"
)

// clockTick is USER_HZ, the unit of /proc/<pid>/stat's CPU times; 100 on
// every Linux this runs on.
const clockTick = 10 * time.Millisecond

// procCPU is the user and system CPU time a process has used, or 0 if it
// is gone or unreadable (a server on another machine).
func procCPU(pid int) time.Duration {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	if len(f) < 13 {
		return 0
	}
	u, _ := strconv.ParseInt(f[11], 10, 64) // utime, field 14 of stat
	k, _ := strconv.ParseInt(f[12], 10, 64) // stime, field 15
	return time.Duration(u+k) * clockTick
}

func us(d time.Duration) float64 { return float64(d) / float64(time.Microsecond) }

// cpuMeter measures the CPU of the workers and of the database backends
// serving them (every backend of the benchmark's database but the
// benchmark's own connection) from its start to perEvent. PostgreSQL on
// another machine reads as 0.
type cpuMeter struct {
	b       *bench
	workers []int
	start   map[int]time.Duration
}

func (b *bench) cpuMeter(ctx context.Context, ps []*proc) *cpuMeter {
	m := &cpuMeter{b: b, start: map[int]time.Duration{}}
	for _, p := range ps {
		m.workers = append(m.workers, p.cmd.Process.Pid)
	}
	for _, pid := range append(m.backends(ctx), m.workers...) {
		m.start[pid] = procCPU(pid)
	}
	return m
}

func (m *cpuMeter) backends(ctx context.Context) []int {
	rows, err := m.b.conn.Query(ctx, `SELECT pid FROM pg_stat_activity
		WHERE datname = current_database() AND pid <> pg_backend_pid() AND backend_type = 'client backend'`)
	if err != nil {
		return nil
	}
	defer rows.Close()
	var pids []int
	for rows.Next() {
		var pid int
		if rows.Scan(&pid) == nil {
			pids = append(pids, pid)
		}
	}
	return pids
}

// perEvent returns the database's and the workers' CPU per event in µs.
func (m *cpuMeter) perEvent(ctx context.Context, n int) (db, worker float64) {
	var dbT, wT time.Duration
	for _, pid := range m.backends(ctx) {
		dbT += procCPU(pid) - m.start[pid]
	}
	for _, pid := range m.workers {
		wT += procCPU(pid) - m.start[pid]
	}
	return us(dbT) / float64(n), us(wT) / float64(n)
}

func sortTimes(ts []time.Time) { slices.SortFunc(ts, func(a, b time.Time) int { return a.Compare(b) }) }
