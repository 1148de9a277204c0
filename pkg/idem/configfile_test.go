package idem_test

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/stretchr/testify/require"

	"github.com/idemhq/idem/internal/testenv"
	"github.com/idemhq/idem/pkg/idem"
)

// TestAServiceLoadsTheFileItsToolsRead: a library service named its
// settings itself, so an operator whose tools missed one (IDEM_REDIS_PREFIX)
// got plausible wrong answers from them. LoadConfig reads the file the
// tools read with --config, with IDEM_* over it as they read it, into the
// service's Config: the scope, the Redis prefix, the queue and the database
// are the tools'. Sharded settings are refused with what to do instead.
func TestAServiceLoadsTheFileItsToolsRead(t *testing.T) {
	_, dbURL := testenv.Schema(t)
	dir := t.TempDir()
	file := filepath.Join(dir, "refunds.yaml")
	require.NoError(t, os.WriteFile(file, []byte(`scope: refunds
queue: refunds.events
database_url: "`+dbURL+`"
redis_url: "`+testenv.RedisURL()+`"
redis:
  prefix: refunds-idem
consumer:
  workers: 3
postgres:
  max_conns: 9
`), 0o600))
	t.Setenv("IDEM_CONSUMER_PREFETCH", "64") // the environment over the file, as for the tools
	cfg, err := idem.LoadConfig(file)
	require.NoError(t, err)
	t.Cleanup(func() { _ = cfg.Redis.Close() })
	require.Equal(t, "refunds", cfg.Scope)
	require.Equal(t, "refunds.events", cfg.Consumer.Queue)
	require.Equal(t, "refunds-idem", cfg.Fast.Prefix)
	require.Equal(t, 3, cfg.Consumer.Workers)
	require.Equal(t, 64, cfg.Consumer.Prefetch)
	require.Contains(t, cfg.DatabaseURL, "pool_max_conns=9")
	require.NotNil(t, cfg.Redis)
	_, err = idem.New(cfg, ledgerHandler{})
	require.NoError(t, err, "a Config a Service takes as it is")

	_, other := testenv.Schema(t)
	require.NoError(t, os.WriteFile(file, []byte("postgres:\n  shards: \""+dbURL+" "+other+"\"\n"), 0o600))
	_, err = idem.LoadConfig(file)
	require.ErrorContains(t, err, "open a pool on each and set Databases")
	require.NoError(t, os.WriteFile(file, []byte("consumer:\n  workers: -1\n"), 0o600))
	_, err = idem.LoadConfig(file)
	require.ErrorContains(t, err, "consumer.workers", "checked as the tools check it")
}
