// linkdelay adds latency to every TCP connection into one host of a cluster on this machine
// (trillium/stack/hosts.py), where the kernel has no netem.
//
// It runs in the host's network namespace. An nftables rule there redirects every TCP
// connection that arrives on the host's interface to -listen; linkdelay reads the connection's
// original destination (SO_ORIGINAL_DST), dials it from inside the host with the client's own
// address as its source (IP_TRANSPARENT; the host's routing sends the replies back to it, see
// trillium/stack/hosts.py), and copies both ways, holding each chunk until `delay` after it was
// read. The server so sees the client's address, as it would across a wire: a check of a
// caller's address (the coordinator's of a registration) holds under the harness too. Chunks keep their order and overlap in
// flight, so a stream's throughput is not cut by the delay, only its round trips lengthened:
// what a longer wire does, at the byte stream rather than the packet (TCP's own ACKs and windows
// stay those of the bridge).
//
// Because the original destination is read per connection, every port is covered, those a
// process chooses at run time too (gloo's pairs). Toxiproxy, the usual tool, proxies one
// listen address to one upstream fixed in advance and cannot see them.
//
// The one-way delay is set with `PUT /delay?ms=N` on -control (0 at start); `GET /delay` reads it.
package main

import (
	"errors"
	"flag"
	"fmt"
	"log"
	"math/rand/v2"
	"net"
	"net/http"
	"strconv"
	"sync/atomic"
	"syscall"
	"time"
	"unsafe"
)

// The one-way delay in microseconds, applied to chunks read after it is set.
var delayMicros atomic.Int64

// Chunks held in flight per direction before the reader waits: 64 KiB each, 16 MiB in all.
const (
	chunkBytes = 64 << 10
	inFlight   = 256
)

// The source ports linkdelay's upstream connections take, above Linux's ephemeral range
// (32768-60999, which hosts.py checks): a client's own port never equals one, so an upstream
// connection's tuple cannot be that of a connection still being redirected here.
const (
	upstreamPortLow  = 61000
	upstreamPortHigh = 65535
	// Marks the upstream connections; accepted with tcp_fwmark_accept, the server's replies carry
	// it too and are routed back to this host's loopback rather than out to the client's host.
	upstreamMark = 1
)

type chunk struct {
	data []byte
	due  time.Time
}

func main() {
	listen := flag.String("listen", "", "address:port the redirect rule sends connections to")
	control := flag.String("control", "", "address:port of the delay's HTTP control")
	flag.Parse()
	if *listen == "" || *control == "" {
		log.Fatal("linkdelay: -listen and -control are required")
	}
	ln, err := net.Listen("tcp4", *listen)
	if err != nil {
		log.Fatalf("linkdelay: %v", err)
	}
	http.HandleFunc("/delay", serveDelay)
	go func() { log.Fatal(http.ListenAndServe(*control, nil)) }()
	log.Printf("linkdelay: redirected connections on %s, control on %s", *listen, *control)
	for {
		conn, err := ln.Accept()
		if err != nil {
			log.Printf("linkdelay: accept: %v", err)
			continue
		}
		go relay(conn.(*net.TCPConn))
	}
}

func serveDelay(w http.ResponseWriter, r *http.Request) {
	if r.Method == http.MethodPut {
		ms, err := strconv.ParseFloat(r.URL.Query().Get("ms"), 64)
		if err != nil || ms < 0 {
			http.Error(w, "ms: a number of milliseconds, at least 0", http.StatusBadRequest)
			return
		}
		delayMicros.Store(int64(ms * 1000))
	}
	fmt.Fprintf(w, "{\"ms\": %g}\n", float64(delayMicros.Load())/1000)
}

