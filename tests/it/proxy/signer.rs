//! The signer: the key in a process of its own that signs only handshakes, requests for its own
//! identity and health checks. These tests play a compromised network side: they start the
//! signer side exactly as `hwkey proxy` does (`hwkey signer-supervisor` with its socket as
//! standard input and the configuration as the first message), then send forged requests over
//! the signer's socket; and they kill a running proxy's signer to see it come back.

// Tests here need one backend or the other; in a single-backend build some helpers are unused.
#![cfg_attr(not(all(feature = "pkcs11", feature = "tpm")), allow(unused))]

use std::os::fd::{AsFd, OwnedFd};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use hwkey::key::{Purpose, SignScheme};
use hwkey::signer::config::{SignerConfig, SignerConfigWire};
use hwkey::signer::protocol::{self, Envelope, KeyInfo, RemoteKind, Reply, Request};
use support::proxy::{Identity, ProxyProcess};
use support::upstream::TestUpstream;
use support::*;

/// The signer side of `id`'s key, started as the proxy starts it, and the socket to one signer.
struct SignerSide {
    supervisor: std::process::Child,
    _control: OwnedFd,
    socket: OwnedFd,
    key: KeyInfo,
    next_id: u64,
}

impl SignerSide {
    fn start(id: &Identity) -> SignerSide {
        SignerSide::start_with(id, None)
    }

    /// With `--rotate-key`'s state directory (its `current-key` names the key to open).
    fn start_with(id: &Identity, rotation_state: Option<&std::path::Path>) -> SignerSide {
        let (control, theirs) = pair();
        let supervisor = hwkey()
            .envs(id.envs())
            .arg("signer-supervisor")
            .stdin(Stdio::from(theirs))
            .spawn()
            .expect("start the supervisor");
        let config = SignerConfig {
            key: id.key_uri.parse().expect("URI"),
            rotation_state: rotation_state.map(std::path::Path::to_path_buf),
            cert: Some(id.cert.clone()),
            identity: None,
            upstream_ca: Some(id.ca.ca_path()),
            tls12: false,
            require_non_extractable: true,
        };
        protocol::send(control.as_fd(), 0, &SignerConfigWire::from(&config)).expect("config");
        let supervisor_handle = SupervisorSocket(&control);
        let socket = supervisor_handle.spawn();
        let hello: Envelope<Reply> = protocol::recv(socket.as_fd())
            .expect("greeting")
            .expect("a greeting");
        let Reply::Hello { key, .. } = hello.body else {
            panic!("the signer did not greet: {:?}", hello.body)
        };
        SignerSide {
            supervisor,
            _control: control,
            socket,
            key,
            next_id: 1,
        }
    }

    /// A new signer from the supervisor (as the network side asks after a signer died, or
    /// whenever it likes), which becomes the one asked.
    fn respawn(&mut self) {
        let socket = SupervisorSocket(&self._control).spawn();
        let hello: Envelope<Reply> = protocol::recv(socket.as_fd())
            .expect("greeting")
            .expect("a greeting");
        let Reply::Hello { key, .. } = hello.body else {
            panic!("the new signer did not greet: {:?}", hello.body)
        };
        self.socket = socket;
        self.key = key;
    }

    fn ask(&mut self, request: Request) -> Reply {
        self.next_id += 1;
        protocol::send(self.socket.as_fd(), self.next_id, &request).expect("send");
        let reply: Envelope<Reply> = protocol::recv(self.socket.as_fd())
            .expect("recv")
            .expect("a reply");
        assert_eq!(reply.id, self.next_id);
        reply.body
    }

    fn sign(&mut self, purpose: Purpose, message: &[u8]) -> Reply {
        self.ask(Request::Sign {
            key: self.key.id,
            purpose,
            scheme: SignScheme::EcdsaP256Sha256,
            message: message.to_vec(),
        })
    }
}

impl Drop for SignerSide {
    fn drop(&mut self) {
        let _ = self.supervisor.kill();
        let _ = self.supervisor.wait();
    }
}

/// Asks the supervisor for a signer over `control` (as the proxy's network side does).
struct SupervisorSocket<'a>(&'a OwnedFd);

