//! A real Kubernetes control plane for the certificate-lifecycle tests: etcd, kube-apiserver
//! and kube-controller-manager (csrsigning, csrapproving, csrcleaner) built from Debian 12's
//! `kubernetes` source package by `hsm-fixtures/build-kube.sh` and cached outside the clone.
//!
//! The cluster's client CA is a [`TestCa`]; kube-controller-manager signs issued client
//! certificates with that same CA (`--cluster-signing-*`), so what it issues authenticates at
//! once. Bootstrap-token authentication is on, and the standard RBAC for kubelet TLS
//! bootstrapping and self-renewal is bound (`system:bootstrappers` → node-bootstrapper and
//! nodeclient; `system:nodes` → selfnodeclient), as kubeadm sets it up. Everything runs on free
//! 127.0.0.1 ports in a temp dir and is killed on Drop.
//!
//! Missing binaries are a test failure naming the command that builds them, never a skip.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use tempfile::TempDir;

use crate::{free_port, output_text, run_ok, temp_dir, ChildGuard, TestCa};

/// How long the API server may take to become ready (etcd + apiserver start on 2 loaded cores).
const READY_TIMEOUT: Duration = Duration::from_secs(120);

/// The bootstrap token every cluster accepts (`<id>.<secret>`).
pub const BOOTSTRAP_TOKEN: &str = "abcdef.0123456789abcdef";

/// The extra group of [`BOOTSTRAP_TOKEN`] (kubeadm's default node token group): the one
/// `deploy/approver.yaml` allows to join nodes.
pub const BOOTSTRAP_GROUP: &str = "system:bootstrappers:kubeadm:default-node-token";

