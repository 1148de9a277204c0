package pgerr

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net"
	"testing"

	"github.com/jackc/pgx/v5"
	"github.com/jackc/pgx/v5/pgconn"
	"github.com/jackc/pgx/v5/pgxpool"
	"github.com/stretchr/testify/require"
)

func TestIsTransientOnlyForAnUnreachableServer(t *testing.T) {
	pg := func(code string) error { return &pgconn.PgError{Code: code} }
	for name, c := range map[string]struct {
		err  error
		want bool
	}{
		"connection reset":          {&net.OpError{Op: "read", Err: errors.New("connection reset by peer")}, true},
		"unexpected EOF":            {fmt.Errorf("commit: %w", io.ErrUnexpectedEOF), true},
		"admin shutdown":            {pg("57P01"), true},
		"serialization failure":     {pg("40001"), true},
		"connection failure":        {pg("08006"), true},
		"too many connections":      {pg("53300"), true},
		"deadline":                  {fmt.Errorf("query: %w", context.DeadlineExceeded), false},
		"canceled":                  {context.Canceled, false},
		"commit rolled back":        {pgx.ErrTxCommitRollback, false},
		"deferred unique at commit": {pg("23505"), false},
		"overflow":                  {pg("22003"), false},
		"raised exception":          {pg("P0001"), false},
		"undefined table":           {pg("42P01"), false},
	} {
		require.Equal(t, c.want, IsTransient(c.err), name)
	}
}

// TestConnectErrorsAreTransientUnlessTheServerRefuses connects for real: a
// closed port (and pgx's connect timeout) is transient, a missing database
// is not.
func TestConnectErrorsAreTransientUnlessTheServerRefuses(t *testing.T) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	require.NoError(t, err)
	port := ln.Addr().(*net.TCPAddr).Port
	ln.Close()
	ctx := context.Background()
	_, err = pgx.Connect(ctx, fmt.Sprintf("postgres://postgres@127.0.0.1:%d/test?connect_timeout=1", port))
	require.Error(t, err)
	require.True(t, IsTransient(err), "refused: %v", err)

	cfg, err := pgxpool.ParseConfig("postgres://postgres@127.0.0.1:5432/no_such_db_for_idem?sslmode=disable")
	require.NoError(t, err)
	_, err = pgx.ConnectConfig(ctx, cfg.ConnConfig)
	require.Error(t, err)
	require.False(t, IsTransient(err), "missing database: %v", err)
}
