package rabbitmq

import (
	"context"
	"crypto/x509"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	amqp "github.com/rabbitmq/amqp091-go"

	"github.com/worker-dev/worker/internal/testkit"
)

// The TLS and connection.blocked tests need a broker of their own: a TLS
// listener needs broker configuration, and a memory alarm blocks every
// publisher on the node. The first of them starts a private RabbitMQ node
// (rabbitmq-server on PATH, next to the shared one, through the same epmd
// and Erlang cookie); TestMain stops it when the package's tests are done.
func TestMain(m *testing.M) {
	code := m.Run()
	if privNode != nil {
		if err := privNode.stop(); err != nil {
			fmt.Fprintf(os.Stderr, "private RabbitMQ node: %v\n", err)
		}
	}
	os.Exit(code)
}

var (
	privNodeOnce sync.Once
	privNode     *privateNode
	privNodeErr  error
)

// privateNode is a RabbitMQ node this test process started: a plain
// listener (guest/guest), a TLS listener that requires a client
// certificate, and the certificates for both sides.
type privateNode struct {
	name   string // Erlang node name, for rabbitmqctl -n
	url    string // amqp://guest:guest@ on the plain listener
	tlsURL string // amqps://guest:guest@ on the TLS listener
	dir    string
	certs  testCerts
	cmd    *exec.Cmd
	exited chan struct{}

	// alarm is held shared by the tests that publish through the node, and
	// exclusively by the one that raises a memory alarm, which blocks every
	// publisher on it.
	alarm sync.RWMutex
}

// testCerts are the PEM files of a throwaway PKI.
type testCerts struct {
	ca, clientCert, clientKey string // client certificate signed by ca
	otherCA                   string // a CA that signed nothing the node shows
}

// usePrivateNode returns the private node, starting it on first use; with
// exclusive no other test uses it until t ends.
func usePrivateNode(t *testing.T, exclusive bool) *privateNode {
	t.Helper()
	testkit.SkipWithoutRabbitMQ(t)
	privNodeOnce.Do(func() { privNode, privNodeErr = startPrivateNode() })
	if privNodeErr != nil {
		t.Fatalf("private RabbitMQ node: %v", privNodeErr)
	}
	if exclusive {
		privNode.alarm.Lock()
		t.Cleanup(privNode.alarm.Unlock)
	} else {
		privNode.alarm.RLock()
		t.Cleanup(privNode.alarm.RUnlock)
	}
	return privNode
}

func startPrivateNode() (*privateNode, error) {
	if _, err := exec.LookPath("rabbitmq-server"); err != nil {
		return nil, fmt.Errorf("%w: install RabbitMQ (Debian: rabbitmq-server); these tests start a node of their own", err)
	}
	dir, err := os.MkdirTemp("", "worker-rabbitmq-")
	if err != nil {
		return nil, err
	}
	// The Debian scripts run the node as the rabbitmq user: it must be
	// able to read the certificates and write its database and logs here.
	if err := os.Chmod(dir, 0o777); err != nil {
		return nil, err
	}
	n := &privateNode{dir: dir, exited: make(chan struct{})}
	if n.certs, err = writeTestCerts(dir); err != nil {
		return nil, err
	}
	ports, err := freePorts(3)
	if err != nil {
		return nil, err
	}
	amqpPort, tlsPort, distPort := ports[0], ports[1], ports[2]
	n.name = fmt.Sprintf("worker-test-%d-%d@localhost", os.Getpid(), amqpPort)
	n.url = fmt.Sprintf("amqp://guest:guest@127.0.0.1:%d/", amqpPort)
	n.tlsURL = fmt.Sprintf("amqps://guest:guest@127.0.0.1:%d/", tlsPort)
	conf := fmt.Sprintf(`listeners.tcp.default = 127.0.0.1:%d
listeners.ssl.default = 127.0.0.1:%d
ssl_options.cacertfile = %s
ssl_options.certfile = %s
ssl_options.keyfile = %s
ssl_options.verify = verify_peer
ssl_options.fail_if_no_peer_cert = true
`, amqpPort, tlsPort, n.certs.ca, filepath.Join(dir, "server.pem"), filepath.Join(dir, "server.key"))
	files := map[string]string{
		"rabbitmq.conf":     conf,
		"rabbitmq-env.conf": "", // not the machine's, which names the shared node
		"enabled_plugins":   "[].",
	}
	for name, body := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
			return nil, err
		}
	}
	out, err := os.Create(filepath.Join(dir, "server.out"))
	if err != nil {
		return nil, err
	}
	n.cmd = exec.Command("rabbitmq-server")
	n.cmd.Env = append(os.Environ(),
		"RABBITMQ_NODENAME="+n.name,
		fmt.Sprintf("RABBITMQ_NODE_PORT=%d", amqpPort),
		fmt.Sprintf("RABBITMQ_DIST_PORT=%d", distPort),
		"RABBITMQ_MNESIA_BASE="+filepath.Join(dir, "mnesia"),
		"RABBITMQ_LOG_BASE="+filepath.Join(dir, "log"),
		"RABBITMQ_CONFIG_FILE="+filepath.Join(dir, "rabbitmq.conf"),
		"RABBITMQ_CONF_ENV_FILE="+filepath.Join(dir, "rabbitmq-env.conf"),
		"RABBITMQ_ENABLED_PLUGINS_FILE="+filepath.Join(dir, "enabled_plugins"),
		"ERL_EPMD_ADDRESS=127.0.0.1",
		"RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS=-kernel inet_dist_use_interface {127,0,0,1}",
	)
	n.cmd.Stdout, n.cmd.Stderr = out, out
	n.cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true} // stop kills the group if the node hangs
	if err := n.cmd.Start(); err != nil {
		return nil, err
	}
	go func() {
		_ = n.cmd.Wait()
		_ = out.Close()
		close(n.exited)
	}()
	if err := n.awaitStartup(3 * time.Minute); err != nil {
		return nil, errors.Join(err, n.stop())
	}
	return n, nil
}

