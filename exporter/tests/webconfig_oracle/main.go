// The reference for volprobe's web configuration: exporter-toolkit itself, as node_exporter uses it.
//
//	oracle validate FILE...   one line per file: "accept", "reject <error>" (web.Validate), or
//	                          "reject-at-listen <error>" (valid, but the listener does not start)
//	oracle serve FILE ADDR    serve 200 "ok" behind the configuration, as an exporter would
//
// Built by the tests (exporter/tests/test_webconfig_table.py) with the Go toolchain and the module proxy.
package main

import (
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"strings"
	"time"

	"github.com/prometheus/exporter-toolkit/web"
)

func serve(config, address string) error {
	server := &http.Server{Handler: http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		fmt.Fprintln(w, "ok")
	})}
	addresses := []string{address}
	systemd := false
	flags := &web.FlagConfig{WebListenAddresses: &addresses, WebSystemdSocket: &systemd, WebConfigFile: &config}
	return web.ListenAndServe(server, flags, slog.New(slog.NewTextHandler(os.Stderr, nil)))
}

// listens reports why a valid configuration still cannot serve (Go's HTTP/2 cipher check happens there).
func listens(config string) error {
	probe, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return err
	}
	address := probe.Addr().String()
	probe.Close()
	done := make(chan error, 1)
	go func() { done <- serve(config, address) }()
	select {
	case err := <-done:
		return err
	case <-time.After(100 * time.Millisecond):
		return nil
	}
}

func main() {
	if len(os.Args) == 4 && os.Args[1] == "serve" {
		fmt.Fprintln(os.Stderr, serve(os.Args[2], os.Args[3]))
		os.Exit(1)
	}
	if len(os.Args) < 3 || os.Args[1] != "validate" {
		fmt.Fprintln(os.Stderr, "usage: oracle validate FILE... | oracle serve FILE ADDR")
		os.Exit(2)
	}
	for _, path := range os.Args[2:] {
		outcome := "accept"
		if err := web.Validate(path); err != nil {
			outcome = "reject " + err.Error()
		} else if err := listens(path); err != nil {
			outcome = "reject-at-listen " + err.Error()
		}
		fmt.Printf("%s\t%s\n", path, strings.ReplaceAll(outcome, "\n", " "))
	}
}
