package sandbox

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/hex"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// PKI is a certificate authority made for one run, with a server
// certificate and a client certificate it signed, as PEM files in Dir.
type PKI struct {
	Dir                           string
	CAFile                        string
	ServerCertFile, ServerKeyFile string
	ClientCertFile, ClientKeyFile string
}

// NewPKI makes a new CA in dir and signs a server certificate for hosts (IP
// addresses or DNS names; none: 127.0.0.1 and localhost) and a client
// certificate (CN idem-client). Two calls make two CAs that do not trust
// each other.
func NewPKI(dir string, hosts ...string) (*PKI, error) {
	if len(hosts) == 0 {
		hosts = []string{"127.0.0.1", "localhost"}
	}
	p := &PKI{Dir: dir,
		CAFile:         filepath.Join(dir, "ca.pem"),
		ServerCertFile: filepath.Join(dir, "server.pem"), ServerKeyFile: filepath.Join(dir, "server.key"),
		ClientCertFile: filepath.Join(dir, "client.pem"), ClientKeyFile: filepath.Join(dir, "client.key"),
	}
	var id [4]byte
	_, _ = rand.Read(id[:])
	now := time.Now()
	caKey, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, fmt.Errorf("sandbox: %w", err)
	}
	ca := &x509.Certificate{
		SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "idem test CA " + hex.EncodeToString(id[:])},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
	}
	caDER, err := x509.CreateCertificate(rand.Reader, ca, ca, &caKey.PublicKey, caKey)
	if err != nil {
		return nil, fmt.Errorf("sandbox: %w", err)
	}
	if err := writePEM(p.CAFile, "CERTIFICATE", caDER, 0o644); err != nil {
		return nil, err
	}
	server := &x509.Certificate{
		SerialNumber: big.NewInt(2), Subject: pkix.Name{CommonName: hosts[0]},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth, x509.ExtKeyUsageClientAuth},
	}
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			server.IPAddresses = append(server.IPAddresses, ip)
		} else {
			server.DNSNames = append(server.DNSNames, h)
		}
	}
	client := &x509.Certificate{
		SerialNumber: big.NewInt(3), Subject: pkix.Name{CommonName: "idem-client"},
		NotBefore: now.Add(-time.Hour), NotAfter: now.Add(24 * time.Hour),
		KeyUsage: x509.KeyUsageDigitalSignature, ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageClientAuth},
	}
	for _, c := range []struct {
		tmpl          *x509.Certificate
		cert, keyFile string
	}{{server, p.ServerCertFile, p.ServerKeyFile}, {client, p.ClientCertFile, p.ClientKeyFile}} {
		key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		if err != nil {
			return nil, fmt.Errorf("sandbox: %w", err)
		}
		der, err := x509.CreateCertificate(rand.Reader, c.tmpl, ca, &key.PublicKey, caKey)
		if err != nil {
			return nil, fmt.Errorf("sandbox: %w", err)
		}
		keyDER, err := x509.MarshalPKCS8PrivateKey(key)
		if err != nil {
			return nil, fmt.Errorf("sandbox: %w", err)
		}
		if err := writePEM(c.cert, "CERTIFICATE", der, 0o644); err != nil {
			return nil, err
		}
		if err := writePEM(c.keyFile, "PRIVATE KEY", keyDER, 0o600); err != nil {
			return nil, err
		}
	}
	return p, nil
}

// copyTo copies the server's files and the CA into dir (the key 0600), for
// a server that runs as another user and must own its key.
func (p *PKI) copyTo(dir string) (*PKI, error) {
	c := *p
	c.Dir = dir
	for _, f := range []struct {
		from string
		to   *string
		mode os.FileMode
	}{{p.CAFile, &c.CAFile, 0o644}, {p.ServerCertFile, &c.ServerCertFile, 0o644}, {p.ServerKeyFile, &c.ServerKeyFile, 0o600}} {
		b, err := os.ReadFile(f.from)
		if err != nil {
			return nil, fmt.Errorf("sandbox: %w", err)
		}
		*f.to = filepath.Join(dir, filepath.Base(f.from))
		if err := os.WriteFile(*f.to, b, f.mode); err != nil {
			return nil, fmt.Errorf("sandbox: %w", err)
		}
	}
	return &c, nil
}

func writePEM(path, kind string, der []byte, mode os.FileMode) error {
	if err := os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: kind, Bytes: der}), mode); err != nil {
		return fmt.Errorf("sandbox: %w", err)
	}
	return nil
}

// StartPostgresTLS is StartPostgres with ssl=on, serving p's server
// certificate (plaintext stays allowed, as pg_hba.conf's host lines do by
// default, so that sslmode=prefer and disable can be tried too).
func StartPostgresTLS(parent string, p *PKI) (*Postgres, error) {
	return startPostgres(parent, func(s *Postgres) error {
		own, err := p.copyTo(s.dir)
		if err != nil {
			return err
		}
		for _, f := range []string{own.CAFile, own.ServerCertFile, own.ServerKeyFile} {
			if err := chownToPostgres(f); err != nil {
				return err
			}
		}
		s.opts = fmt.Sprintf(" -c ssl=on -c ssl_cert_file=%s -c ssl_key_file=%s -c ssl_ca_file=%s",
			own.ServerCertFile, own.ServerKeyFile, own.CAFile)
		return nil
	})
}

