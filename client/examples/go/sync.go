// Command shardcast-sync triggers a Shardcast sync from Go, follows its progress and waits for a
// version: the same gRPC API as the C++ and Python clients, with stubs generated from proto/ by
// build.sh (Debian's protoc-gen-go and protoc-gen-go-grpc, GOPATH mode, no module downloads).
//
//	shardcast-sync sync --src trainer --dst vllm --version 7 [--daemon TARGET] [--verify] [--timeout-s S]
//	shardcast-sync wait --group vllm --version 7 [--daemon TARGET] [--timeout-s S]
//
// Exit codes follow the `shardcast` CLI: 0 ok, 2 usage, 4 daemon unreachable, 5 the daemon
// answered and the operation failed (a failed sync, a version not newer, a wait that timed out).
//
// It registers no memory. A Go program that registers CUDA memory (RegisterRequest.buffers with a
// CudaIpcHandle) sends the bare 64-byte cudaIpcMemHandle_t of a cudaMalloc allocation (not a
// PyTorch shareable handle, which has a version and type byte before it), the buffer's offset in
// it, and its GPU's 16-byte UUID in device_uuid (cudaDeviceProp.uuid: the daemon's device numbers
// may differ from the program's). Memory from cuMemCreate (PyTorch's expandable segments) goes by
// its allocations' file descriptors on the daemon's side channel instead (CudaAllocationsHandle,
// docs/gpu.md).
package main

import (
	"context"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"encoding/json"
	"flag"
	"fmt"
	"io"
	"io/ioutil"
	"os"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/status"

	pb "shardcast/v1"
)

const (
	exitOK          = 0
	exitUsage       = 2
	exitUnreachable = 4
	exitFailed      = 5
)

// defaultTarget is every Shardcast client's default: $SHARDCAST_ADDRESS, $SHARDCAST_SOCKET, then
// the node's socket.
func defaultTarget() string {
	for _, v := range []string{"SHARDCAST_ADDRESS", "SHARDCAST_SOCKET"} {
		if t := os.Getenv(v); t != "" {
			return normalize(t)
		}
	}
	return normalize("/run/shardcast/shardcastd.sock")
}

func normalize(target string) string {
	if strings.HasPrefix(target, "/") {
		return "unix:" + target
	}
	return target
}

func fail(code int, format string, args ...interface{}) {
	fmt.Fprintf(os.Stderr, "shardcast-sync: "+format+"\n", args...)
	os.Exit(code)
}