impl SupervisorSocket<'_> {
    fn spawn(&self) -> OwnedFd {
        use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendFlags};
        rustix::net::send(self.0.as_fd(), b"s", SendFlags::NOSIGNAL).expect("ask");
        let mut space = [std::mem::MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut ancillary = RecvAncillaryBuffer::new(&mut space);
        let mut byte = [0u8; 1];
        rustix::net::recvmsg(
            self.0.as_fd(),
            &mut [std::io::IoSliceMut::new(&mut byte)],
            &mut ancillary,
            RecvFlags::CMSG_CLOEXEC,
        )
        .expect("the supervisor's answer");
        for message in ancillary.drain() {
            if let RecvAncillaryMessage::ScmRights(mut fds) = message {
                return fds.next().expect("a socket");
            }
        }
        panic!("the supervisor sent no socket");
    }
}

fn pair() -> (OwnedFd, OwnedFd) {
    rustix::net::socketpair(
        rustix::net::AddressFamily::UNIX,
        rustix::net::SocketType::SEQPACKET,
        rustix::net::SocketFlags::CLOEXEC,
        None,
    )
    .expect("socketpair")
}

/// A TLS 1.3 client CertificateVerify content with a SHA-256 transcript hash.
fn certificate_verify(context: &[u8]) -> Vec<u8> {
    let mut m = vec![0x20; 64];
    m.extend_from_slice(context);
    m.push(0);
    m.extend_from_slice(&[0x5a; 32]);
    m
}

fn refused(reply: &Reply) -> bool {
    matches!(reply, Reply::Error { error } if error.kind == RemoteKind::Refused)
}

/// A compromised network side gets handshakes signed and nothing else: a JWT, arbitrary data,
/// a server's CertificateVerify, a CSR for another name (or with another key, or with a SAN),
/// a health check of other data, TPM evidence for another subject, a chain for another
/// identity, and deleting the configured key are all refused; the signature it did get
/// verifies with the key's public key.
#[cfg(feature = "pkcs11")]
#[test]
fn the_signer_refuses_forged_requests_and_signs_handshakes() {
    let id = Identity::softhsm();
    let mut signer = SignerSide::start(&id);

    let good = certificate_verify(b"TLS 1.3, client CertificateVerify");
    let Reply::Signature { signature } = signer.sign(Purpose::Handshake, &good) else {
        panic!("a client CertificateVerify was not signed")
    };
    use x509_parser::prelude::FromDer as _;
    let (_, spki) =
        x509_parser::x509::SubjectPublicKeyInfo::from_der(&signer.key.spki).expect("SPKI");
    let point = spki.subject_public_key.data.to_vec();
    ring::signature::UnparsedPublicKey::new(&ring::signature::ECDSA_P256_SHA256_ASN1, point)
        .verify(&good, &signature)
        .expect("the signature verifies with the key's public key");

    let jwt = b"eyJhbGciOiJFUzI1NiJ9.eyJzdWIiOiJhZG1pbiJ9";
    let forged: Vec<(&str, Reply)> = vec![
        ("a JWT as a handshake", signer.sign(Purpose::Handshake, jwt)),
        (
            "arbitrary data",
            signer.sign(Purpose::Handshake, &[0x42; 98]),
        ),
        (
            "a server CertificateVerify",
            signer.sign(
                Purpose::Handshake,
                &certificate_verify(b"TLS 1.3, server CertificateVerify"),
            ),
        ),
        (
            "a TLS 1.2 transcript while TLS 1.2 is off",
            signer.sign(
                Purpose::Handshake,
                &[1, 0, 0, 2, 3, 3, 2, 0, 0, 0, 16, 0, 0, 0],
            ),
        ),
        (
            "a health check of other data",
            signer.sign(Purpose::HealthCheck, b"hwkey proxy health check!"),
        ),
        (
            "a CSR for another name",
            signer.sign(
                Purpose::CertificateRequest,
                &request_info("CN=admin,O=system:masters", &signer.key.spki.clone()),
            ),
        ),
        (
            "a CSR for another key",
            signer.sign(
                Purpose::CertificateRequest,
                &request_info("CN=alice,O=devs", &other_spki()),
            ),
        ),
        (
            "a handshake message as a CSR",
            signer.sign(Purpose::CertificateRequest, &good),
        ),
    ];
    for (what, reply) in &forged {
        assert!(refused(reply), "{what}: {reply:?}");
    }
    let destroy = signer.ask(Request::Destroy { key: signer.key.id });
    assert!(refused(&destroy), "deleting the key in use: {destroy:?}");
    let certify = signer.ask(Request::CertifyRequest {
        key: signer.key.id,
        ak_handle: 0x8101_0002,
        subject: subject_der("CN=admin"),
        made_at: hwkey::pki::attestation::unix_now(),
    });
    assert!(
        refused(&certify),
        "evidence for another subject: {certify:?}"
    );

    // The CSR renewal needs: the identity's subject and the key's own public key.
    let own = request_info("CN=alice,O=devs", &signer.key.spki.clone());
    assert!(
        matches!(
            signer.sign(Purpose::CertificateRequest, &own),
            Reply::Signature { .. }
        ),
        "the identity's own request was refused"
    );
    // The key still works after all that.
    assert!(matches!(
        signer.sign(Purpose::Handshake, &good),
        Reply::Signature { .. }
    ));
}