// StartRedisTLS starts a redis-server in dir with a TLS port serving p's
// server certificate and asking for a client certificate signed by p's CA
// (tls-auth-clients), beside its plaintext port (for Start's readiness
// check and the sandbox's own commands).
func StartRedisTLS(dir string, p *PKI) (s *Redis, tlsPort int, err error) {
	if s, tlsPort, err = redisTLS(dir, p, "--tls-auth-clients", "yes"); err != nil {
		return nil, 0, err
	}
	return s, tlsPort, s.Start()
}

// redisTLS is a redis-server in dir, not started, on two free ports: a
// TLS one serving p's server certificate (with p's CA for clients'), and a
// plaintext one; args are added.
func redisTLS(dir string, p *PKI, args ...string) (*Redis, int, error) {
	port, err1 := FreePort()
	tlsPort, err2 := FreePort()
	if err1 != nil || err2 != nil {
		return nil, 0, fmt.Errorf("sandbox: free port: %v %v", err1, err2)
	}
	return &Redis{Port: port, dir: dir, Args: append([]string{"--tls-port", strconv.Itoa(tlsPort),
		"--tls-cert-file", p.ServerCertFile, "--tls-key-file", p.ServerKeyFile,
		"--tls-ca-cert-file", p.CAFile}, args...)}, tlsPort, nil
}

// StartRedisClusterTLS starts a one-node Redis Cluster in dir, holding
// every slot, whose clients and cluster bus speak TLS (tls-cluster) with
// p's server certificate, so that CLUSTER SLOTS names the node by its TLS
// port; its plaintext port is for the sandbox's own commands. It waits
// until the node reports the cluster ok.
func StartRedisClusterTLS(dir string, p *PKI) (s *Redis, tlsPort int, err error) {
	s, tlsPort, err = redisTLS(dir, p, "--tls-auth-clients", "no", "--tls-cluster", "yes",
		"--cluster-enabled", "yes", "--cluster-config-file", filepath.Join(dir, "nodes.conf"),
		// A lone node never learns its address from a MEET: say it.
		"--cluster-announce-ip", "127.0.0.1")
	if err != nil {
		return nil, 0, err
	}
	if err := s.Start(); err != nil {
		return nil, 0, err
	}
	rdb := s.Client()
	defer rdb.Close()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if err := rdb.Do(ctx, "CLUSTER", "ADDSLOTSRANGE", "0", "16383").Err(); err != nil {
		s.Kill()
		return nil, 0, fmt.Errorf("sandbox: CLUSTER ADDSLOTSRANGE: %w", err)
	}
	for {
		info, err := rdb.ClusterInfo(ctx).Result()
		if err == nil && strings.Contains(info, "cluster_state:ok") {
			return s, tlsPort, nil
		}
		if ctx.Err() != nil {
			s.Kill()
			return nil, 0, fmt.Errorf("sandbox: redis cluster node not ok: %v %q", err, info)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// TLSProxy terminates TLS with a PKI's server certificate on a loopback
// port and forwards each connection's plaintext to a target: a TLS
// listener in front of a shared service the caller may not reconfigure.
// It verifies a client certificate when one is sent (signed by the PKI's
// CA), as RabbitMQ's verify_peer without fail_if_no_peer_cert does. It is
// a DelayProxy without delay behind a TLS listener.
type TLSProxy struct{ *DelayProxy }

// StartTLSProxy listens on a free loopback port and forwards to target.
func StartTLSProxy(p *PKI, target string) (*TLSProxy, error) {
	cert, err := tls.LoadX509KeyPair(p.ServerCertFile, p.ServerKeyFile)
	if err != nil {
		return nil, fmt.Errorf("sandbox: %w", err)
	}
	ca, err := os.ReadFile(p.CAFile)
	if err != nil {
		return nil, fmt.Errorf("sandbox: %w", err)
	}
	pool := x509.NewCertPool()
	pool.AppendCertsFromPEM(ca)
	ln, err := tls.Listen("tcp", "127.0.0.1:0", &tls.Config{Certificates: []tls.Certificate{cert},
		ClientCAs: pool, ClientAuth: tls.VerifyClientCertIfGiven, MinVersion: tls.VersionTLS12})
	if err != nil {
		return nil, fmt.Errorf("sandbox: %w", err)
	}
	return &TLSProxy{serveDelayProxy(ln, target, 0)}, nil
}

// Port is the proxy's TLS port on 127.0.0.1.
func (x *TLSProxy) Port() int { return x.ln.Addr().(*net.TCPAddr).Port }
