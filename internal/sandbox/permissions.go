package sandbox

import (
	"fmt"
	"net/url"
	"strings"
)

// SetPermissions sets the configure, write and read permission patterns
// (regular expressions over queue and exchange names) of the user that
// amqpURL logs in as, in amqpURL's vhost, replacing those it had there.
func SetPermissions(amqpURL, configure, write, read string) error {
	u, err := url.Parse(amqpURL)
	if err != nil {
		return fmt.Errorf("sandbox: AMQP URL: %w", err)
	}
	if u.User == nil {
		return fmt.Errorf("sandbox: AMQP URL names no user")
	}
	vhost := strings.TrimPrefix(u.Path, "/")
	if vhost == "" {
		vhost = "/"
	}
	return rabbitmqctl("set_permissions", "-p", vhost, u.User.Username(), configure, write, read)
}
