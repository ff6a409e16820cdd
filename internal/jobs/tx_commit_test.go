package jobs

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"net/url"
	"strings"
	"testing"
	"time"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgxpool"

	"github.com/worker-dev/worker/internal/pgtest"
)

// A COMMIT that never gets an answer is reported as such: the run cannot
// know whether its writes are in, so it must not claim they rolled back.
// Here the connection is cut as the COMMIT leaves the client, so the server
// never sees it and the writes are not in; InTx says "outcome unknown".
// A COMMIT the server answers with an error (a deferred constraint) is a
// plain failure: the server said the transaction rolled back.
func TestInTxCommitWithoutAnswerIsUnknown(t *testing.T) {
	t.Parallel()
	db := pgtest.New(t)
	createTable(t, db, `CREATE TABLE t (id int PRIMARY KEY DEFERRABLE INITIALLY DEFERRED)`)
	runCtx, _, ri := runContext(t, postgresLocker(t, db), "job")
	ctx, cancel := context.WithTimeout(runCtx, time.Minute)
	defer cancel()

	pool := poolCutAtCommit(t, db)
	err := InTx(ctx, pool, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO t VALUES (1)`)
		return err
	})
	if !errors.Is(err, ErrCommitUnknown) {
		t.Fatalf("InTx with the connection cut at COMMIT: %v, want ErrCommitUnknown", err)
	}
	if ri.committed.Load() {
		t.Error("the run believes its transaction committed")
	}
	if n := countRows(t, db, "t"); n != 0 {
		t.Fatalf("%d rows in t; the COMMIT never reached the server", n)
	}
	if got, _ := classify(ctx, err, false, false); got != OutcomeFailure {
		t.Errorf("outcome %s, want %s", got, OutcomeFailure)
	}

	err = InTx(ctx, db.Pool, func(tx pgx.Tx) error {
		_, err := tx.Exec(ctx, `INSERT INTO t VALUES (2), (2)`) // fails only at COMMIT
		return err
	})
	if err == nil || errors.Is(err, ErrCommitUnknown) {
		t.Fatalf("InTx with a COMMIT the server refused: %v, want a plain commit error", err)
	}
}

// poolCutAtCommit is a pool on db whose connections go through a proxy
// that closes both sides when the client sends COMMIT, before the server
// gets it.
func poolCutAtCommit(t *testing.T, db *pgtest.DB) *pgxpool.Pool {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	u, err := url.Parse(db.URL)
	if err != nil {
		t.Fatal(err)
	}
	target := u.Host
	go func() {
		for {
			client, err := ln.Accept()
			if err != nil {
				return
			}
			server, err := net.Dial("tcp", target)
			if err != nil {
				client.Close()
				continue
			}
			go func() {
				defer client.Close()
				defer server.Close()
				_, _ = io.Copy(client, server)
			}()
			go func() {
				defer client.Close()
				defer server.Close()
				forwardUntilCommit(server, client)
			}()
		}
	}()
	// Each connection through the proxy is one to the server: counted as
	// the pool's (pgtest).
	return db.NewPool(t, 0, func(c *pgxpool.Config) {
		c.ConnConfig.Host = "127.0.0.1"
		c.ConnConfig.Port = uint16(ln.Addr().(*net.TCPAddr).Port)
	})
}

// forwardUntilCommit copies frontend messages from src to dst and returns
// at the first one carrying a COMMIT, without forwarding it. The startup
// message has no type byte; every later message is a type byte and a
// length that counts itself.
func forwardUntilCommit(dst io.Writer, src io.Reader) {
	var lenBuf [4]byte
	if _, err := io.ReadFull(src, lenBuf[:]); err != nil {
		return
	}
	startup := make([]byte, binary.BigEndian.Uint32(lenBuf[:])-4)
	if _, err := io.ReadFull(src, startup); err != nil {
		return
	}
	if _, err := dst.Write(append(lenBuf[:], startup...)); err != nil {
		return
	}
	var head [5]byte
	for {
		if _, err := io.ReadFull(src, head[:]); err != nil {
			return
		}
		body := make([]byte, binary.BigEndian.Uint32(head[1:])-4)
		if _, err := io.ReadFull(src, body); err != nil {
			return
		}
		if (head[0] == 'Q' || head[0] == 'P') && strings.Contains(strings.ToLower(string(bytes.TrimRight(body, "\x00"))), "commit") {
			return
		}
		if _, err := dst.Write(append(head[:], body...)); err != nil {
			return
		}
	}
}
