package sandbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// StandbyName is the standby's application_name, the name
// synchronous_standby_names lists.
const StandbyName = "idem_standby"

// PairConfig shapes a Pair.
type PairConfig struct {
	// Synchronous lists the standby in the primary's
	// synchronous_standby_names (FIRST 1), so that a commit returns only
	// once the standby has flushed it (synchronous_commit on). Otherwise
	// the standby is asynchronous, as a streaming standby is by default.
	Synchronous bool
	// ReplicationLatency delays every byte of the standby's replication
	// connection by this much each way, in whole milliseconds (toxiproxy's
	// unit): the WAL reaches the standby late, and an asynchronous standby
	// trails the primary's commits by at least that. Zero: loopback speed.
	ReplicationLatency time.Duration
}

// Pair is a primary and a streaming standby of the caller's own, each on
// its own port, behind a front link that clients use and that Repoint
// moves from the primary to the promoted standby, as a virtual address or
// a DNS name moves in a managed failover. The standby replicates through a
// link of its own (slowed, cut) and a replication slot. After a failover,
// AddStandby gives the new primary a standby of its own, for the next one.
type Pair struct {
	// Primary is the primary now; Standby its standby, nil between a
	// promotion and AddStandby.
	Primary, Standby *Postgres
	cfg              PairConfig
	faults           *Faults
	front, repl      *Link       // repl: the standby's
	former           []*Postgres // the primaries a failover left behind
}

// StartPair starts a primary (see StartPostgres) and a standby of it (see
// AddStandby). Remove deletes both.
func StartPair(parent string, cfg PairConfig) (p *Pair, err error) {
	primary, err := StartPostgres(parent)
	if err != nil {
		return nil, err
	}
	p = &Pair{Primary: primary, cfg: cfg, faults: StartFaults()}
	defer func() {
		if err != nil {
			p.Remove()
		}
	}()
	if p.front, err = p.faults.Link("pg-front", "127.0.0.1:"+strconv.Itoa(primary.Port)); err != nil {
		return nil, err
	}
	if err := p.AddStandby(); err != nil {
		return nil, err
	}
	return p, nil
}

// AddStandby takes a base backup of the primary with pg_basebackup -R
// through a new replication link, starts it as the primary's streaming
// standby, makes it synchronous if the pair is, waits until it streams, and
// slows its link as the pair's config says.
func (p *Pair) AddStandby() (err error) {
	if p.Standby != nil {
		return errors.New("sandbox: the pair has a standby already")
	}
	if p.repl, err = p.faults.Link("pg-replication", "127.0.0.1:"+strconv.Itoa(p.Primary.Port)); err != nil {
		return err
	}
	s, err := p.standby()
	if err != nil {
		return err
	}
	if err := s.Start(); err != nil {
		s.Remove()
		return err
	}
	p.Standby = s
	if p.cfg.Synchronous {
		if err := p.exec(fmt.Sprintf(`ALTER SYSTEM SET synchronous_standby_names = 'FIRST 1 (%s)'`, StandbyName)); err != nil {
			return err
		}
		if err := p.exec(`SELECT pg_reload_conf()`); err != nil {
			return err
		}
	}
	want := "async"
	if p.cfg.Synchronous {
		want = "sync"
	}
	if err := p.waitStreaming(want); err != nil {
		return err
	}
	if p.cfg.ReplicationLatency > 0 {
		if err := p.repl.Latency(p.cfg.ReplicationLatency, 0); err != nil {
			return err
		}
	}
	return nil
}

