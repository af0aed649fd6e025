// Go's own proxy decision for the differential test of hwkey's NO_PROXY reading
// (tests/it/proxy/no_proxy_oracle.rs): with HTTPS_PROXY and NO_PROXY from the environment,
// prints for each https:// URL read from stdin (one per line) "proxy" or "direct", as
// http.ProxyFromEnvironment (which client-go uses) decides. Standard library only.
package main

import (
	"bufio"
	"fmt"
	"net/http"
	"net/url"
	"os"
)

func main() {
	in := bufio.NewScanner(os.Stdin)
	out := bufio.NewWriter(os.Stdout)
	defer out.Flush()
	for in.Scan() {
		u, err := url.Parse(in.Text())
		if err != nil {
			fmt.Fprintln(out, "invalid")
			continue
		}
		proxy, err := http.ProxyFromEnvironment(&http.Request{URL: u})
		switch {
		case err != nil:
			fmt.Fprintln(out, "error")
		case proxy == nil:
			fmt.Fprintln(out, "direct")
		default:
			fmt.Fprintln(out, "proxy")
		}
	}
}
