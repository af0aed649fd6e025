//! Go's own reading of certificate requests, for differential tests: `hsm-fixtures/csr-oracle.go`
//! built with the Go that builds kube-controller-manager (`golang-go`, installed by
//! `hsm-fixtures/build-kube.sh`), run once over a whole batch of requests.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

use base64::Engine as _;
use tempfile::TempDir;

use crate::{find_tool, temp_dir};

/// What Go's `crypto/x509` read from one request (see the oracle's source for each field).
#[derive(Debug, Clone, serde::Deserialize)]
#[serde(rename_all = "camelCase")]
#[allow(missing_docs)]
pub struct GoReading {
    #[serde(default)]
    pub error: String,
    #[serde(default)]
    pub rdns: Vec<Vec<GoAttribute>>,
    #[serde(default)]
    pub raw_subject: String,
    #[serde(default)]
    pub common_name: String,
    #[serde(default)]
    pub organization: Vec<String>,
    #[serde(default)]
    pub organizational_unit: Vec<String>,
    #[serde(default)]
    pub country: Vec<String>,
    #[serde(default)]
    pub locality: Vec<String>,
    #[serde(default)]
    pub province: Vec<String>,
    #[serde(default)]
    pub street_address: Vec<String>,
    #[serde(default)]
    pub postal_code: Vec<String>,
    #[serde(default)]
    pub serial_number: String,
    #[serde(default)]
    pub issued_subject: String,
    #[serde(default)]
    pub dns_names: Vec<String>,
    #[serde(default)]
    pub emails: Vec<String>,
    #[serde(default)]
    pub ips: Vec<String>,
    #[serde(default)]
    pub uris: Vec<String>,
    #[serde(default)]
    pub issued_san: String,
    #[serde(default)]
    pub extensions: Vec<GoExtension>,
    #[serde(default)]
    pub raw_spki: String,
    #[serde(default)]
    pub issued_spki: String,
    #[serde(default)]
    pub signature_valid: bool,
    #[serde(default)]
    pub not_before: i64,
    #[serde(default)]
    pub not_after: i64,
}

/// One subject attribute as Go read it.
#[derive(Debug, Clone, serde::Deserialize)]
#[allow(missing_docs)]
pub struct GoAttribute {
    #[serde(rename = "type")]
    pub oid: String,
    pub value: Option<String>,
}

/// One requested extension as Go read it.
#[derive(Debug, Clone, serde::Deserialize)]
#[allow(missing_docs)]
pub struct GoExtension {
    pub id: String,
    pub critical: bool,
    pub value: String,
}

/// The built oracle.
pub struct GoOracle {
    bin: PathBuf,
    _dir: TempDir,
}

/// The `go` command: on PATH, else the newest /usr/lib/go-*/bin/go.
fn go() -> PathBuf {
    if let Some(go) = find_tool("go") {
        return go;
    }
    let mut found: Vec<PathBuf> = std::fs::read_dir("/usr/lib")
        .map(|rd| {
            rd.filter_map(Result::ok)
                .map(|e| e.path().join("bin/go"))
                .filter(|p| p.is_file())
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    found.pop().unwrap_or_else(|| {
        panic!(
            "go not found: the differential tests compare hwkey's reading of requests with Go's \
             (what kube-controller-manager signs from); install it with `apt-get install \
             golang-go` (hsm-fixtures/build-kube.sh does)"
        )
    })
}

impl GoOracle {
    /// Builds `hsm-fixtures/csr-oracle.go` (standard library only; nothing is fetched).
    pub fn build() -> GoOracle {
        let (bin, dir) = build_go("csr-oracle");
        GoOracle { bin, _dir: dir }
    }

    /// Go's reading of each request (DER).
    pub fn read_der(&self, requests: &[Vec<u8>]) -> Vec<GoReading> {
        self.run(requests, None)
    }

    /// Go's reading of each `spec.request` text (pem.Decode first, as the API server does).
    pub fn read_pem(&self, texts: &[Vec<u8>]) -> Vec<GoReading> {
        self.run(texts, Some("--pem"))
    }

    /// Go's reading of each certificate (DER), with `x509.ParseCertificate`.
    pub fn read_certificates(&self, certificates: &[Vec<u8>]) -> Vec<GoReading> {
        self.run(certificates, Some("--cert"))
    }

    fn run(&self, inputs: &[Vec<u8>], mode: Option<&str>) -> Vec<GoReading> {
        let mut cmd = Command::new(&self.bin);
        if let Some(mode) = mode {
            cmd.arg(mode);
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("run the Go oracle");
        let mut stdin = child.stdin.take().expect("stdin");
        let lines: Vec<u8> = inputs
            .iter()
            .flat_map(|i| {
                let mut line = base64::engine::general_purpose::STANDARD
                    .encode(i)
                    .into_bytes();
                line.push(b'\n');
                line
            })
            .collect();
        let writer = std::thread::spawn(move || stdin.write_all(&lines));
        let out = child.wait_with_output().expect("the Go oracle");
        writer
            .join()
            .expect("writer thread")
            .expect("write to the Go oracle");
        assert!(
            out.status.success(),
            "the Go oracle failed:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let readings: Vec<GoReading> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| serde_json::from_str(l).expect("the oracle's JSON"))
            .collect();
        assert_eq!(readings.len(), inputs.len(), "one reading per request");
        readings
    }
}

/// Builds `hsm-fixtures/NAME.go` (standard library only; nothing is fetched) into a temporary
/// directory: the binary and the directory that holds it.
pub fn build_go(name: &str) -> (PathBuf, TempDir) {
    let dir = temp_dir();
    let bin = dir.path().join(name);
    let source =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("../../hsm-fixtures/{name}.go"));
    let cache = std::env::var_os("GOCACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| std::env::temp_dir().join("hwkey-go-cache"));
    let out = Command::new(go())
        .arg("build")
        .arg("-o")
        .arg(&bin)
        .arg(&source)
        .env("GOCACHE", cache)
        .env("GOFLAGS", "")
        .env("GOPROXY", "off")
        .env("GOTOOLCHAIN", "local")
        .env("GO111MODULE", "off")
        .output()
        .expect("run go build");
    assert!(
        out.status.success(),
        "go build {} failed:\n{}",
        source.display(),
        String::from_utf8_lossy(&out.stderr)
    );
    (bin, dir)
}