// standby makes the standby's cluster: a base backup of the primary taken
// through the replication link, with -R (standby.signal, primary_conninfo
// through the link) and a slot, so the primary keeps the WAL it has not
// sent yet.
func (p *Pair) standby() (*Postgres, error) {
	port, err := FreePort()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp(filepath.Dir(p.Primary.dir), "idem-pg-")
	if err != nil {
		return nil, fmt.Errorf("sandbox: %w", err)
	}
	s := &Postgres{Port: port, dir: dir, bin: p.Primary.bin}
	if err := chownToPostgres(dir); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	if out, err := s.run(filepath.Join(s.bin, "pg_basebackup"), "-h", "127.0.0.1", "-p", p.repl.Port(), "-U", "postgres",
		"-D", s.data(), "-X", "stream", "-c", "fast", "--no-sync", "-R", "-C", "-S", StandbyName).CombinedOutput(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("sandbox: pg_basebackup: %v\n%s", err, out)
	}
	// The walreceiver names itself after cluster_name, the name the
	// primary's synchronous_standby_names lists.
	script := fmt.Sprintf(`echo "cluster_name = '%s'" >> %s/postgresql.auto.conf`, StandbyName, s.data())
	if out, err := s.run("sh", "-c", script).CombinedOutput(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("sandbox: configure the standby: %v\n%s", err, out)
	}
	return s, nil
}

