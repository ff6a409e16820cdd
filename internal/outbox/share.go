package outbox

import (
	"hash/maphash"
	"sync"
)

// shares splits the windows that a relay's loops read between them, by a
// hash of the aggregate: each loop locks only the heads of its own share.
// Without it every loop of a process tried to lock the same oldest heads,
// found most of them held by its siblings, widened its window and tried
// again: draining 200,000 events with 4 loops, the relay read 6.3 window
// rows and sent the lock statement 2.2 candidate heads per event, where one
// loop reads 1 and sends 0.8, and the database spent the difference. Now a
// window read serves the siblings too: the reader keeps its own share and
// leaves the others theirs, and a sibling claims from its share without
// reading a window of its own.
//
// A share can be a little older than the claim that uses it. That is as
// safe as the window itself, which is read in a statement of its own: an
// aggregate gains no earlier unfinished event later (new events get larger
// ids), and the lock statement rechecks every row, so a head that was
// published meanwhile is not taken again. Other processes are not
// coordinated; SKIP LOCKED keeps them apart as before.
type shares struct {
	seed maphash.Seed
	wake []chan struct{} // the loops' wake-up channels, by share
	// Every loop takes, splits, gives back and holds through the methods
	// below, from its own goroutine: mu guards the fields after it.
	mu    sync.Mutex
	queue [][]*candidate              // per loop: candidates not taken yet, oldest head first
	gen   uint64                      // bumped when a window replaces the queues
	held  []map[aggregateKey]struct{} // per loop: the aggregates its current batch holds
}

func newShares(wake []chan struct{}) *shares {
	return &shares{
		seed: maphash.MakeSeed(), wake: wake,
		queue: make([][]*candidate, len(wake)), held: make([]map[aggregateKey]struct{}, len(wake)),
	}
}

// hold records the aggregates of loop's current batch (none: it holds
// nothing). A window read meanwhile still shows their events as unfinished,
// but they are the loop's own batch, being published: handing them to it
// as its next share would make it claim heads that are gone by then.
func (s *shares) hold(loop int, runs [][]claimedRow) {
	var held map[aggregateKey]struct{}
	if len(runs) > 0 {
		held = make(map[aggregateKey]struct{}, len(runs))
		for _, run := range runs {
			held[run[0].key()] = struct{}{}
		}
	}
	s.mu.Lock()
	s.held[loop] = held
	s.mu.Unlock()
}

// of is the loop whose share key is in.
func (s *shares) of(key aggregateKey) int {
	var h maphash.Hash
	h.SetSeed(s.seed)
	h.WriteString(key.typ)
	h.WriteByte(0)
	h.WriteString(key.id)
	return int(h.Sum64() % uint64(len(s.wake)))
}

// split hands out the candidates of a window that loop read: each loop's
// share replaces what it had left from an older window, without the
// aggregates its current batch holds, and a loop whose share is not empty
// is woken, so it does not sleep on work its sibling found. It returns
// what take returns from loop's own share; loop's own previous batch is
// committed by the time its window is read, so nothing is left out of
// that.
func (s *shares) split(cands []*candidate, loop, n, depth, spare int) ([]*candidate, uint64) {
	queue := make([][]*candidate, len(s.wake))
	s.mu.Lock()
	for _, c := range cands {
		k := s.of(c.head.key)
		if _, held := s.held[k][c.head.key]; held && k != loop {
			continue
		}
		queue[k] = append(queue[k], c)
	}
	var found []int
	for k, q := range queue {
		if k != loop && len(q) > 0 {
			found = append(found, k)
		}
	}
	s.queue = queue
	s.gen++
	s.mu.Unlock()
	for _, k := range found {
		wake(s.wake[k])
	}
	return s.take(loop, n, depth, spare)
}

// take removes and returns candidates from loop's share, oldest head first,
// as many as make up n events (each is its head and its run, cut to depth
// events as the claim cuts it; 0: no bound), and spare times as many
// again, with the queue's generation. Counting whole runs where the claim
// publishes only depth events of each, two loops over 200 aggregates
// claimed one to eight heads a batch and drained a 50 ms sink at a fifth
// of one loop's rate. The rest stays for the loop's next claim. Nil when
// the share is empty: read a window.
func (s *shares) take(loop, n, depth, spare int) ([]*candidate, uint64) {
	s.mu.Lock()
	defer s.mu.Unlock()
	q := s.queue[loop]
	i, events := 0, 0
	for i < len(q) && events < n*(1+spare) {
		run := 1 + len(q[i].run)
		if depth > 0 {
			run = min(run, depth)
		}
		events += run
		i++
	}
	if i == 0 {
		return nil, s.gen
	}
	s.queue[loop] = q[i:]
	return q[:i:i], s.gen
}

// spareHeads is how many heads a claim from a share offers the lock
// statement beyond those it needs, per head it needs, when the sink is slow
// (pace.spares). Other processes' loops hold some of a share's
// aggregates, and more of them the fewer aggregates there are: three
// replicas of two loops over 200 aggregates locked 17 of the 63 heads they
// asked for, and drained a 20 ms sink at 0.46 of the ideal. The statement
// locks heads oldest first and stops when it has enough, but the spares'
// ctids and runs still cost it: two loops with an instant sink that
// offered them drained 27,300 events/s against 30,400.
const spareHeads = 2

// giveBack returns to the front of loop's share the candidates that a
// claim took and its lock statement never came to, unless a window
// replaced the share since take (gen): the window's are newer.
func (s *shares) giveBack(loop int, gen uint64, rest []*candidate) {
	if len(rest) == 0 {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.gen == gen {
		s.queue[loop] = append(rest[:len(rest):len(rest)], s.queue[loop]...)
	}
}
