package sandbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/jackc/pgx/v5"
)

// ErrNoPgBouncer means PgBouncer is not installed here (.ci/services.sh
// installs the Debian package).
var ErrNoPgBouncer = errors.New("sandbox: pgbouncer not installed")

// PgBouncer is a PgBouncer of the caller's own, on its own port, in front
// of a PostgreSQL server: transaction pooling by default, as most managed
// poolers run. It refuses to run as root, so as root it runs as the
// postgres user. Its admin console (the pgbouncer database) takes the
// postgres user.
type PgBouncer struct {
	Port int
	dir  string
	bin  string
	cmd  *exec.Cmd
	done chan struct{}
}

// PgBouncerOptions tune a PgBouncer.
type PgBouncerOptions struct {
	Mode     string // pool_mode: transaction (default), session or statement
	PoolSize int    // default_pool_size: server connections per database and user (default 4)
	// Ignore lists startup parameters it accepts and drops
	// (ignore_startup_parameters); by default extra_float_digits.
	Ignore []string
	// Settings are more lines of its [pgbouncer] section, "key = value".
	Settings []string
}

// StartPgBouncer starts a PgBouncer in a new directory under parent, in
// front of the PostgreSQL server at host:port, every database name passed
// through to the same name there, trust auth. Close stops it and deletes
// the directory.
func StartPgBouncer(parent, host string, port int, o PgBouncerOptions) (*PgBouncer, error) {
	bin, err := exec.LookPath("pgbouncer")
	if err != nil {
		if _, serr := os.Stat("/usr/sbin/pgbouncer"); serr != nil {
			return nil, ErrNoPgBouncer
		}
		bin = "/usr/sbin/pgbouncer"
	}
	if o.Mode == "" {
		o.Mode = "transaction"
	}
	if o.PoolSize == 0 {
		o.PoolSize = 4
	}
	if len(o.Ignore) == 0 {
		o.Ignore = []string{"extra_float_digits"}
	}
	listen, err := FreePort()
	if err != nil {
		return nil, err
	}
	dir, err := os.MkdirTemp(parent, "idem-pgbouncer-")
	if err != nil {
		return nil, fmt.Errorf("sandbox: %w", err)
	}
	b := &PgBouncer{Port: listen, dir: dir, bin: bin, done: make(chan struct{})}
	ini := fmt.Sprintf(`[databases]
* = host=%s port=%d

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = %d
unix_socket_dir =
auth_type = trust
auth_file = %s
admin_users = postgres
pool_mode = %s
default_pool_size = %d
max_client_conn = 500
ignore_startup_parameters = %s
logfile = %s
pidfile = %s
%s
`, host, port, listen, filepath.Join(dir, "users.txt"), o.Mode, o.PoolSize, strings.Join(o.Ignore, ","),
		filepath.Join(dir, "log"), filepath.Join(dir, "pid"), strings.Join(o.Settings, "\n"))
	if err := os.WriteFile(filepath.Join(dir, "pgbouncer.ini"), []byte(ini), 0o644); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("sandbox: %w", err)
	}
	if err := os.WriteFile(filepath.Join(dir, "users.txt"), []byte(`"postgres" ""`+"\n"), 0o644); err != nil {
		os.RemoveAll(dir)
		return nil, fmt.Errorf("sandbox: %w", err)
	}
	if err := chownToPostgres(dir); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	if err := b.start(); err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	return b, nil
}

func (b *PgBouncer) start() error {
	ini := filepath.Join(b.dir, "pgbouncer.ini")
	if os.Geteuid() == 0 {
		b.cmd = exec.Command("runuser", "-u", "postgres", "--", b.bin, ini)
	} else {
		b.cmd = exec.Command(b.bin, ini)
	}
	b.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := b.cmd.Start(); err != nil {
		return fmt.Errorf("sandbox: start pgbouncer: %w", err)
	}
	go func() { _ = b.cmd.Wait(); close(b.done) }()
	for end := time.Now().Add(15 * time.Second); time.Now().Before(end); time.Sleep(50 * time.Millisecond) {
		select {
		case <-b.done:
			log, _ := os.ReadFile(filepath.Join(b.dir, "log"))
			return fmt.Errorf("sandbox: pgbouncer exited at start:\n%s", log)
		default:
		}
		if err := b.Admin(context.Background(), "SHOW VERSION"); err == nil {
			return nil
		}
	}
	b.Kill()
	return fmt.Errorf("sandbox: pgbouncer did not listen on %d within 15s", b.Port)
}

// URL is a DATABASE_URL for database db through the pooler.
func (b *PgBouncer) URL(db string) string {
	return fmt.Sprintf("postgres://postgres@127.0.0.1:%d/%s?sslmode=disable", b.Port, db)
}

// Admin runs a command on the admin console: PAUSE, RESUME, RECONNECT,
// KILL db, SHOW POOLS... (its console speaks the simple protocol only).
func (b *PgBouncer) Admin(ctx context.Context, command string) error {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	conn, err := pgx.Connect(ctx, b.URL("pgbouncer")+"&default_query_exec_mode=simple_protocol")
	if err != nil {
		return fmt.Errorf("sandbox: pgbouncer admin: %w", err)
	}
	defer conn.Close(ctx)
	if _, err := conn.Exec(ctx, command); err != nil {
		return fmt.Errorf("sandbox: pgbouncer admin %s: %w", command, err)
	}
	return nil
}

// Kill SIGKILLs the pooler (every client connection drops) and waits for
// it to exit.
func (b *PgBouncer) Kill() {
	if b.cmd == nil || b.cmd.Process == nil {
		return
	}
	_ = syscall.Kill(-b.cmd.Process.Pid, syscall.SIGKILL)
	<-b.done
}

// Restart kills the pooler and starts it again on the same port.
func (b *PgBouncer) Restart() error {
	b.Kill()
	_ = os.Remove(filepath.Join(b.dir, "pid"))
	b.done = make(chan struct{})
	return b.start()
}

// Log returns what the pooler logged.
func (b *PgBouncer) Log() string {
	out, _ := os.ReadFile(filepath.Join(b.dir, "log"))
	return string(out)
}

// Close stops the pooler and deletes its directory.
func (b *PgBouncer) Close() {
	b.Kill()
	os.RemoveAll(b.dir)
}
