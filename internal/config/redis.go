package config

import (
	"errors"
	"fmt"
	"time"

	"github.com/redis/go-redis/v9"
)

var errRedisMode = errors.New("want single, cluster or sentinel")

// clusterStateReload is how often a cluster client re-reads the slot map.
const clusterStateReload = time.Second

// parseRedisURL parses url with go-redis's own parser for mode: a
// *redis.Options, *redis.ClusterOptions or *redis.FailoverOptions.
func parseRedisURL(mode, url string) (any, error) {
	switch mode {
	case "single":
		o, err := redis.ParseURL(url)
		if err != nil {
			return nil, fmt.Errorf("cannot be parsed as a Redis URL (redis:// or rediss://, host, port, database number): %w", err)
		}
		return o, nil
	case "cluster":
		o, err := redis.ParseClusterURL(url)
		if err != nil {
			return nil, fmt.Errorf("cannot be parsed as a Redis Cluster URL (redis://host:port?addr=host:port&addr=…): %w", err)
		}
		return o, nil
	case "sentinel":
		o, err := redis.ParseFailoverURL(url)
		if err != nil {
			return nil, fmt.Errorf("cannot be parsed as a Sentinel URL (redis://sentinel:26379?addr=sentinel2:26379&master_name=…): %w", err)
		}
		if o.MasterName == "" {
			return nil, errors.New("names no master: add master_name=<name>, the name the Sentinels monitor")
		}
		return o, nil
	}
	return nil, fmt.Errorf("%q is not a mode; %w", mode, errRedisMode)
}

// RedisClient returns the client redis.mode and redis_url describe: a
// *redis.Client for one server, a *redis.ClusterClient for a cluster, a
// Sentinel-backed *redis.Client for sentinel. Whatever the mode, per-call
// deadlines come from the context (redis.timeout), the client does not
// retry on its own (the breaker decides what a failure means; a cluster
// client still follows MOVED and ASK redirects within the deadline), and
// no connection attempt or read waits longer than a second. With rediss://,
// redis.tls_* set the CA, client certificate and server name, and each node
// of a cluster or sentinel set is verified against its own address.
func (c Config) RedisClient() (redis.UniversalClient, error) {
	o, err := parseRedisURL(c.Redis.Mode, c.RedisURL)
	if err != nil {
		return nil, fmt.Errorf("redis_url: %w", err)
	}
	t, err := c.redisTLS(urlTLS(o))
	if err != nil {
		return nil, err
	}
	const io = time.Second
	switch o := o.(type) {
	case *redis.Options:
		o.TLSConfig = t
		o.ContextTimeoutEnabled, o.MaxRetries = true, -1
		o.DialTimeout, o.ReadTimeout, o.WriteTimeout = io, io, io
		return redis.NewClient(o), nil
	case *redis.ClusterOptions:
		o.TLSConfig = t
		o.ContextTimeoutEnabled, o.MaxRetries = true, -1
		o.DialTimeout, o.ReadTimeout, o.WriteTimeout = io, io, io
		// A dead master costs one refused dial per call, not five.
		o.DialerRetries = 1
		// go-redis re-reads the slot map only on MOVED or every minute:
		// after a master dies, calls would go to it until then. Every
		// second, the keys move to the promoted replica a second after
		// the promotion.
		o.ClusterStateReloadInterval = clusterStateReload
		return redis.NewClusterClient(o), nil
	case *redis.FailoverOptions:
		o.TLSConfig = t
		o.ContextTimeoutEnabled, o.MaxRetries = true, -1
		o.DialTimeout, o.ReadTimeout, o.WriteTimeout = io, io, io
		return redis.NewFailoverClient(o), nil
	}
	panic(fmt.Sprintf("config: parseRedisURL returned %T", o))
}