// awaitStartup waits until the plain listener takes an AMQP connection,
// which the node opens only once it has booted.
func (n *privateNode) awaitStartup(within time.Duration) error {
	deadline := time.Now().Add(within)
	for {
		conn, err := amqp.Dial(n.url)
		if err == nil {
			return conn.Close()
		}
		select {
		case <-n.exited:
			return fmt.Errorf("rabbitmq-server exited during startup:\n%s", n.output())
		case <-time.After(200 * time.Millisecond):
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not started within %s: %v\n%s", within, err, n.output())
		}
	}
}

// output is the node's startup output, for errors.
func (n *privateNode) output() string {
	b, _ := os.ReadFile(filepath.Join(n.dir, "server.out"))
	return string(b)
}

// ctl runs rabbitmqctl against the node.
func (n *privateNode) ctl(args ...string) error {
	out, err := exec.Command("rabbitmqctl", append([]string{"-n", n.name}, args...)...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("rabbitmqctl %s: %v\n%s", strings.Join(args, " "), err, out)
	}
	return nil
}

// raiseMemoryAlarm sets the memory high watermark to 0, which raises the
// alarm at once, and returns the function that clears it (back to the
// default 0.4). The test's end clears it too, if the test did not.
func (n *privateNode) raiseMemoryAlarm(t *testing.T) (clearAlarm func()) {
	t.Helper()
	if err := n.ctl("set_vm_memory_high_watermark", "0"); err != nil {
		t.Fatal(err)
	}
	var once sync.Once
	clearAlarm = func() {
		once.Do(func() {
			if err := n.ctl("set_vm_memory_high_watermark", "0.4"); err != nil {
				t.Error(err)
			}
		})
	}
	t.Cleanup(clearAlarm)
	return clearAlarm
}

// stop stops the node (rabbitmqctl stop), kills it if that does not
// work within a minute, and removes its files.
func (n *privateNode) stop() error {
	var err error
	if n.cmd != nil && n.cmd.Process != nil {
		ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		if out, cerr := exec.CommandContext(ctx, "rabbitmqctl", "-n", n.name, "stop").CombinedOutput(); cerr != nil {
			err = fmt.Errorf("rabbitmqctl stop: %v\n%s", cerr, out)
		}
		select {
		case <-n.exited:
		case <-ctx.Done():
			_ = syscall.Kill(-n.cmd.Process.Pid, syscall.SIGKILL)
			<-n.exited
			err = errors.Join(err, errors.New("the node did not stop; killed it"))
		}
	}
	return errors.Join(err, os.RemoveAll(n.dir))
}

// freePorts returns count TCP ports on 127.0.0.1 that were free a moment
// ago.
func freePorts(count int) ([]int, error) {
	var ports []int
	for range count {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, err
		}
		defer ln.Close()
		ports = append(ports, ln.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// writeTestCerts writes a CA, the node's certificate (server.pem and
// server.key, for 127.0.0.1 and localhost) and a client certificate signed
// by it, and a second CA, into dir.
func writeTestCerts(dir string) (testCerts, error) {
	ca, err := testkit.CreateCA(dir, "ca")
	if err != nil {
		return testCerts{}, err
	}
	if _, err := ca.Create("server", x509.ExtKeyUsageServerAuth); err != nil {
		return testCerts{}, err
	}
	client, err := ca.Create("client", x509.ExtKeyUsageClientAuth)
	if err != nil {
		return testCerts{}, err
	}
	other, err := testkit.CreateCA(dir, "other-ca")
	if err != nil {
		return testCerts{}, err
	}
	return testCerts{ca: ca.File, clientCert: client.CertFile, clientKey: client.KeyFile, otherCA: other.File}, nil
}