/// A DER `CertificationRequestInfo` for `subject` and `spki`, with no attributes.
fn request_info(subject: &str, spki: &[u8]) -> Vec<u8> {
    let subject = subject_der(subject);
    yasna::construct_der(|w| {
        w.write_sequence(|w| {
            w.next().write_u8(0);
            w.next().write_der(&subject);
            w.next().write_der(spki);
            w.next()
                .write_tagged_implicit(yasna::Tag::context(0), |w| w.write_set(|_| {}));
        })
    })
}

fn subject_der(text: &str) -> Vec<u8> {
    let request =
        hwkey::pki::csr::CsrRequest::parse(text, &[], &[]).expect("a subject hwkey writes");
    yasna::construct_der(|w| request.subject.write_der(w))
}

/// Another P-256 public key (software).
fn other_spki() -> Vec<u8> {
    let rng = ring::rand::SystemRandom::new();
    let pkcs8 = ring::signature::EcdsaKeyPair::generate_pkcs8(
        &ring::signature::ECDSA_P256_SHA256_ASN1_SIGNING,
        &rng,
    )
    .expect("key");
    let pair = ring::signature::EcdsaKeyPair::from_pkcs8(
        &ring::signature::ECDSA_P256_SHA256_ASN1_SIGNING,
        pkcs8.as_ref(),
        &rng,
    )
    .expect("pair");
    use ring::signature::KeyPair as _;
    let point = pair.public_key().as_ref().to_vec();
    // SubjectPublicKeyInfo for id-ecPublicKey, prime256v1.
    yasna::construct_der(|w| {
        w.write_sequence(|w| {
            w.next().write_sequence(|w| {
                w.next()
                    .write_oid(&yasna::models::ObjectIdentifier::from_slice(&[
                        1, 2, 840, 10045, 2, 1,
                    ]));
                w.next()
                    .write_oid(&yasna::models::ObjectIdentifier::from_slice(&[
                        1, 2, 840, 10045, 3, 1, 7,
                    ]));
            });
            w.next().write_bitvec_bytes(&point, point.len() * 8);
        })
    })
}