/// The directory holding kube-apiserver and kube-controller-manager: `HWKEY_KUBE_BIN`, else
/// what `hsm-fixtures/build-kube.sh` reports (it only looks when the build is cached).
pub fn kube_bin_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("HWKEY_KUBE_BIN") {
        let d = PathBuf::from(d);
        if d.join("kube-apiserver").is_file() {
            return d;
        }
    }
    let root = std::env::var_os("HWKEY_KUBE_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/var/cache/hwkey/kube"));
    let mut found: Vec<PathBuf> = std::fs::read_dir(&root)
        .map(|rd| {
            rd.filter_map(Result::ok)
                .map(|e| e.path())
                .filter(|p| {
                    p.join("kube-apiserver").is_file()
                        && p.join("kube-controller-manager").is_file()
                })
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    found.pop().unwrap_or_else(|| {
        panic!(
            "no kube-apiserver build in {} (or HWKEY_KUBE_BIN): build it once with \
             `hsm-fixtures/build-kube.sh` (hsm-fixtures/test.sh does this)",
            root.display()
        )
    })
}

/// A running control plane.
pub struct KubeCluster {
    /// The cluster's CA (client CA, signing CA and the API server's serving CA).
    ca_path: PathBuf,
    /// kube-apiserver's arguments but the port (for more API servers on the same etcd).
    apiserver_args: Vec<std::ffi::OsString>,
    /// etcd's command line (to start it again on the same ports).
    etcd_cmd: (PathBuf, Vec<std::ffi::OsString>, u16),
    /// How node certificates are approved (objects installed again after an etcd restore).
    approval: Approval,
    pub port: u16,
    /// Admin kubeconfig (`system:masters`).
    pub admin_kubeconfig: PathBuf,
    /// A kubeconfig holding only the bootstrap token, as kubeadm's bootstrap-kubelet.conf.
    pub bootstrap_kubeconfig: PathBuf,
    // Fields drop in order: the controller manager and the API server before etcd.
    kcm: ChildGuard,
    apiserver: ChildGuard,
    etcd: ChildGuard,
    pub dir: TempDir,
}

impl KubeCluster {
    /// Note: kube-controller-manager 1.20 backdates NotBefore by 5 minutes and sets NotAfter =
    /// NotBefore + `signing_duration`, so a duration of 5m or less issues certificates that are
    /// expired on arrival; 10m gives about 5 minutes of validity.
    ///
    /// Starts etcd, kube-apiserver and kube-controller-manager with `ca` as the cluster CA
    /// (client certificates it issued authenticate; issued certificates are signed by it),
    /// issuing certificates valid for `signing_duration` (`--cluster-signing-duration`), and
    /// installs the bootstrap token and the node RBAC.
    pub fn start(ca: &TestCa, signing_duration: &str) -> KubeCluster {
        KubeCluster::start_with(ca, signing_duration, Approval::BuiltIn)
    }

    /// As [`KubeCluster::start`], with the given approval set-up.
    pub fn start_with(ca: &TestCa, signing_duration: &str, approval: Approval) -> KubeCluster {
        let bin = kube_bin_dir();
        let etcd_bin = crate::find_tool("etcd").unwrap_or_else(|| {
            panic!("etcd not found: install it with `apt-get install etcd-server` (hsm-fixtures/build-kube.sh does)")
        });
        let dir = temp_dir();
        let d = dir.path();
        let (serving_cert, serving_key) = ca.server_cert(d);
        let (admin_cert, admin_key) =
            ca.client_cert(d, "admin", "kubernetes-admin", Some("system:masters"));
        let sa_key = d.join("sa.key");
        // SEC1 ("EC PRIVATE KEY"): kube-apiserver 1.20 reads no PKCS#8 public keys from it.
        run_ok(
            Command::new("openssl")
                .args([
                    "ecparam",
                    "-name",
                    "prime256v1",
                    "-genkey",
                    "-noout",
                    "-out",
                ])
                .arg(&sa_key),
        );

        // etcd on two free ports.
        let (etcd_client, etcd_peer) = (free_port(), free_port());
        let mut cmd = Command::new(etcd_bin);
        cmd.arg("--data-dir")
            .arg(d.join("etcd"))
            .arg(format!(
                "--listen-client-urls=http://127.0.0.1:{etcd_client}"
            ))
            .arg(format!(
                "--advertise-client-urls=http://127.0.0.1:{etcd_client}"
            ))
            .arg(format!("--listen-peer-urls=http://127.0.0.1:{etcd_peer}"))
            .arg(format!(
                "--initial-advertise-peer-urls=http://127.0.0.1:{etcd_peer}"
            ))
            .arg(format!(
                "--initial-cluster=default=http://127.0.0.1:{etcd_peer}"
            ));
        let etcd_cmd = (
            PathBuf::from(cmd.get_program()),
            cmd.get_args().map(|a| a.to_os_string()).collect(),
            etcd_client,
        );
        let mut etcd = ChildGuard::spawn(&mut cmd, "etcd", &d.join("etcd.log"));
        etcd.wait_for_port(etcd_client, Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("etcd did not start: {e}\n{}", etcd.log()));

        let port = free_port();
        let mut cmd = Command::new(bin.join("kube-apiserver"));
        cmd.arg(format!("--etcd-servers=http://127.0.0.1:{etcd_client}"))
            .args(["--bind-address=127.0.0.1", "--advertise-address=127.0.0.1"])
            .arg(format!("--tls-cert-file={}", serving_cert.display()))
            .arg(format!("--tls-private-key-file={}", serving_key.display()))
            .arg(format!("--client-ca-file={}", ca.ca_path().display()))
            .arg("--service-account-issuer=https://kubernetes.default.svc")
            .arg(format!("--service-account-key-file={}", sa_key.display()))
            .arg(format!(
                "--service-account-signing-key-file={}",
                sa_key.display()
            ))
            .args([
                "--service-cluster-ip-range=10.96.0.0/24",
                "--authorization-mode=Node,RBAC",
            ])
            .arg("--enable-bootstrap-token-auth")
            .arg(format!(
                "--cert-dir={}",
                d.join("apiserver-certs").display()
            ));
        let apiserver_args: Vec<std::ffi::OsString> =
            cmd.get_args().map(|a| a.to_os_string()).collect();
        cmd.arg(format!("--secure-port={port}"));
        let mut apiserver = ChildGuard::spawn(&mut cmd, "kube-apiserver", &d.join("apiserver.log"));

        let admin_kubeconfig = d.join("admin.kubeconfig");
        std::fs::write(
            &admin_kubeconfig,
            kubeconfig(
                port,
                &ca.ca_path(),
                &format!(
                    "    client-certificate: {}\n    client-key: {}\n",
                    admin_cert.display(),
                    admin_key.display()
                ),
            ),
        )
        .expect("write admin kubeconfig");
        let bootstrap_kubeconfig = d.join("bootstrap.kubeconfig");
        std::fs::write(
            &bootstrap_kubeconfig,
            kubeconfig(
                port,
                &ca.ca_path(),
                &format!("    token: {BOOTSTRAP_TOKEN}\n"),
            ),
        )
        .expect("write bootstrap kubeconfig");

        // Ready when /readyz answers ok to the admin.
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let out = Command::new("kubectl")
                .env("KUBECONFIG", &admin_kubeconfig)
                .args(["get", "--raw", "/readyz", "--request-timeout=5s"])
                .output()
                .expect("run kubectl");
            if out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == "ok" {
                break;
            }
            if let Some(status) = apiserver.try_wait() {
                panic!("kube-apiserver exited ({status}):\n{}", apiserver.log());
            }
            assert!(
                Instant::now() < deadline,
                "kube-apiserver not ready after {READY_TIMEOUT:?}: {}\n{}",
                output_text(&out),
                tail(&apiserver.log())
            );
            std::thread::sleep(Duration::from_millis(500));
        }

        let mut cmd = Command::new(bin.join("kube-controller-manager"));
        cmd.arg(format!("--kubeconfig={}", admin_kubeconfig.display()))
            .args(["--leader-elect=false", "--port=0", "--secure-port=0"])
            .arg(match approval {
                Approval::BuiltIn => "--controllers=csrsigning,csrapproving,csrcleaner,clusterrole-aggregation,namespace",
                Approval::SignerOnly => "--controllers=csrsigning,csrcleaner,clusterrole-aggregation,namespace",
                Approval::TestSigner => "--controllers=csrcleaner,clusterrole-aggregation,namespace",
            })
            .arg(format!("--cluster-signing-cert-file={}", ca.ca_path().display()))
            .arg(format!("--cluster-signing-key-file={}", ca.key_path().display()))
            .arg(format!("--cluster-signing-duration={signing_duration}"));
        let kcm = ChildGuard::spawn(&mut cmd, "kube-controller-manager", &d.join("kcm.log"));

        let cluster = KubeCluster {
            ca_path: ca.ca_path(),
            apiserver_args,
            etcd_cmd,
            approval,
            port,
            admin_kubeconfig,
            bootstrap_kubeconfig,
            kcm,
            apiserver,
            etcd,
            dir,
        };
        cluster.apply(BOOTSTRAP_TOKEN_OBJECTS);
        if approval == Approval::BuiltIn {
            cluster.apply(AUTO_APPROVAL_OBJECTS);
        }
        cluster
    }

    /// What an operator restoring etcd from nothing does: the API server stops, etcd starts
    /// again on an empty data directory (same ports), the API server starts again on the same
    /// port and certificates, and the bootstrap token and node RBAC are installed again. Every
    /// object is gone and resource versions start over (lower than any a client holds);
    /// kube-controller-manager and every client are left running.
    pub fn restore_wiped_etcd(&mut self) {
        self.apiserver.kill();
        self.etcd.kill();
        let d = self.dir.path().to_path_buf();
        std::fs::remove_dir_all(d.join("etcd")).expect("wipe etcd's data directory");
        let (program, args, client_port) = self.etcd_cmd.clone();
        let mut etcd = ChildGuard::spawn(
            Command::new(program).args(args),
            "etcd (restored)",
            &d.join("etcd-restored.log"),
        );
        etcd.wait_for_port(client_port, Duration::from_secs(30))
            .unwrap_or_else(|e| panic!("etcd did not start again: {e}\n{}", etcd.log()));
        self.etcd = etcd;
        let mut cmd = Command::new(kube_bin_dir().join("kube-apiserver"));
        cmd.args(&self.apiserver_args)
            .arg(format!("--secure-port={}", self.port));
        self.apiserver = ChildGuard::spawn(
            &mut cmd,
            "kube-apiserver (restored)",
            &d.join("apiserver-restored.log"),
        );
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let out = self
                .kubectl()
                .args(["get", "--raw", "/readyz", "--request-timeout=5s"])
                .output()
                .expect("run kubectl");
            if out.status.success() && String::from_utf8_lossy(&out.stdout).trim() == "ok" {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "kube-apiserver not ready again after {READY_TIMEOUT:?}: {}\n{}",
                output_text(&out),
                tail(&self.apiserver.log())
            );
            std::thread::sleep(Duration::from_millis(500));
        }
        self.apply(BOOTSTRAP_TOKEN_OBJECTS);
        if self.approval == Approval::BuiltIn {
            self.apply(AUTO_APPROVAL_OBJECTS);
        }
    }

    /// The API server's port on 127.0.0.1.
    pub fn port(&self) -> u16 {
        self.port
    }

    /// `https://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    /// Another kube-apiserver on the same etcd (a highly available control plane), on a port
    /// of its own; ready when this returns.
    pub fn another_apiserver(&self) -> ApiServer {
        let mut s = ApiServer {
            port: free_port(),
            args: self.apiserver_args.clone(),
            admin_kubeconfig: self.admin_kubeconfig.clone(),
            log: self.dir.path().join(format!("apiserver-{}.log", self.port)),
            guard: None,
        };
        s.start();
        s
    }

    /// kubectl as the cluster admin.
    pub fn kubectl(&self) -> Command {
        let mut cmd = Command::new("kubectl");
        cmd.env("KUBECONFIG", &self.admin_kubeconfig);
        cmd
    }

    /// `kubectl apply -f -` of `yaml` as the admin.
    pub fn apply(&self, yaml: &str) {
        let path = self.dir.path().join("apply.yaml");
        std::fs::write(&path, yaml).expect("write manifest");
        run_ok(self.kubectl().arg("apply").arg("-f").arg(&path));
    }

    /// A kubeconfig for service account `namespace/name`, with a token from the TokenRequest API
    /// (`kubectl create token`), as a pod of that account would authenticate.
    pub fn service_account_kubeconfig(&self, namespace: &str, name: &str) -> PathBuf {
        let out = self.kubectl_ok(&["-n", namespace, "create", "token", name, "--duration=1h"]);
        let token = String::from_utf8_lossy(&out.stdout).trim().to_string();
        let path = self
            .dir
            .path()
            .join(format!("{namespace}-{name}.kubeconfig"));
        std::fs::write(
            &path,
            kubeconfig(self.port, &self.ca_path, &format!("    token: {token}\n")),
        )
        .expect("write service account kubeconfig");
        path
    }

    /// A kubeconfig that authenticates with the client certificate `cert` and its key `key`.
    pub fn cert_kubeconfig(&self, name: &str, cert: &Path, key: &Path) -> PathBuf {
        let path = self.dir.path().join(format!("{name}.kubeconfig"));
        let user = format!(
            "    client-certificate: {}\n    client-key: {}\n",
            cert.display(),
            key.display()
        );
        std::fs::write(&path, kubeconfig(self.port, &self.ca_path, &user))
            .expect("write kubeconfig");
        path
    }

    /// Installs another bootstrap token `ID.SECRET` (6 and 16 lowercase characters) whose
    /// identities get `extra_group`; returns a kubeconfig holding it.
    pub fn bootstrap_token_kubeconfig(&self, id: &str, secret: &str, extra_group: &str) -> PathBuf {
        self.apply(&format!(
            "apiVersion: v1\nkind: Secret\nmetadata:\n  name: bootstrap-token-{id}\n  namespace: kube-system\ntype: bootstrap.kubernetes.io/token\nstringData:\n  token-id: {id}\n  token-secret: {secret}\n  usage-bootstrap-authentication: \"true\"\n  auth-extra-groups: {extra_group}\n"
        ));
        let path = self.dir.path().join(format!("bootstrap-{id}.kubeconfig"));
        let user = format!("    token: {id}.{secret}\n");
        std::fs::write(&path, kubeconfig(self.port, &self.ca_path, &user))
            .expect("write kubeconfig");
        path
    }

    /// Runs kubectl as the admin; panics with its output on failure.
    pub fn kubectl_ok(&self, args: &[&str]) -> Output {
        run_ok(self.kubectl().args(args))
    }

    /// The logs of the control plane, for failure messages.
    pub fn logs(&self) -> String {
        format!(
            "--- kube-controller-manager ---\n{}\n--- kube-apiserver ---\n{}",
            tail(&self.kcm.log()),
            tail(&self.apiserver.log())
        )
    }

    /// The CA file clients verify the API server with.
    pub fn ca_path(&self) -> PathBuf {
        self.ca_path.clone()
    }

    /// Where this cluster's files live.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// Keeps etcd alive in the struct (it is only ever dropped).
    pub fn etcd_pid(&self) -> u32 {
        self.etcd.id()
    }
}

