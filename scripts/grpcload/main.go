// grpcload calls trillium.v1.Serving/Predict with given request bodies and reports latency and
// throughput as JSON: the serving benchmarks' second client (bench/serving.py,
// bench/grpc_transport.py). Beside their Python client it says which part of a call's latency is
// the server's and the transport's, and which the Python client's own: Go's gRPC client adds
// tens of microseconds a call, grpc.aio's about a millisecond on this machine.
//
// The request is written in protobuf's wire format by hand (model = 1, instances = 2) and sent
// through a codec that passes bytes as they are, so the tool needs no generated code.
//
//	grpcload -addr 127.0.0.1:50051 -token-file T -model M -bodies B.json -rate 50 -seconds 15
//	grpcload ... -clients 8 -seconds 15
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"log"
	"os"
	"sort"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/metadata"
)

const method = "/trillium.v1.Serving/Predict"

// raw is a codec over []byte: the message is already encoded, the answer is kept encoded.
type raw struct{}

func (raw) Marshal(v any) ([]byte, error) { return *(v.(*[]byte)), nil }
func (raw) Unmarshal(data []byte, v any) error {
	*(v.(*[]byte)) = append([]byte(nil), data...)
	return nil
}
func (raw) Name() string { return "proto" }

func appendVarint(b []byte, x uint64) []byte {
	for x >= 0x80 {
		b = append(b, byte(x)|0x80)
		x >>= 7
	}
	return append(b, byte(x))
}

// predictRequest encodes PredictRequest{model, instances} (proto/serving.proto).
func predictRequest(model string, instances []byte) []byte {
	b := append([]byte{0x0a}, appendVarint(nil, uint64(len(model)))...)
	b = append(b, model...)
	b = append(b, 0x12)
	b = appendVarint(b, uint64(len(instances)))
	return append(b, instances...)
}

type result struct {
	Requests       int     `json:"requests"`
	Errors         int     `json:"errors"`
	FirstError     string  `json:"first_error,omitempty"`
	RequestsPerSec float64 `json:"requests_per_sec"`
	P50Ms          float64 `json:"p50_ms"`
	P99Ms          float64 `json:"p99_ms"`
}

type recorder struct {
	mu        sync.Mutex
	latencies []time.Duration
	errors    int
	first     string
}

func (r *recorder) call(ctx context.Context, conn *grpc.ClientConn, request []byte) {
	var answer []byte
	started := time.Now()
	err := conn.Invoke(ctx, method, &request, &answer, grpc.ForceCodec(raw{}))
	took := time.Since(started)
	r.mu.Lock()
	defer r.mu.Unlock()
	if err != nil {
		if r.errors == 0 {
			r.first = err.Error()
		}
		r.errors++
		return
	}
	r.latencies = append(r.latencies, took)
}

func percentile(sorted []time.Duration, p float64) float64 {
	if len(sorted) == 0 {
		return 0
	}
	// linear interpolation between closest ranks, as numpy.percentile does by default
	rank := p / 100 * float64(len(sorted)-1)
	lo := int(rank)
	hi := lo
	if lo+1 < len(sorted) {
		hi = lo + 1
	}
	frac := rank - float64(lo)
	ms := func(d time.Duration) float64 { return float64(d) / float64(time.Millisecond) }
	return ms(sorted[lo]) + frac*(ms(sorted[hi])-ms(sorted[lo]))
}

func main() {
	addr := flag.String("addr", "", "host:port of the Serving endpoint")
	tokenFile := flag.String("token-file", "", "the bearer token's file")
	model := flag.String("model", "", "the model's name")
	bodiesFile := flag.String("bodies", "", "a JSON list of request bodies (each a JSON array of instances, as a string)")
	rate := flag.Float64("rate", 0, "open loop: requests a second (0: closed loops)")
	clients := flag.Int("clients", 1, "closed loops (when -rate is 0)")
	seconds := flag.Float64("seconds", 15, "how long to send")
	warm := flag.Int("warm", 20, "requests sent first and not measured")
	flag.Parse()
	if *addr == "" || *model == "" || *bodiesFile == "" {
		log.Fatal("grpcload: -addr, -model and -bodies are required")
	}
	var texts []string
	data, err := os.ReadFile(*bodiesFile)
	if err == nil {
		err = json.Unmarshal(data, &texts)
	}
	if err != nil || len(texts) == 0 {
		log.Fatalf("grpcload: -bodies %s: want a non-empty JSON list of strings (%v)", *bodiesFile, err)
	}
	requests := make([][]byte, len(texts))
	for i, t := range texts {
		requests[i] = predictRequest(*model, []byte(t))
	}
	ctx := context.Background()
	if *tokenFile != "" {
		token, err := os.ReadFile(*tokenFile)
		if err != nil {
			log.Fatalf("grpcload: -token-file: %v", err)
		}
		ctx = metadata.AppendToOutgoingContext(ctx, "authorization", "Bearer "+strings.TrimSpace(string(token)))
	}
	conn, err := grpc.NewClient(*addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		log.Fatalf("grpcload: %v", err)
	}
	defer conn.Close()

	warmup := &recorder{}
	for i := 0; i < *warm; i++ {
		warmup.call(ctx, conn, requests[i%len(requests)])
	}
	if warmup.errors > 0 {
		log.Fatalf("grpcload: the warm-up calls failed: %s", warmup.first)
	}
	rec := &recorder{}
	var wg sync.WaitGroup
	start := time.Now()
	deadline := start.Add(time.Duration(*seconds * float64(time.Second)))
	if *rate > 0 {
		n := int(*rate * *seconds)
		for i := 0; i < n; i++ {
			time.Sleep(time.Until(start.Add(time.Duration(float64(i) / *rate * float64(time.Second)))))
			wg.Add(1)
			go func(request []byte) {
				defer wg.Done()
				rec.call(ctx, conn, request)
			}(requests[i%len(requests)])
		}
	} else {
		for k := 0; k < *clients; k++ {
			wg.Add(1)
			go func(k int) {
				defer wg.Done()
				for i := k; time.Now().Before(deadline); i += *clients {
					rec.call(ctx, conn, requests[i%len(requests)])
				}
			}(k)
		}
	}
	wg.Wait()
	elapsed := time.Since(start).Seconds()
	sort.Slice(rec.latencies, func(i, j int) bool { return rec.latencies[i] < rec.latencies[j] })
	out := result{
		Requests:       len(rec.latencies),
		Errors:         rec.errors,
		FirstError:     rec.first,
		RequestsPerSec: float64(len(rec.latencies)) / elapsed,
		P50Ms:          percentile(rec.latencies, 50),
		P99Ms:          percentile(rec.latencies, 99),
	}
	encoded, _ := json.Marshal(out)
	fmt.Println(string(encoded))
}