// originalDst reads where the client meant to connect before the redirect.
func originalDst(conn *net.TCPConn) (string, error) {
	raw, err := conn.SyscallConn()
	if err != nil {
		return "", err
	}
	var addr syscall.RawSockaddrInet4
	var sockErr error
	err = raw.Control(func(fd uintptr) {
		size := uint32(unsafe.Sizeof(addr))
		const soOriginalDst = 80
		_, _, errno := syscall.Syscall6(syscall.SYS_GETSOCKOPT, fd, syscall.IPPROTO_IP, soOriginalDst,
			uintptr(unsafe.Pointer(&addr)), uintptr(unsafe.Pointer(&size)), 0)
		if errno != 0 {
			sockErr = errno
		}
	})
	if err != nil {
		return "", err
	}
	if sockErr != nil {
		return "", sockErr
	}
	port := int(addr.Port>>8) | int(addr.Port&0xff)<<8 // network byte order
	return fmt.Sprintf("%d.%d.%d.%d:%d", addr.Addr[0], addr.Addr[1], addr.Addr[2], addr.Addr[3], port), nil
}

func relay(client *net.TCPConn) {
	dst, err := originalDst(client)
	if err != nil {
		log.Printf("linkdelay: original destination: %v", err)
		client.Close()
		return
	}
	upstream, err := dialAs(client.RemoteAddr().(*net.TCPAddr).IP, dst)
	if err != nil {
		// The client sees a reset, as it would from the host itself.
		client.SetLinger(0)
		client.Close()
		return
	}
	server := upstream.(*net.TCPConn)
	done := make(chan struct{}, 2)
	go pipe(client, server, done)
	go pipe(server, client, done)
	<-done
	<-done
	client.Close()
	server.Close()
}

// dialAs connects to dst from source (not an address of this host), at a free port of the
// upstream range.
func dialAs(source net.IP, dst string) (net.Conn, error) {
	var addr [4]byte
	copy(addr[:], source.To4())
	for tries := 0; ; tries++ {
		port := upstreamPortLow + rand.IntN(upstreamPortHigh-upstreamPortLow+1)
		dialer := net.Dialer{
			Timeout: 10 * time.Second,
			Control: func(network, address string, raw syscall.RawConn) error {
				var sockErr error
				err := raw.Control(func(fd uintptr) {
					sockErr = errors.Join(
						syscall.SetsockoptInt(int(fd), syscall.SOL_IP, syscall.IP_TRANSPARENT, 1),
						syscall.SetsockoptInt(int(fd), syscall.SOL_SOCKET, syscall.SO_MARK, upstreamMark),
					)
					if sockErr == nil {
						sockErr = syscall.Bind(int(fd), &syscall.SockaddrInet4{Port: port, Addr: addr})
					}
				})
				return errors.Join(err, sockErr)
			},
		}
		conn, err := dialer.Dial("tcp4", dst)
		if errors.Is(err, syscall.EADDRINUSE) && tries < 64 {
			continue // another upstream connection of this client holds the port
		}
		return conn, err
	}
}

// sleepUntil blocks this goroutine's thread in nanosleep: Go's own timers overshoot by up to a
// millisecond here, which would add as much to every delayed round trip.
func sleepUntil(due time.Time) {
	if wait := time.Until(due); wait > 0 {
		ts := syscall.NsecToTimespec(int64(wait))
		_ = syscall.Nanosleep(&ts, nil) // EINTR: woken early by a signal, a chunk a little early
	}
}

// pipe copies src to dst, each chunk held until its due time; src's end is passed on as a
// half-close once the chunks before it are written.
func pipe(src, dst *net.TCPConn, done chan<- struct{}) {
	queue := make(chan chunk, inFlight)
	go func() {
		for {
			buf := make([]byte, chunkBytes)
			n, err := src.Read(buf)
			if n > 0 {
				queue <- chunk{buf[:n], time.Now().Add(time.Duration(delayMicros.Load()) * time.Microsecond)}
			}
			if err != nil {
				close(queue)
				return
			}
		}
	}()
	failed := false
	for c := range queue {
		if failed {
			continue // drain, so the reader never blocks on a dead writer
		}
		sleepUntil(c.due)
		if _, err := dst.Write(c.data); err != nil {
			log.Printf("linkdelay: %s -> %s: %v", src.RemoteAddr(), dst.RemoteAddr(), err)
			failed = true
			src.SetLinger(0)
			src.Close()
		}
	}
	if !failed {
		dst.CloseWrite()
	}
	done <- struct{}{}
}
