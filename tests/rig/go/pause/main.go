// The pod sandbox process of the rig's real node: it holds the pod's namespaces, reaps
// orphaned children (it is PID 1 of the pod when the PID namespace is shared) and exits on
// SIGINT or SIGTERM. registry.k8s.io/pause cannot be pulled here; this does the same job.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	sigs := make(chan os.Signal, 8)
	signal.Notify(sigs, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for sig := range sigs {
		if sig != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			var status syscall.WaitStatus
			pid, err := syscall.Wait4(-1, &status, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