/// The network side maps no PKCS#11 module; the signer does. A signer killed (as a crashing
/// module would) comes back at the next signature, same proxy process. With its supervisor gone,
/// no signer can come back: the proxy exits with an error naming it.
#[cfg(feature = "pkcs11")]
#[test]
fn the_key_lives_in_the_signer_which_comes_back_after_a_kill() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let mut proxy = ProxyProcess::start(&id, &upstream);
    let version = || proxy.curl_unix(&["-s", "-o", "/dev/null", "-w", "%{http_code}"], "/version");
    let code = |out: std::process::Output| String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(code(version()), "200", "{}", proxy.log());
    let maps = |pid: u32| std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    let signer = proxy.signer_pid();
    assert!(
        maps(signer).contains("libsofthsm2"),
        "the signer has no module mapped"
    );
    let network = maps(proxy.guard.id());
    for library in ["libsofthsm2", "libtss2", "libcrypto"] {
        assert!(
            !network.contains(library),
            "the network side maps {library}:\n{network}"
        );
    }

    run_ok(Command::new("kill").args(["-KILL", &signer.to_string()]));
    // No resumed session: the next connection needs a signature.
    proxy.signal(libc::SIGHUP);
    proxy.wait_for_metric("hwkey_cert_reloads_total{result=\"ok\"}", 1.0);
    let deadline = Instant::now() + Duration::from_secs(30);
    while code(version()) != "200" {
        assert!(
            Instant::now() < deadline,
            "no new signer within 30 s:\n{}",
            proxy.log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let again = proxy.signer_pid();
    assert_ne!(again, signer, "the same signer?");
    assert!(
        proxy.log().contains("a new signer is serving the key"),
        "{}",
        proxy.log()
    );
    assert!(proxy.guard.try_wait().is_none(), "the proxy exited");

    // The supervisor killed: no signer can ever come back, so the proxy stops with an error
    // naming it (a service manager, or the next kubectl, starts a whole new one), and the dead
    // supervisor is reaped, not left a zombie. Before, the proxy ran on answering every request
    // with a 502 and /healthz with "it is being restarted".
    let supervisor = proxy.guard.id();
    let supervisors = children(supervisor);
    assert_eq!(supervisors.len(), 1, "{supervisors:?}");
    run_ok(Command::new("kill").args(["-KILL", &supervisors[0].to_string()]));
    let status = proxy.wait_exit(Duration::from_secs(20));
    assert!(!status.success(), "{status:?}");
    let log = proxy.log();
    assert!(
        log.contains("the signer supervisor exited") && log.contains("starts a whole new one"),
        "{log}"
    );
}

/// With a TPM key the network side maps none of the TSS libraries and no TCTI; the signer holds
/// the TPM connection.
#[cfg(feature = "tpm")]
#[test]
fn a_tpm_proxys_network_side_maps_no_tss_library() {
    let id = Identity::tpm();
    let upstream = TestUpstream::start(&id.ca);
    let proxy = ProxyProcess::start(&id, &upstream);
    let out = proxy.curl_unix(&["-s", "-o", "/dev/null", "-w", "%{http_code}"], "/version");
    assert_eq!(
        String::from_utf8_lossy(&out.stdout),
        "200",
        "{}",
        proxy.log()
    );
    let maps = |pid: u32| std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap_or_default();
    let network = maps(proxy.guard.id());
    assert!(
        !network.contains("libtss2"),
        "the network side maps TSS:\n{network}"
    );
    let signer = maps(proxy.signer_pid());
    assert!(
        signer.contains("libtss2-esys") && signer.contains("libtss2-tcti-swtpm"),
        "the signer has no TPM connection:\n{signer}"
    );
}

/// The signer kept the configured key from deletion by comparing URI texts, while the rotation
/// series compares paths by their parts: the network side (which may write `current-key` in
/// its state directory) named the configured key file as `DIR/./alice.tpm.pem`, had the next
/// signer open it so, made and used a next key, and had the configured one deleted, the only
/// copy of the identity. Now the same file is the same key however it is spelled.
#[cfg(feature = "tpm")]
#[test]
fn the_configured_key_is_never_deleted_whatever_its_spelling() {
    let id = Identity::tpm();
    let configured = id.key_uri.clone();
    let file = configured
        .strip_prefix("tpm:path=")
        .and_then(|rest| rest.split('?').next())
        .map(std::path::PathBuf::from)
        .expect("a TPM key file");
    let dir = file.parent().expect("its directory");
    let name = file.file_name().expect("its name").to_string_lossy();
    let dotted = configured.replacen(
        &file.display().to_string(),
        &format!("{}/./{name}", dir.display()),
        1,
    );
    assert_ne!(dotted, configured);
    let state = temp_dir();
    write_private(&state.path().join("current-key"), dotted.as_bytes());
    let mut signer = SignerSide::start_with(&id, Some(state.path()));
    let Reply::Created { key: next } = signer.ask(Request::CreateNext) else {
        panic!("no next key")
    };
    assert!(matches!(
        signer.ask(Request::Use { key: next.id }),
        Reply::Done
    ));
    let destroy = signer.ask(Request::Destroy { key: signer.key.id });
    assert!(
        refused(&destroy),
        "the configured key was deleted: {destroy:?}"
    );
    assert!(file.exists(), "the configured key file is gone");
}

/// Without `--rotate-key` the network side had the signer create keys on the device (and
/// switch and delete them) all the same. Now those requests are refused and nothing is made.
#[cfg(feature = "pkcs11")]
#[test]
fn without_rotation_no_key_is_created_switched_or_deleted() {
    let id = Identity::softhsm();
    let mut signer = SignerSide::start(&id);
    let key = signer.key.id;
    for request in [
        Request::CreateNext,
        Request::Use { key },
        Request::Destroy { key },
    ] {
        let what = format!("{request:?}");
        let reply = signer.ask(request);
        assert!(refused(&reply), "{what}: {reply:?}");
    }
    let listed = run_ok(
        hwkey()
            .envs(id.envs())
            .args(["key", "list", "--key", &id.key_uri]),
    );
    let listed = output_text(&listed);
    assert_eq!(listed.matches("alice").count(), 1, "{listed}");
}

/// A reply over the signer's message limit (a stored chain of many certificates: a TPM key's
/// `.crt.pem` is read whole) was dropped by the signer, which stayed up: its caller waited for
/// good (a proxy started without `--cert`, or a reload, hung). Now the caller gets an error
/// saying why, and the signer goes on answering.
#[cfg(feature = "tpm")]
#[test]
fn a_reply_too_large_to_send_is_answered_with_an_error() {
    let id = Identity::tpm();
    let key_file = id
        .key_uri
        .strip_prefix("tpm:path=")
        .and_then(|rest| rest.split('?').next())
        .map(std::path::PathBuf::from)
        .expect("a TPM key file");
    let chain_file = key_file.with_file_name(format!(
        "{}.crt.pem",
        key_file
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.strip_suffix(".pem"))
            .expect("a .pem name")
    ));
    let cert = std::fs::read_to_string(&id.cert).expect("certificate");
    std::fs::write(&chain_file, cert.repeat(400)).expect("a long chain");
    let mut signer = SignerSide::start(&id);
    rustix::net::sockopt::set_socket_timeout(
        &signer.socket,
        rustix::net::sockopt::Timeout::Recv,
        Some(Duration::from_secs(20)),
    )
    .expect("receive timeout");
    let reply = signer.ask(Request::StoredChain { key: signer.key.id });
    let Reply::Error { error } = &reply else {
        panic!("expected an error, got {reply:?}")
    };
    assert!(
        error.message.contains("over the limit"),
        "{}",
        error.message
    );
    // The signer still answers.
    assert!(matches!(
        signer.sign(
            Purpose::Handshake,
            &certificate_verify(b"TLS 1.3, client CertificateVerify")
        ),
        Reply::Signature { .. }
    ));
}

