// An HTTPS server on Go's crypto/tls, configured as kube-apiserver configures its listener for
// client certificates (TLS 1.3, RequireAndVerifyClientCert against a client CA), for tests of
// what hwkey does against Go's TLS stack: when resuming a session, Go sends its session ticket
// in its first flight, with its Finished (a server that asks for no certificate can), where
// rustls and OpenSSL send theirs after the client's Finished.
//
// Usage: go-tls-server PORT CERT KEY CLIENT_CA. Listens on 127.0.0.1:PORT and serves GET /version
// (the client certificate's common name, whether the session resumed) until killed.
// Standard library only.
package main

import (
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"fmt"
	"net"
	"net/http"
	"os"
)

func main() {
	if len(os.Args) != 5 {
		fmt.Fprintln(os.Stderr, "usage: go-tls-server PORT CERT KEY CLIENT_CA")
		os.Exit(2)
	}
	cert, err := tls.LoadX509KeyPair(os.Args[2], os.Args[3])
	if err != nil {
		fmt.Fprintln(os.Stderr, "server certificate:", err)
		os.Exit(1)
	}
	caPEM, err := os.ReadFile(os.Args[4])
	if err != nil {
		fmt.Fprintln(os.Stderr, "client CA:", err)
		os.Exit(1)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(caPEM) {
		fmt.Fprintln(os.Stderr, "client CA: no certificate")
		os.Exit(1)
	}
	config := &tls.Config{
		Certificates: []tls.Certificate{cert},
		ClientAuth:   tls.RequireAndVerifyClientCert,
		ClientCAs:    pool,
		MinVersion:   tls.VersionTLS13,
		NextProtos:   []string{"h2", "http/1.1"},
	}
	listener, err := net.Listen("tcp", "127.0.0.1:"+os.Args[1])
	if err != nil {
		fmt.Fprintln(os.Stderr, "listen:", err)
		os.Exit(1)
	}
	mux := http.NewServeMux()
	mux.HandleFunc("/version", func(w http.ResponseWriter, r *http.Request) {
		user := ""
		if r.TLS != nil && len(r.TLS.PeerCertificates) > 0 {
			user = r.TLS.PeerCertificates[0].Subject.CommonName
		}
		w.Header().Set("Content-Type", "application/json")
		json.NewEncoder(w).Encode(map[string]interface{}{
			"user":     user,
			"resumed":  r.TLS != nil && r.TLS.DidResume,
			"protocol": r.Proto,
		})
	})
	server := &http.Server{Handler: mux, TLSConfig: config}
	if err := server.ServeTLS(listener, "", ""); err != nil {
		fmt.Fprintln(os.Stderr, "serve:", err)
		os.Exit(1)
	}
}
