//! Issue 35, finding "six NO_PROXY decisions differ from client-go": whether a connection to
//! the API server goes through the environment's forward proxy is decided exactly as Go's
//! `http.ProxyFromEnvironment` (client-go's) decides it. Differential: every entry alone and
//! hundreds of lists of several entries (IPv4, IPv4-mapped IPv6, IPv6 with and without
//! brackets and ports, networks written every way Go accepts, domains with leading dots,
//! `*.`, trailing dots, upper case, empty ports, IDNA names in Unicode and in Punycode,
//! `localhost` in its spellings), against hosts written the same ways, on three ports; Go
//! answers from `hsm-fixtures/noproxy-oracle.go`, hwkey from the same code the proxy routes
//! with (`Egress::from_lookup` + the URL parser of `--upstream`). On 1e6941c, six of these
//! decisions differed (`::ffff:` addresses, trailing dots, IDNA names).

use std::collections::HashMap;
use std::io::Write;
use std::process::{Command, Stdio};

use hwkey::egress::route::Egress;

const ENTRIES: &[&str] = &[
    "10.0.0.1",
    "10.0.0.1:6443",
    "::ffff:10.0.0.1",
    "[::ffff:10.0.0.1]:6443",
    "fd00::1",
    "[fd00::1]",
    "[fd00::1]:443",
    "10.0.0.0/8",
    "10.0.0.0/08",
    "10.0.0.0/+8",
    "::ffff:10.0.0.0/104",
    "::ffff:0:0/96",
    "192.168.1.0/24",
    "fd00::/8",
    "0.0.1",
    "example.com",
    ".example.com",
    "*.example.com",
    "example.com.",
    "EXAMPLE.com:443",
    "example.com:6443",
    "example.com:",
    ":443",
    "bücher.example",
    ".bücher.example",
    "*.bücher.example:8443",
    "xn--bcher-kva.example",
    "例え.jp",
    "MÜNCHEN.de",
    "-bad.example",
    "corp",
    "api.corp:06443",
    "[::1]",
    "localhost",
    "*",
    " spaced.example ",
    "*",
];

const HOSTS: &[&str] = &[
    "example.com",
    "api.example.com",
    "api.example.com.",
    "example.com.",
    "EXAMPLE.COM",
    "badexample.com",
    "xn--bcher-kva.example",
    "a.xn--bcher-kva.example",
    "xn--r8jz45g.jp",
    "xn--mnchen-3ya.de",
    "xn---bad-.example",
    "10.0.0.1",
    "10.2.3.4",
    "11.0.0.1",
    "[::ffff:10.0.0.1]",
    "[::ffff:10.2.3.4]",
    "[::ffff:11.0.0.1]",
    "[fd00::1]",
    "[fd00::2]",
    "[fe80::1]",
    "192.168.1.9",
    "100.0.0.1",
    "localhost",
    "LOCALHOST",
    "localhost.",
    "127.0.0.1",
    "[::1]",
    "[::ffff:127.0.0.1]",
    "corp",
    "api.corp",
    "spaced.example",
];

const PORTS: &[&str] = &["", ":6443", ":443", ":8443"];

/// Go's decisions for `urls` with NO_PROXY=`list`.
fn go_decisions(oracle: &std::path::Path, list: &str, urls: &[String]) -> Vec<String> {
    let mut child = Command::new(oracle)
        .env_clear()
        .env("HTTPS_PROXY", "http://proxy.invalid:3128")
        .env("NO_PROXY", list)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("run the NO_PROXY oracle");
    let input: String = urls.iter().map(|u| format!("{u}\n")).collect();
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(input.as_bytes())
        .expect("write URLs");
    let out = child.wait_with_output().expect("the oracle");
    assert!(out.status.success(), "the NO_PROXY oracle failed");
    String::from_utf8(out.stdout)
        .expect("UTF-8")
        .lines()
        .map(str::to_string)
        .collect()
}

/// hwkey's decision for `url` with NO_PROXY=`list`, by the code the proxy routes with.
fn hwkey_decision(list: &str, url: &str) -> String {
    let vars: HashMap<&str, String> = [
        ("HTTPS_PROXY", "http://proxy.invalid:3128".to_string()),
        ("NO_PROXY", list.to_string()),
    ]
    .into();
    let egress = Egress::from_lookup(|name| vars.get(name).cloned()).expect("egress");
    let target: hwkey::endpoint::UpstreamTarget = url.parse().expect("an --upstream URL");
    match egress.proxy_for(&target.host, target.port) {
        Some(_) => "proxy".into(),
        None => "direct".into(),
    }
}

/// A small deterministic generator (the lists are the same in every run).
struct Lcg(u64);

impl Lcg {
    fn below(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) as usize) % n
    }
}

#[test]
fn every_no_proxy_decision_is_gos() {
    let (oracle, _dir) = support::oracle::build_go("noproxy-oracle");
    let urls: Vec<String> = HOSTS
        .iter()
        .flat_map(|h| PORTS.iter().map(move |p| format!("https://{h}{p}")))
        .collect();
    let mut lists: Vec<String> = ENTRIES.iter().map(|e| e.to_string()).collect();
    let mut rng = Lcg(35);
    let without_star: Vec<&&str> = ENTRIES.iter().filter(|e| **e != "*").collect();
    for _ in 0..300 {
        let n = 2 + rng.below(3);
        let picked: Vec<&str> = (0..n)
            .map(|_| *without_star[rng.below(without_star.len())])
            .collect();
        lists.push(picked.join(","));
    }
    lists.push(String::new());
    lists.push(" , ,".into());
    let mut differ = Vec::new();
    let mut decisions = 0;
    for list in &lists {
        let go = go_decisions(&oracle, list, &urls);
        assert_eq!(go.len(), urls.len(), "one answer per URL");
        for (url, go) in urls.iter().zip(&go) {
            decisions += 1;
            let ours = hwkey_decision(list, url);
            if &ours != go {
                differ.push(format!("NO_PROXY={list:?} {url}: Go {go}, hwkey {ours}"));
            }
        }
    }
    assert!(
        differ.is_empty(),
        "{} of {decisions} decisions differ from Go's:\n{}",
        differ.len(),
        differ[..differ.len().min(40)].join("\n")
    );
    assert!(decisions > 30_000, "{decisions}");
}