fn tail(log: &str) -> String {
    let lines: Vec<&str> = log.lines().collect();
    lines[lines.len().saturating_sub(40)..].join("\n")
}

fn kubeconfig(port: u16, ca: &Path, user: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: test\n  cluster:\n    server: https://127.0.0.1:{port}\n    certificate-authority: {}\nusers:\n- name: test\n  user:\n{user}contexts:\n- name: test\n  context: {{cluster: test, user: test}}\ncurrent-context: test\n",
        ca.display()
    )
}

/// Who approves kubelet client certificate requests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Approval {
    /// kube-controller-manager's csrapproving controller, with the RBAC kubeadm binds
    /// (bootstrappers → nodeclient, nodes → selfnodeclient).
    BuiltIn,
    /// Neither: kube-controller-manager only signs, so only an external approver (hwkey's)
    /// decides, as docs/ATTESTATION.md tells operators to set it up.
    SignerOnly,
    /// kube-controller-manager neither approves nor signs: the test approves and writes
    /// `status.certificate` itself (a signer that misbehaves on purpose).
    TestSigner,
}

/// The bootstrap token and the RBAC that lets bootstrappers create requests.
const BOOTSTRAP_TOKEN_OBJECTS: &str = r#"apiVersion: v1
kind: Secret
metadata:
  name: bootstrap-token-abcdef
  namespace: kube-system