// dialOptions: the Unix socket needs no credentials (the kernel tells the daemon who calls). Over
// TCP, with $SHARDCAST_TLS_CA set: TLS verifying the daemon identity "shardcast-daemon", with a
// client certificate ($SHARDCAST_TLS_CERT, $SHARDCAST_TLS_KEY) and/or a bearer token
// ($SHARDCAST_TOKEN_FILE); plaintext otherwise (daemons run --insecure). docs/security.md.
func dialOptions(target string) ([]grpc.DialOption, error) {
	caFile := os.Getenv("SHARDCAST_TLS_CA")
	if strings.HasPrefix(target, "unix:") || caFile == "" {
		return []grpc.DialOption{grpc.WithInsecure()}, nil
	}
	ca, err := ioutil.ReadFile(caFile)
	if err != nil {
		return nil, fmt.Errorf("SHARDCAST_TLS_CA: %v", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(ca) {
		return nil, fmt.Errorf("SHARDCAST_TLS_CA %q holds no PEM certificate", caFile)
	}
	config := &tls.Config{RootCAs: pool, ServerName: "shardcast-daemon", MinVersion: tls.VersionTLS12}
	if certFile := os.Getenv("SHARDCAST_TLS_CERT"); certFile != "" {
		pair, err := tls.LoadX509KeyPair(certFile, os.Getenv("SHARDCAST_TLS_KEY"))
		if err != nil {
			return nil, fmt.Errorf("SHARDCAST_TLS_CERT/KEY: %v", err)
		}
		config.Certificates = []tls.Certificate{pair}
	}
	opts := []grpc.DialOption{grpc.WithTransportCredentials(credentials.NewTLS(config))}
	if tokenFile := os.Getenv("SHARDCAST_TOKEN_FILE"); tokenFile != "" {
		text, err := ioutil.ReadFile(tokenFile)
		if err != nil {
			return nil, fmt.Errorf("SHARDCAST_TOKEN_FILE: %v", err)
		}
		token := strings.TrimSpace(strings.SplitN(string(text), "\n", 2)[0])
		if token == "" {
			return nil, fmt.Errorf("SHARDCAST_TOKEN_FILE %q is empty", tokenFile)
		}
		opts = append(opts, grpc.WithPerRPCCredentials(bearer(token)))
	}
	return opts, nil
}

// bearer sends "authorization: Bearer <token>" with every call, over TLS only.
type bearer string

func (b bearer) GetRequestMetadata(context.Context, ...string) (map[string]string, error) {
	return map[string]string{"authorization": "Bearer " + string(b)}, nil
}

func (b bearer) RequireTransportSecurity() bool { return true }

// connect reaches the daemon at `daemon` (default: defaultTarget()), waiting up to five seconds
// as the other clients do.
func connect(daemon string) (*grpc.ClientConn, pb.ShardcastClient) {
	target := defaultTarget()
	if daemon != "" {
		target = normalize(daemon)
	}
	opts, err := dialOptions(target)
	if err != nil {
		fail(exitUsage, "%v", err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	conn, err := grpc.DialContext(ctx, target, append(opts, grpc.WithBlock())...)
	if err != nil {
		fail(exitUnreachable, "shardcastd at %q is not reachable: %v", target, err)
	}
	return conn, pb.NewShardcastClient(conn)
}

func gib(bytes uint64) string { return fmt.Sprintf("%.2f", float64(bytes)/float64(1<<30)) }

func syncID() string {
	b := make([]byte, 4)
	if _, err := rand.Read(b); err != nil {
		fail(1, "no randomness for a sync id: %v", err)
	}
	return "go-" + hex.EncodeToString(b)
}

// follow prints every progress update of the sync until its stream ends; done is closed then.
func follow(ctx context.Context, client pb.ShardcastClient, id string, done chan<- struct{}) {
	defer close(done)
	stream, err := client.Watch(ctx, &pb.WatchRequest{SyncId: id})
	if err != nil {
		return
	}
	for {
		p, err := stream.Recv()
		if err != nil { // io.EOF after the final state; NOT_FOUND when the sync failed before it started
			return
		}
		line := fmt.Sprintf("[%s] %-10s %s/%s GiB wave %d/%d", id, p.State, gib(p.BytesDone), gib(p.BytesTotal),
			p.WavesDone, p.Waves)
		if p.Error != "" {
			line += " error: " + p.Error
		}
		fmt.Fprintln(os.Stderr, line)
	}
}

func runSync(args []string) int {
	fs := flag.NewFlagSet("sync", flag.ContinueOnError)
	src := fs.String("src", "", "source group")
	dst := fs.String("dst", "", "destination group")
	version := fs.Uint64("version", 0, "version to sync (> 0)")
	daemon := fs.String("daemon", "", "daemon target: host:port, unix:PATH or an absolute socket path")
	verify := fs.Bool("verify", false, "checksum every transfer")
	timeoutS := fs.Float64("timeout-s", 0, "sync deadline in seconds (0: the daemon's default)")
	if err := fs.Parse(args); err != nil {
		return exitUsage
	}
	if *src == "" || *dst == "" || *version == 0 || fs.NArg() != 0 {
		fmt.Fprintln(os.Stderr, "shardcast-sync sync: --src, --dst and --version (> 0) are required")
		fs.Usage()
		return exitUsage
	}
	conn, client := connect(*daemon)
	defer conn.Close()

	id := syncID()
	watchCtx, stopWatching := context.WithCancel(context.Background())
	defer stopWatching()
	watched := make(chan struct{})
	go follow(watchCtx, client, id, watched)

	deadline := time.Duration((*timeoutS)+330) * time.Second
	if *timeoutS > 0 {
		deadline = time.Duration((*timeoutS)+30) * time.Second
	}
	ctx, cancel := context.WithTimeout(context.Background(), deadline)
	defer cancel()
	res, err := client.Sync(ctx, &pb.SyncRequest{
		SrcGroup: *src, DstGroup: *dst, Version: *version, SyncId: id,
		Options: &pb.SyncOptions{Verify: *verify, TimeoutMs: uint32(*timeoutS * 1000)},
	})
	// The stream may deliver the final state after the answer: give it two seconds.
	select {
	case <-watched:
	case <-time.After(2 * time.Second):
	}
	stopWatching()
	if err != nil {
		st := status.Convert(err)
		fmt.Fprintf(os.Stderr, "shardcast-sync: sync failed: %s: %s\n", st.Code(), st.Message())
		if st.Code() == codes.Unavailable && strings.Contains(strings.ToLower(st.Message()), "connect") {
			return exitUnreachable
		}
		return exitFailed
	}
	gbps := 0.0
	if res.Seconds > 0 {
		gbps = float64(res.NetworkBytes) / res.Seconds / 1e9
	}
	out, _ := json.Marshal(map[string]interface{}{
		"sync_id": res.SyncId, "version": res.Version, "network_bytes": res.NetworkBytes,
		"seconds": res.Seconds, "gbps": gbps, "plan_cached": res.PlanCached,
	})
	fmt.Println(string(out))
	return exitOK
}

func runWait(args []string) int {
	fs := flag.NewFlagSet("wait", flag.ContinueOnError)
	group := fs.String("group", "", "group to wait for")
	version := fs.Uint64("version", 0, "version to wait for (> 0)")
	daemon := fs.String("daemon", "", "daemon target: host:port, unix:PATH or an absolute socket path")
	timeoutS := fs.Float64("timeout-s", 60, "give up after this many seconds")
	if err := fs.Parse(args); err != nil {
		return exitUsage
	}
	if *group == "" || *version == 0 || *timeoutS <= 0 || fs.NArg() != 0 {
		fmt.Fprintln(os.Stderr, "shardcast-sync wait: --group and --version (> 0) are required, --timeout-s > 0")
		fs.Usage()
		return exitUsage
	}
	conn, client := connect(*daemon)
	defer conn.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Duration(*timeoutS+30)*time.Second)
	defer cancel()
	res, err := client.WaitVersion(ctx, &pb.WaitVersionRequest{
		Group: *group, Version: *version, TimeoutMs: uint32(*timeoutS * 1000)})
	if err != nil {
		st := status.Convert(err)
		fmt.Fprintf(os.Stderr, "shardcast-sync: wait failed: %s: %s\n", st.Code(), st.Message())
		return exitFailed
	}
	if res.Version < *version {
		fmt.Fprintf(os.Stderr, "shardcast-sync: group %q is at version %d after %gs, not %d\n", *group, res.Version,
			*timeoutS, *version)
		return exitFailed
	}
	fmt.Printf("{\"group\":%q,\"version\":%d}\n", *group, res.Version)
	return exitOK
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "usage: shardcast-sync sync --src GROUP --dst GROUP --version N [--daemon TARGET] [--verify] [--timeout-s S]")
	fmt.Fprintln(w, "       shardcast-sync wait --group GROUP --version N [--daemon TARGET] [--timeout-s S]")
}

func main() {
	if len(os.Args) < 2 {
		usage(os.Stderr)
		os.Exit(exitUsage)
	}
	switch os.Args[1] {
	case "sync":
		os.Exit(runSync(os.Args[2:]))
	case "wait":
		os.Exit(runWait(os.Args[2:]))
	case "-h", "--help", "help":
		usage(os.Stdout)
		os.Exit(exitOK)
	default:
		usage(os.Stderr)
		fail(exitUsage, "unknown command %q", os.Args[1])
	}
}
