// csr-oracle: what Go's crypto/x509 reads from PKCS#10 requests, for hwkey's differential tests.
//
// kube-apiserver and kube-controller-manager read a CertificateSigningRequest's spec.request
// with pem.Decode and x509.ParseCertificateRequest, and kube-controller-manager's signer
// issues the certificate from the parsed x509.CertificateRequest (Subject, SANs, PublicKey).
// hwkey's approver must decide on exactly what they read, so the tests compare its reading with
// this program's, request by request.
//
// With --cert it reads certificates instead, with x509.ParseCertificate, as kube-apiserver's
// client-certificate authenticator does: the approver decides on a certificate attached to a
// request (a person's current certificate) and must read it as Go does.
//
// Input: one request per line on stdin, base64 of its DER (or of a whole PEM text, with
// --pem). Output: one JSON object per line, in the same order. Only the standard library is
// used, so `go build` needs nothing from the network.
package main

import (
	"bufio"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/asn1"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"encoding/pem"
	"fmt"
	"math/big"
	"os"
	"time"
)

type attribute struct {
	Type string `json:"type"`
	// The value when Go reads it as a string (what pkix.Name keeps), else null.
	Value *string `json:"value"`
}

type extension struct {
	ID       string `json:"id"`
	Critical bool   `json:"critical"`
	Value    string `json:"value"`
}

type reading struct {
	Error string `json:"error,omitempty"`
	// The subject's RDNs in order, each with its attributes (empty RDNs included).
	Rdns [][]attribute `json:"rdns,omitempty"`
	// The subject TLV exactly as it appears in the request (hex): what evidence binds.
	RawSubject string `json:"rawSubject,omitempty"`
	// pkix.Name as kube-controller-manager fills it.
	CommonName         string   `json:"commonName,omitempty"`
	Organization       []string `json:"organization,omitempty"`
	OrganizationalUnit []string `json:"organizationalUnit,omitempty"`
	Country            []string `json:"country,omitempty"`
	Locality           []string `json:"locality,omitempty"`
	Province           []string `json:"province,omitempty"`
	StreetAddress      []string `json:"streetAddress,omitempty"`
	PostalCode         []string `json:"postalCode,omitempty"`
	SerialNumber       string   `json:"serialNumber,omitempty"`
	// The subject of a certificate issued from this request (hex DER of Subject.ToRDNSequence()).
	IssuedSubject string `json:"issuedSubject,omitempty"`
	DNSNames      []string `json:"dnsNames,omitempty"`
	Emails        []string `json:"emails,omitempty"`
	IPs           []string `json:"ips,omitempty"`
	URIs          []string `json:"uris,omitempty"`
	// The subjectAltName extension of a certificate issued from this request (hex), as
	// kube-controller-manager's signer makes it: Go's own encoding of the names it parsed.
	IssuedSan string `json:"issuedSan,omitempty"`
	Extensions    []extension `json:"extensions,omitempty"`
	// The SubjectPublicKeyInfo as it appears in the request, and as an issued certificate
	// would hold it (re-marshalled from the parsed key), hex.
	RawSPKI    string `json:"rawSpki,omitempty"`
	IssuedSPKI string `json:"issuedSpki,omitempty"`
	// Whether the request's own signature verifies (kube-apiserver refuses it otherwise).
	SignatureValid bool `json:"signatureValid"`
	// Certificates (--cert): the validity, Unix seconds.
	NotBefore int64 `json:"notBefore,omitempty"`
	NotAfter  int64 `json:"notAfter,omitempty"`
}

// readCert is Go's reading of a certificate: the same fields as a request's, where they apply.
func readCert(der []byte) reading {
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return reading{Error: err.Error()}
	}
	out := reading{
		RawSubject:   hex.EncodeToString(cert.RawSubject),
		CommonName:   cert.Subject.CommonName,
		Organization: nonNil(cert.Subject.Organization),
		RawSPKI:      hex.EncodeToString(cert.RawSubjectPublicKeyInfo),
		Rdns:         rdnsOf(cert.RawSubject),
		Extensions:   []extension{},
		NotBefore:    cert.NotBefore.Unix(),
		NotAfter:     cert.NotAfter.Unix(),
	}
	for _, e := range cert.Extensions {
		out.Extensions = append(out.Extensions, extension{
			ID: e.Id.String(), Critical: e.Critical, Value: hex.EncodeToString(e.Value),
		})
	}
	return out
}

// rdnsOf reads a Name's RDNs in order, each with its attributes (empty RDNs included).
func rdnsOf(raw []byte) [][]attribute {
	out := [][]attribute{}
	var rdns pkix.RDNSequence
	if _, err := asn1.Unmarshal(raw, &rdns); err == nil {
		for _, rdn := range rdns {
			set := []attribute{}
			for _, atv := range rdn {
				a := attribute{Type: atv.Type.String()}
				if s, ok := atv.Value.(string); ok {
					a.Value = &s
				}
				set = append(set, a)
			}
			out = append(out, set)
		}
	}
	return out
}