type: bootstrap.kubernetes.io/token
stringData:
  token-id: abcdef
  token-secret: 0123456789abcdef
  usage-bootstrap-authentication: "true"
  auth-extra-groups: system:bootstrappers:kubeadm:default-node-token
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: hwkey-test:node-bootstrapper
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: system:node-bootstrapper
subjects:
- apiGroup: rbac.authorization.k8s.io
  kind: Group
  name: system:bootstrappers
"#;

/// The RBAC kubeadm sets up for the built-in auto-approval of bootstrap and renewal requests.
const AUTO_APPROVAL_OBJECTS: &str = r#"apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: hwkey-test:nodeclient
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: system:certificates.k8s.io:certificatesigningrequests:nodeclient
subjects:
- apiGroup: rbac.authorization.k8s.io
  kind: Group
  name: system:bootstrappers
---
apiVersion: rbac.authorization.k8s.io/v1
kind: ClusterRoleBinding
metadata:
  name: hwkey-test:selfnodeclient
roleRef:
  apiGroup: rbac.authorization.k8s.io
  kind: ClusterRole
  name: system:certificates.k8s.io:certificatesigningrequests:selfnodeclient
subjects:
- apiGroup: rbac.authorization.k8s.io
  kind: Group
  name: system:nodes
"#;

