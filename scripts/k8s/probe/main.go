// probe: the one program of the cluster tests' pods (tests/k8s), static so that an image of it
// needs nothing else (trillium/stack/k8s/oci.py):
//
//	probe serve PORT...        answer every TCP connection on each port with "ok\n"
//	probe connect HOST:PORT    exit 0 once connected and answered, 1 when refused or silent for 3 s
//	probe resolve NAME         print NAME's addresses; exit 1 when it does not resolve
package main

import (
	"bufio"
	"fmt"
	"net"
	"os"
	"time"
)

const timeout = 3 * time.Second

func serve(ports []string) {
	for _, port := range ports {
		listener, err := net.Listen("tcp", ":"+port)
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(1)
		}
		go func() {
			for {
				conn, err := listener.Accept()
				if err != nil {
					continue
				}
				conn.Write([]byte("ok\n"))
				conn.Close()
			}
		}()
	}
	select {}
}

func connect(address string) int {
	conn, err := net.DialTimeout("tcp", address, timeout)
	if err != nil {
		fmt.Println("refused:", err)
		return 1
	}
	defer conn.Close()
	conn.SetReadDeadline(time.Now().Add(timeout))
	line, err := bufio.NewReader(conn).ReadString('\n')
	if err != nil {
		fmt.Println("no answer:", err)
		return 1
	}
	fmt.Print(line)
	return 0
}

func resolve(name string) int {
	addresses, err := net.LookupHost(name)
	if err != nil {
		fmt.Println(err)
		return 1
	}
	for _, address := range addresses {
		fmt.Println(address)
	}
	return 0
}

func main() {
	if len(os.Args) < 3 {
		fmt.Fprintln(os.Stderr, "usage: probe serve PORT... | connect HOST:PORT | resolve NAME")
		os.Exit(2)
	}
	switch os.Args[1] {
	case "serve":
		serve(os.Args[2:])
	case "connect":
		os.Exit(connect(os.Args[2]))
	case "resolve":
		os.Exit(resolve(os.Args[2]))
	}
	fmt.Fprintln(os.Stderr, "unknown command", os.Args[1])
	os.Exit(2)
}
