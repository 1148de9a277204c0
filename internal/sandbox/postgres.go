package sandbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/user"
	"path/filepath"
	"strconv"
	"time"

	"github.com/jackc/pgx/v5"
)

// ErrNoInitdb means PostgreSQL's server binaries are not installed here.
var ErrNoInitdb = errors.New("sandbox: initdb not installed")

// Postgres is a PostgreSQL cluster of the caller's own, on its own port,
// so it can be stopped and restarted without touching the shared server.
// initdb and pg_ctl refuse to run as root, so as root they run as the
// postgres user.
type Postgres struct {
	Port int
	dir  string
	bin  string
	opts string // added to the server's options (StartPostgresTLS)
}

// StartPostgres creates a cluster in a new directory under parent (trust
// auth, fsync off) and starts it. Remove deletes it.
func StartPostgres(parent string) (*Postgres, error) { return startPostgres(parent, nil) }

// startPostgres is StartPostgres with prepare, if set, run between initdb
// and the first start.
func startPostgres(parent string, prepare func(*Postgres) error) (*Postgres, error) {
	bin := pgBinDir()
	if bin == "" {
		return nil, ErrNoInitdb
	}
	port, err := FreePort()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp(parent, "idem-pg-")
	if err != nil {
		return nil, fmt.Errorf("sandbox: %w", err)
	}
	s := &Postgres{Port: port, dir: dir, bin: bin}
	if err := chownToPostgres(dir); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	if out, err := s.run(filepath.Join(bin, "initdb"), "-D", s.data(), "-U", "postgres", "--auth=trust", "-E", "UTF8", "--no-sync").CombinedOutput(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("sandbox: initdb: %v\n%s", err, out)
	}
	if prepare != nil {
		if err := prepare(s); err != nil {
			s.Remove()
			return nil, err
		}
	}
	if err := s.Start(); err != nil {
		s.Remove()
		return nil, err
	}
	return s, nil
}

// URL is a DATABASE_URL for the cluster's postgres database.
func (s *Postgres) URL() string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/postgres?sslmode=disable", s.Port)
}

// Start starts the cluster and waits until it accepts connections.
func (s *Postgres) Start() error {
	if err := s.ctl("start", "-w", "-t", "60", "-l", filepath.Join(s.dir, "log"),
		"-o", fmt.Sprintf("-p %d -k %s -c listen_addresses=127.0.0.1 -c fsync=off -c max_connections=200", s.Port, s.dir)+s.opts); err != nil {
		b, _ := os.ReadFile(filepath.Join(s.dir, "log"))
		return fmt.Errorf("sandbox: start postgres: %v\n%s", err, b)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	c, err := pgx.Connect(ctx, s.URL())
	if err != nil {
		return fmt.Errorf("sandbox: connect to started postgres: %w", err)
	}
	return c.Close(ctx)
}

// Stop shuts the cluster down at once (mode immediate: like a crash, every
// session is cut and open transactions are lost).
func (s *Postgres) Stop() error {
	if err := s.ctl("stop", "-m", "immediate", "-w"); err != nil {
		return fmt.Errorf("sandbox: stop postgres: %w", err)
	}
	return nil
}

// Remove stops the cluster if it runs and deletes its files.
func (s *Postgres) Remove() {
	_ = s.ctl("stop", "-m", "immediate")
	os.RemoveAll(s.dir)
}

func (s *Postgres) data() string { return filepath.Join(s.dir, "data") }

// BaseBackup copies the running cluster with pg_basebackup, its WAL
// streamed along, into a new cluster, which it does not start. Started, the
// copy replays to the end of the backup and leaves recovery on a timeline
// of its own, as a point-in-time restore does, or a standby promoted after
// its primary's last transactions were lost: the same system identifier, a
// new timeline, and nothing the original committed after the backup. It has
// a port of its own; set Port to the original's before Start to take the
// original's place.
func (s *Postgres) BaseBackup() (*Postgres, error) {
	port, err := FreePort()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp(filepath.Dir(s.dir), "idem-pg-")
	if err != nil {
		return nil, fmt.Errorf("sandbox: %w", err)
	}
	b := &Postgres{Port: port, dir: dir, bin: s.bin}
	if err := chownToPostgres(dir); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	if out, err := b.run(filepath.Join(s.bin, "pg_basebackup"), "-h", "127.0.0.1", "-p", strconv.Itoa(s.Port), "-U", "postgres",
		"-D", b.data(), "-X", "stream", "-c", "fast", "--no-sync").CombinedOutput(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("sandbox: pg_basebackup: %v\n%s", err, out)
	}
	// Archive recovery (recovery.signal) from the WAL in the backup alone:
	// a restore_command that finds nothing ends it at the backup's last
	// record, on a new timeline.
	script := fmt.Sprintf(`touch %[1]s/recovery.signal && echo "restore_command = 'false'" >> %[1]s/postgresql.auto.conf`, b.data())
	if out, err := b.run("sh", "-c", script).CombinedOutput(); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("sandbox: prepare recovery: %v\n%s", err, out)
	}
	return b, nil
}

// Tool returns the path of one of the installed PostgreSQL programs
// (pg_dump, pg_restore…), of the same version as the sandbox's servers.
func Tool(name string) (string, error) {
	bin := pgBinDir()
	if bin == "" {
		return "", ErrNoInitdb
	}
	p := filepath.Join(bin, name)
	if _, err := os.Stat(p); err != nil {
		return "", fmt.Errorf("sandbox: %w", err)
	}
	return p, nil
}

// chownToPostgres gives dir to the postgres user when running as root,
// since initdb, pg_ctl and the server refuse root.
func chownToPostgres(dir string) error {
	if os.Geteuid() != 0 {
		return nil
	}
	u, err := user.Lookup("postgres")
	if err != nil {
		return fmt.Errorf("sandbox: running as root and there is no postgres user for initdb: %w", err)
	}
	uid, _ := strconv.Atoi(u.Uid)
	gid, _ := strconv.Atoi(u.Gid)
	if err := os.Chown(dir, uid, gid); err != nil {
		return fmt.Errorf("sandbox: %w", err)
	}
	return nil
}

func (s *Postgres) ctl(args ...string) error {
	args = append([]string{"-D", s.data()}, args...)
	out, err := s.run(filepath.Join(s.bin, "pg_ctl"), args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%w: %s", err, out)
	}
	return nil
}

func (s *Postgres) run(name string, args ...string) *exec.Cmd {
	if os.Geteuid() == 0 {
		return exec.Command("runuser", append([]string{"-u", "postgres", "--", name}, args...)...)
	}
	return exec.Command(name, args...)
}

func pgBinDir() string {
	if p, err := exec.LookPath("initdb"); err == nil {
		if real, err := filepath.EvalSymlinks(p); err == nil {
			return filepath.Dir(real)
		}
		return filepath.Dir(p)
	}
	matches, _ := filepath.Glob("/usr/lib/postgresql/*/bin/initdb")
	if len(matches) == 0 {
		return ""
	}
	return filepath.Dir(matches[len(matches)-1])
}