/// An extra kube-apiserver of a [`KubeCluster`] (see [`KubeCluster::another_apiserver`]), which
/// a test may kill and start again on the same port.
pub struct ApiServer {
    pub port: u16,
    args: Vec<std::ffi::OsString>,
    admin_kubeconfig: PathBuf,
    log: PathBuf,
    guard: Option<ChildGuard>,
}

impl ApiServer {
    /// `https://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("https://127.0.0.1:{}", self.port)
    }

    /// Kills it at once (SIGKILL: no graceful close of its connections).
    pub fn kill(&mut self) {
        drop(self.guard.take());
    }

    /// Starts it (again) on its port and waits until it answers /readyz.
    pub fn start(&mut self) {
        let mut cmd = Command::new(kube_bin_dir().join("kube-apiserver"));
        cmd.args(&self.args)
            .arg(format!("--secure-port={}", self.port));
        let mut guard = ChildGuard::spawn(&mut cmd, "kube-apiserver (another)", &self.log);
        let deadline = Instant::now() + READY_TIMEOUT;
        loop {
            let out = Command::new("kubectl")
                .env("KUBECONFIG", &self.admin_kubeconfig)
                .args([
                    "--server",
                    &self.url(),
                    "get",
                    "--raw",
                    "/readyz",
                    "--request-timeout=5s",
                ])
                .output()
                .expect("run kubectl");
            if out.status.success() {
                break;
            }
            if let Some(status) = guard.try_wait() {
                panic!("kube-apiserver exited ({status}):\n{}", guard.log());
            }
            assert!(
                Instant::now() < deadline,
                "the other kube-apiserver is not ready: {}",
                tail(&guard.log())
            );
            std::thread::sleep(Duration::from_millis(300));
        }
        self.guard = Some(guard);
    }
}