/// Issue 50: the network side asks the signer for the key's PIV attestation (public data it
/// attaches to renewal requests): none for a key without one, and the slot's attestation and
/// the device's f9 certificate once the token exposes them as ykcs11 does.
#[cfg(feature = "pkcs11")]
#[test]
fn the_signer_hands_out_the_keys_piv_attestation() {
    use support::piv::{ChainShape, PivDevice, Slot, TOUCH_ALWAYS};
    let id = Identity::softhsm();
    let mut signer = SignerSide::start(&id);
    let key = signer.key.id;
    match signer.ask(Request::PivAttestation { key }) {
        Reply::Chain { chain: None } => {}
        other => panic!("a key without attestation objects: {other:?}"),
    }
    let support::proxy::Backend::SoftHsm(hsm) = &id.backend else {
        unreachable!("a SoftHSM identity")
    };
    let device = PivDevice::new(&ChainShape::default());
    let attestation = device.attest(&signer.key.spki, Slot::new(31337, TOUCH_ALWAYS));
    device.install(hsm, "kube", "42", "9a", &attestation);
    match signer.ask(Request::PivAttestation { key }) {
        Reply::Chain { chain: Some(chain) } => {
            assert_eq!(chain, vec![attestation, device.f9_der()]);
        }
        other => panic!("the attestation objects are not handed out: {other:?}"),
    }
}