func read(der []byte) reading {
	csr, err := x509.ParseCertificateRequest(der)
	if err != nil {
		return reading{Error: err.Error()}
	}
	out := reading{
		RawSubject:         hex.EncodeToString(csr.RawSubject),
		CommonName:         csr.Subject.CommonName,
		Organization:       nonNil(csr.Subject.Organization),
		OrganizationalUnit: nonNil(csr.Subject.OrganizationalUnit),
		Country:            nonNil(csr.Subject.Country),
		Locality:           nonNil(csr.Subject.Locality),
		Province:           nonNil(csr.Subject.Province),
		StreetAddress:      nonNil(csr.Subject.StreetAddress),
		PostalCode:         nonNil(csr.Subject.PostalCode),
		SerialNumber:       csr.Subject.SerialNumber,
		DNSNames:           nonNil(csr.DNSNames),
		Emails:             nonNil(csr.EmailAddresses),
		RawSPKI:            hex.EncodeToString(csr.RawSubjectPublicKeyInfo),
		Rdns:               [][]attribute{},
		IPs:                []string{},
		URIs:               []string{},
		Extensions:         []extension{},
		SignatureValid:     csr.CheckSignature() == nil,
	}
	out.Rdns = rdnsOf(csr.RawSubject)
	if issued, err := asn1.Marshal(csr.Subject.ToRDNSequence()); err == nil {
		out.IssuedSubject = hex.EncodeToString(issued)
	}
	for _, ip := range csr.IPAddresses {
		out.IPs = append(out.IPs, ip.String())
	}
	for _, u := range csr.URIs {
		out.URIs = append(out.URIs, u.String())
	}
	for _, e := range csr.Extensions {
		out.Extensions = append(out.Extensions, extension{
			ID: e.Id.String(), Critical: e.Critical, Value: hex.EncodeToString(e.Value),
		})
	}
	out.IssuedSan = issuedSan(csr)
	if csr.PublicKey != nil {
		if spki, err := x509.MarshalPKIXPublicKey(csr.PublicKey); err == nil {
			out.IssuedSPKI = hex.EncodeToString(spki)
		}
	}
	return out
}

// issuer signs the certificates issuedSan makes (one key for the run).
var issuer, _ = ecdsa.GenerateKey(elliptic.P256(), rand.Reader)

// issuedSan is the subjectAltName extension of a certificate made from the request's names
// with x509.CreateCertificate, as kube-controller-manager's signer copies them (hex), or "".
func issuedSan(csr *x509.CertificateRequest) string {
	if len(csr.DNSNames)+len(csr.IPAddresses)+len(csr.EmailAddresses)+len(csr.URIs) == 0 {
		return ""
	}
	tmpl := &x509.Certificate{
		SerialNumber:   big.NewInt(1),
		DNSNames:       csr.DNSNames,
		IPAddresses:    csr.IPAddresses,
		EmailAddresses: csr.EmailAddresses,
		URIs:           csr.URIs,
		NotBefore:      time.Unix(0, 0),
		NotAfter:       time.Unix(1<<31, 0),
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &issuer.PublicKey, issuer)
	if err != nil {
		return ""
	}
	cert, err := x509.ParseCertificate(der)
	if err != nil {
		return ""
	}
	for _, e := range cert.Extensions {
		if e.Id.Equal(asn1.ObjectIdentifier{2, 5, 29, 17}) {
			return hex.EncodeToString(e.Value)
		}
	}
	return ""
}

func nonNil(s []string) []string {
	if s == nil {
		return []string{}
	}
	return s
}

func main() {
	pemInput := len(os.Args) > 1 && os.Args[1] == "--pem"
	certInput := len(os.Args) > 1 && os.Args[1] == "--cert"
	in := bufio.NewScanner(os.Stdin)
	in.Buffer(make([]byte, 1<<20), 1<<26)
	out := bufio.NewWriter(os.Stdout)
	defer out.Flush()
	enc := json.NewEncoder(out)
	for in.Scan() {
		data, err := base64.StdEncoding.DecodeString(in.Text())
		if err != nil {
			fmt.Fprintln(os.Stderr, "csr-oracle: input line is not base64:", err)
			os.Exit(2)
		}
		if pemInput {
			// What kube-apiserver and kube-controller-manager do first.
			block, _ := pem.Decode(data)
			if block == nil || block.Type != "CERTIFICATE REQUEST" {
				enc.Encode(reading{Error: "pem.Decode found no CERTIFICATE REQUEST block"})
				continue
			}
			data = block.Bytes
		}
		reader := read
		if certInput {
			reader = readCert
		}
		if err := enc.Encode(reader(data)); err != nil {
			fmt.Fprintln(os.Stderr, "csr-oracle:", err)
			os.Exit(2)
		}
	}
	if err := in.Err(); err != nil {
		fmt.Fprintln(os.Stderr, "csr-oracle:", err)
		os.Exit(2)
	}
}
