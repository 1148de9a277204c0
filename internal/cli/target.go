package cli

import (
	"flag"

	"github.com/idemhq/idem/internal/config"
)

// targetFlags adds --scope (if scope) and --queue (if queue) to fs: the
// service and the queue a tool reads, over the scope and queue settings.
// Left to their defaults, those name the reference payments service, so a
// tool run for another service without them reads the wrong one; LoadConfig
// takes the flags' values as it takes the environment's.
func (e *Env) targetFlags(fs *flag.FlagSet, scope, queue bool) {
	if scope {
		e.scope = fs.String("scope", "", "the consuming service's `scope`, whose events to read (default: the scope setting, IDEM_SCOPE, else "+config.DefaultScope+")")
	}
	if queue {
		e.queue = fs.String("queue", "", "the `queue` to work on (default: the queue setting, IDEM_QUEUE, else "+config.DefaultQueue+")")
	}
}

// targetEnv returns the --scope and --queue given, as the variables of
// their settings.
func (e *Env) targetEnv() []string {
	var out []string
	for path, v := range map[string]*string{"scope": e.scope, "queue": e.queue} {
		if v == nil || *v == "" {
			continue
		}
		for _, f := range config.Fields() {
			if f.Path == path {
				out = append(out, f.Env+"="+*v)
			}
		}
	}
	return out
}