// waitStreaming waits until the primary sees the standby streaming with
// sync_state want.
func (p *Pair) waitStreaming(want string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for {
		c, err := pgx.Connect(ctx, p.Primary.URL())
		if err == nil {
			var n int
			err = c.QueryRow(ctx, `SELECT count(*) FROM pg_stat_replication
				WHERE application_name = $1 AND state = 'streaming' AND sync_state = $2`, StandbyName, want).Scan(&n)
			c.Close(ctx)
			if err == nil && n == 1 {
				return nil
			}
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("sandbox: the standby never streamed (%s): %v", want, err)
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// exec runs sql on the primary, directly.
func (p *Pair) exec(sql string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c, err := pgx.Connect(ctx, p.Primary.URL())
	if err != nil {
		return fmt.Errorf("sandbox: %w", err)
	}
	defer c.Close(ctx)
	if _, err := c.Exec(ctx, sql); err != nil {
		return fmt.Errorf("sandbox: %s: %w", sql, err)
	}
	return nil
}

// URL is a DATABASE_URL for the postgres database through the front link:
// the primary's until Repoint, the promoted standby's after.
func (p *Pair) URL() string {
	return fmt.Sprintf("postgres://postgres@%s/postgres?sslmode=disable", p.front.Addr())
}

// CutReplication drops every byte of the replication link from now on, the
// WAL the link still holds back included: the standby receives nothing
// more, as when the primary's host is cut off or lost. An asynchronous
// standby then lacks every commit from the last WAL it received; a
// synchronous one makes the primary's commits wait.
func (p *Pair) CutReplication() error { return p.repl.Blackhole() }

// KillPrimary kills the primary (see Postgres.Kill).
func (p *Pair) KillPrimary() error { return p.Primary.Kill() }

// Promote ends the standby's recovery: it becomes the primary, on a
// timeline of its own, with what it had received, and has no standby.
// (Synchronous or not, it commits without waiting for one until
// AddStandby.)
func (p *Pair) Promote() error {
	if p.Standby == nil {
		return errors.New("sandbox: the pair has no standby to promote")
	}
	if err := p.Standby.ctl("promote", "-w", "-t", "60"); err != nil {
		return fmt.Errorf("sandbox: promote the standby: %w", err)
	}
	p.former = append(p.former, p.Primary)
	p.Primary, p.Standby = p.Standby, nil
	return nil
}

// Former is the primary the last failover left behind, killed (Recover
// starts it, as a primary of its own, to read what it had committed;
// nothing reaches it through the front), or nil before any failover.
func (p *Pair) Former() *Postgres {
	if len(p.former) == 0 {
		return nil
	}
	return p.former[len(p.former)-1]
}

// Repoint moves the front link to the primary (the promoted standby, after
// Promote): its open connections close, and new ones reach the primary.
func (p *Pair) Repoint() error {
	return p.front.Repoint("127.0.0.1:" + strconv.Itoa(p.Primary.Port))
}

// Kill kills the cluster's postmaster and every process it forked with
// SIGKILL, as a crash of its host does: no checkpoint, no goodbye to a
// standby or a client, and nothing waited for. (An immediate stop waits
// for every child; one forked for a connection that never sends its
// startup packet, such as a standby's reconnection through a cut link,
// holds it for authentication_timeout, a minute.) The files stay, as a
// crashed cluster's do: Start recovers them.
func (s *Postgres) Kill() error {
	b, err := os.ReadFile(filepath.Join(s.data(), "postmaster.pid"))
	if err != nil {
		return fmt.Errorf("sandbox: kill postgres: %w", err)
	}
	first, _, _ := strings.Cut(string(b), "\n")
	pid, err := strconv.Atoi(strings.TrimSpace(first))
	if err != nil {
		return fmt.Errorf("sandbox: kill postgres: postmaster.pid: %w", err)
	}
	victims := append(childrenOf(pid), pid)
	for _, v := range victims {
		_ = syscall.Kill(v, syscall.SIGKILL)
	}
	deadline := time.Now().Add(10 * time.Second)
	for _, v := range victims {
		for alive(v) {
			if time.Now().After(deadline) {
				return fmt.Errorf("sandbox: kill postgres: process %d lives on", v)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	return nil
}

// Recover starts a cluster that Kill left behind. Its lock files (the
// data directory's postmaster.pid, the socket's .lock) name a process
// that is dead but may not be reaped yet: a zombie, which the server's own
// check (kill 0) takes for a postmaster still running, and init may take
// its time. The lock files of a dead one, and its socket, are removed
// first.
func (s *Postgres) Recover() error {
	lock := filepath.Join(s.data(), "postmaster.pid")
	if b, err := os.ReadFile(lock); err == nil {
		first, _, _ := strings.Cut(string(b), "\n")
		if pid, err := strconv.Atoi(strings.TrimSpace(first)); err == nil && !alive(pid) {
			socket := filepath.Join(s.dir, fmt.Sprintf(".s.PGSQL.%d", s.Port))
			for _, f := range []string{lock, socket + ".lock", socket} {
				if err := os.Remove(f); err != nil && !errors.Is(err, os.ErrNotExist) {
					return fmt.Errorf("sandbox: recover postgres: %w", err)
				}
			}
		}
	}
	return s.Start()
}

// childrenOf lists the processes whose parent is pid, from /proc.
func childrenOf(pid int) []int {
	stats, _ := filepath.Glob("/proc/[0-9]*/stat")
	var out []int
	for _, st := range stats {
		if _, ppid, ok := procStat(st); ok && ppid == pid {
			child, _ := strconv.Atoi(filepath.Base(filepath.Dir(st)))
			out = append(out, child)
		}
	}
	return out
}

// alive reports whether pid runs: it exists and is not a zombie waiting
// for its parent (init, for an orphan) to reap it.
func alive(pid int) bool {
	state, _, ok := procStat(fmt.Sprintf("/proc/%d/stat", pid))
	return ok && state != "Z"
}

// procStat reads a process's state and parent from its /proc stat file:
// "pid (comm) state ppid …", where comm may hold spaces and parentheses.
func procStat(path string) (state string, ppid int, ok bool) {
	b, err := os.ReadFile(path)
	if err != nil {
		return "", 0, false
	}
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return "", 0, false
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 2 {
		return "", 0, false
	}
	ppid, err = strconv.Atoi(f[1])
	return f[0], ppid, err == nil
}

// Remove stops every cluster of the pair (former primaries included) and
// the links, and deletes their files.
func (p *Pair) Remove() {
	if p.faults != nil {
		p.faults.Close()
	}
	if p.Standby != nil {
		p.Standby.Remove()
	}
	p.Primary.Remove()
	for _, f := range p.former {
		f.Remove()
	}
}