/// The identity is fixed before any network input: a certificate for `O=system:masters` with
/// the same key, swapped into the `--cert` file (which a renewing network side could write),
/// then a new signer asked of the supervisor: that signer still serves the identity read at
/// start, and refuses the CSR for the forged subject (before, it read the file again and signed
/// it). The forged file gets no TPM evidence either.
#[cfg(feature = "pkcs11")]
#[test]
fn a_certificate_swapped_into_the_cert_file_gives_new_signers_no_new_identity() {
    let id = Identity::softhsm();
    let mut signer = SignerSide::start(&id);
    let forged = id.dir.path().join("forged.pem");
    id.issue(&id.key_uri, "CN=mallory,O=system:masters", &forged);
    std::fs::copy(&forged, &id.cert).expect("swap the certificate file");
    signer.respawn();
    let masters = request_info("CN=mallory,O=system:masters", &signer.key.spki.clone());
    let reply = signer.sign(Purpose::CertificateRequest, &masters);
    assert!(refused(&reply), "a CSR for the forged subject: {reply:?}");
    let own = request_info("CN=alice,O=devs", &signer.key.spki.clone());
    assert!(
        matches!(
            signer.sign(Purpose::CertificateRequest, &own),
            Reply::Signature { .. }
        ),
        "the identity read at start is no longer served"
    );
}

/// A renewed certificate is installed through the signer, into the configured `--cert` file:
/// only a chain for the same key and the same subject; the previous file is kept as `.prev`. A
/// chain for another subject is refused and the file is left as it was.
#[cfg(feature = "pkcs11")]
#[test]
fn the_signer_installs_only_a_certificate_for_its_key_and_subject() {
    let id = Identity::softhsm();
    let mut signer = SignerSide::start(&id);
    let before = std::fs::read(&id.cert).expect("read the certificate");
    let der = |path: &std::path::Path| -> Vec<Vec<u8>> {
        hwkey::pki::cert::load_chain(path)
            .expect("a chain")
            .into_iter()
            .map(|c| c.to_vec())
            .collect()
    };
    let forged = id.dir.path().join("forged.pem");
    id.issue(&id.key_uri, "CN=mallory,O=system:masters", &forged);
    let reply = signer.ask(Request::InstallCertificate {
        key: signer.key.id,
        chain: der(&forged),
        keep_previous: true,
    });
    assert!(refused(&reply), "another subject: {reply:?}");
    assert_eq!(std::fs::read(&id.cert).expect("read"), before);

    // Renewed by a CA that writes the attributes in its own order (Go's: O before CN): the
    // same identity.
    let renewed = id.dir.path().join("renewed.pem");
    id.issue(&id.key_uri, "O=devs,CN=alice", &renewed);
    let reply = signer.ask(Request::InstallCertificate {
        key: signer.key.id,
        chain: der(&renewed),
        keep_previous: true,
    });
    assert!(matches!(reply, Reply::Stored { .. }), "{reply:?}");
    assert_eq!(der(&id.cert), der(&renewed));
    let mut prev = id.cert.clone().into_os_string();
    prev.push(".prev");
    assert_eq!(std::fs::read(prev).expect("the previous file"), before);
}

/// The signer reads the watched files for the network side, and only through a link that stays
/// in the configured directory: a `--upstream-ca` swapped for a link to another root-owned
/// bundle (the CA's key's neighbour) is refused.
#[cfg(feature = "pkcs11")]
#[test]
fn the_signer_reads_the_watched_files_but_not_through_a_link_out_of_their_directory() {
    use hwkey::signer::protocol::WatchedFile;
    let id = Identity::softhsm();
    let mut signer = SignerSide::start(&id);
    let read = |signer: &mut SignerSide, file: WatchedFile| -> Result<Vec<u8>, Box<Reply>> {
        let mut all = Vec::new();
        loop {
            let reply = signer.ask(Request::ReadWatched {
                file,
                offset: all.len() as u64,
            });
            let Reply::File { bytes, total } = reply else {
                return Err(Box::new(reply));
            };
            all.extend_from_slice(&bytes);
            if all.len() as u64 >= total {
                return Ok(all);
            }
        }
    };
    let bytes = read(&mut signer, WatchedFile::Certificate).expect("the certificate");
    assert_eq!(bytes, std::fs::read(&id.cert).expect("read"));
    // A CA bundle the size of a system one (over the message limit whole) comes in parts.
    let ca = id.ca.ca_path();
    let big = id.ca.ca_pem().repeat(200 * 1024 / id.ca.ca_pem().len() + 2);
    assert!(big.len() > 200 * 1024);
    std::fs::write(&ca, &big).expect("write a big bundle");
    let bytes = read(&mut signer, WatchedFile::UpstreamCa).expect("the bundle");
    assert_eq!(bytes, big.as_bytes());

    let outside = temp_dir();
    let target = outside.path().join("other.pem");
    std::fs::copy(&id.cert, &target).expect("copy");
    std::fs::remove_file(&id.cert).expect("unlink");
    std::os::unix::fs::symlink(&target, &id.cert).expect("link");
    let reply = read(&mut signer, WatchedFile::Certificate).expect_err("refused");
    assert!(refused(&reply), "a link out of the directory: {reply:?}");
}

