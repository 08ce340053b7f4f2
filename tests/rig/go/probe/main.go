// probe: the one program in the rig's test image (a static binary in an image with no other
// files). Each subcommand checks one thing a pod on the real node must be able to do and
// prints what it found; it exits non-zero, naming the cause, when the check fails.
//
//	probe echo WORDS...        print WORDS (a pod that runs to Completed; kubectl logs/exec)
//	probe serve PORT           answer each TCP connection with "hello from HOSTNAME", until SIGTERM
//	probe connect HOST:PORT    dial (resolving HOST through the pod's DNS) and print the answer
//	probe resolve NAME         print the addresses NAME resolves to
//	probe whoami               ask the apiserver, in-cluster (KUBERNETES_SERVICE_HOST and the
//	                           ServiceAccount token), who this pod is: prints the username
//	probe get URL              HTTP GET; print the status code and body
//
// connect, resolve, whoami and get retry for up to PROBE_TIMEOUT seconds (default 60), so a
// pod started before its peer or before its DNS record exists still passes.
package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"
)

const saDir = "/var/run/secrets/kubernetes.io/serviceaccount"

func main() {
	if len(os.Args) < 2 {
		fail("usage: probe echo|serve|connect|resolve|whoami|get ARGS")
	}
	args := os.Args[2:]
	switch os.Args[1] {
	case "echo":
		fmt.Println(strings.Join(args, " "))
	case "serve":
		need(args, 1)
		serve(args[0])
	case "connect":
		need(args, 1)
		retry("connect "+args[0], func() (string, error) { return connect(args[0]) })
	case "resolve":
		need(args, 1)
		retry("resolve "+args[0], func() (string, error) {
			addrs, err := net.DefaultResolver.LookupHost(context.Background(), args[0])
			return strings.Join(addrs, " "), err
		})
	case "whoami":
		retry("whoami", whoami)
	case "get":
		need(args, 1)
		retry("GET "+args[0], func() (string, error) { return get(args[0]) })
	default:
		fail("unknown subcommand " + os.Args[1])
	}
}

func fail(msg string) {
	fmt.Fprintln(os.Stderr, "probe: "+msg)
	os.Exit(2)
}

func need(args []string, n int) {
	if len(args) < n {
		fail(fmt.Sprintf("%s needs %d argument(s)", os.Args[1], n))
	}
}

func retry(what string, check func() (string, error)) {
	limit := 60
	if v, err := strconv.Atoi(os.Getenv("PROBE_TIMEOUT")); err == nil {
		limit = v
	}
	deadline := time.Now().Add(time.Duration(limit) * time.Second)
	for {
		out, err := check()
		if err == nil {
			fmt.Println(out)
			return
		}
		if time.Now().After(deadline) {
			fail(fmt.Sprintf("%s: %v (gave up after %ds)", what, err, limit))
		}
		time.Sleep(500 * time.Millisecond)
	}
}

func serve(port string) {
	ln, err := net.Listen("tcp", ":"+port)
	if err != nil {
		fail(err.Error())
	}
	host, _ := os.Hostname()
	fmt.Printf("serving on :%s as %s\n", port, host)
	go func() {
		for {
			conn, err := ln.Accept()
			if err != nil {
				return
			}
			fmt.Fprintf(conn, "hello from %s\n", host)
			conn.Close()
		}
	}()
	sigs := make(chan os.Signal, 1)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM)
	<-sigs
}

func connect(addr string) (string, error) {
	conn, err := net.DialTimeout("tcp", addr, 5*time.Second)
	if err != nil {
		return "", err
	}
	defer conn.Close()
	conn.SetDeadline(time.Now().Add(5 * time.Second))
	data, err := io.ReadAll(conn)
	return strings.TrimSpace(string(data)), err
}

func get(url string) (string, error) {
	client := &http.Client{Timeout: 10 * time.Second}
	resp, err := client.Get(url)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	return fmt.Sprintf("%d %s", resp.StatusCode, body), err
}

// whoami does what client-go's in-cluster config does: KUBERNETES_SERVICE_HOST/PORT, the
// mounted CA and token; then a SelfSubjectReview, which every authenticated user may create.
func whoami() (string, error) {
	host, port := os.Getenv("KUBERNETES_SERVICE_HOST"), os.Getenv("KUBERNETES_SERVICE_PORT")
	if host == "" || port == "" {
		return "", fmt.Errorf("KUBERNETES_SERVICE_HOST/PORT not set")
	}
	token, err := os.ReadFile(saDir + "/token")
	if err != nil {
		return "", err
	}
	ca, err := os.ReadFile(saDir + "/ca.crt")
	if err != nil {
		return "", err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(ca) {
		return "", fmt.Errorf("no certificate in %s/ca.crt", saDir)
	}
	client := &http.Client{
		Timeout:   10 * time.Second,
		Transport: &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}},
	}
	body := []byte(`{"apiVersion":"authentication.k8s.io/v1","kind":"SelfSubjectReview"}`)
	url := "https://" + net.JoinHostPort(host, port) + "/apis/authentication.k8s.io/v1/selfsubjectreviews"
	req, err := http.NewRequest("POST", url, bytes.NewReader(body))
	if err != nil {
		return "", err
	}
	req.Header.Set("Authorization", "Bearer "+strings.TrimSpace(string(token)))
	req.Header.Set("Content-Type", "application/json")
	resp, err := client.Do(req)
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return "", err
	}
	if resp.StatusCode != http.StatusCreated {
		return "", fmt.Errorf("%s: %d %s", url, resp.StatusCode, data)
	}
	var review struct {
		Status struct {
			UserInfo struct {
				Username string `json:"username"`
			} `json:"userInfo"`
		} `json:"status"`
	}
	if err := json.Unmarshal(data, &review); err != nil {
		return "", err
	}
	return review.Status.UserInfo.Username, nil
}