/// A renewed certificate's predecessor is read without following a link: a `--cert` swapped
/// for a link to the PIN file gets no copy of the PIN into a readable `.prev` (the install is
/// refused and nothing is written).
#[cfg(feature = "pkcs11")]
#[test]
fn the_previous_certificate_is_never_read_through_a_link() {
    let id = Identity::softhsm();
    let mut signer = SignerSide::start(&id);
    let support::proxy::Backend::SoftHsm(hsm) = &id.backend else {
        unreachable!("a SoftHSM identity")
    };
    let chain: Vec<Vec<u8>> = hwkey::pki::cert::load_chain(&id.cert)
        .expect("a chain")
        .into_iter()
        .map(|c| c.to_vec())
        .collect();
    std::fs::remove_file(&id.cert).expect("unlink");
    std::os::unix::fs::symlink(hsm.pin_path(), &id.cert).expect("link");
    let reply = signer.ask(Request::InstallCertificate {
        key: signer.key.id,
        chain,
        keep_previous: true,
    });
    assert!(matches!(reply, Reply::Error { .. }), "{reply:?}");
    let mut prev = id.cert.clone().into_os_string();
    prev.push(".prev");
    assert!(!std::path::Path::new(&prev).exists(), "a .prev was written");
}

/// The rotation pointer (`current-key`, in the state directory the network side writes) names
/// which key, never its password: against a swtpm that locks out after 3 failures, three
/// pointers naming the configured key with three different wrong password files, each followed
/// by a new signer, reach the TPM with no wrong password, and every signer signs with the
/// configured one. (Before, each pointer's `pin-source` was presented: the third put the whole
/// TPM into dictionary-attack lockout and the right password was refused.)
#[cfg(feature = "tpm")]
#[test]
fn the_rotation_pointer_never_chooses_the_password_the_tpm_sees() {
    let tpm = Swtpm::start();
    let dir = temp_dir();
    let secrets = temp_dir();
    let uri = |password: &std::path::Path| {
        format!(
            "tpm:path={}?tcti={}&pin-source=file:{}",
            dir.path().join("alice.tpm.pem").display(),
            tpm.tcti(),
            password.display()
        )
    };
    let password = secrets.path().join("password");
    write_private(&password, b"s3cret");
    let key_uri = uri(&password);
    run_ok(
        hwkey()
            .envs(tpm.envs())
            .args(["key", "create", "--key", &key_uri]),
    );
    let pointers: Vec<String> = (0..3)
        .map(|i| {
            let wrong = secrets.path().join(format!("wrong-{i}"));
            write_private(&wrong, format!("not it {i}").as_bytes());
            uri(&wrong)
        })
        .collect();
    require_tool("tpm2_dictionarylockout", "tpm2-tools");
    run_ok(
        Command::new("tpm2_dictionarylockout")
            .envs(tpm.envs())
            .args([
                "--setup-parameters",
                "--max-tries=3",
                "--recovery-time=3600",
                "--lockout-recovery-time=3600",
            ]),
    );
    let envs = tpm.envs();
    let before = lockout_counter(envs.clone());
    let id = Identity::of_existing_key(support::proxy::Backend::Tpm(tpm), key_uri, dir);
    let state = temp_dir();
    let mut signer = SignerSide::start_with(&id, Some(state.path()));
    let good = certificate_verify(b"TLS 1.3, client CertificateVerify");
    for pointer in &pointers {
        write_private(&state.path().join("current-key"), pointer.as_bytes());
        // swtpm has no resource manager: a replaced signer's loaded objects stay until flushed.
        run_ok(
            Command::new("tpm2_flushcontext")
                .envs(envs.clone())
                .arg("-t"),
        );
        signer.respawn();
        assert!(
            matches!(
                signer.sign(Purpose::Handshake, &good),
                Reply::Signature { .. }
            ),
            "a signer after the pointer {pointer} does not sign"
        );
    }
    assert_eq!(
        lockout_counter(envs),
        before,
        "a wrong password from the pointer reached the TPM"
    );
}
