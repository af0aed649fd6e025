//! `hwkey attest`: register a node's TPM (`enroll`) and check the evidence a request carries
//! (`verify`), as an approver would.

use std::path::PathBuf;

use anyhow::bail;
use clap::Subcommand;

use crate::key::{self, KeyUri};

#[derive(Debug, Subcommand)]
pub enum AttestCommand {
    /// Make sure the TPM has an attestation key (created once, kept at --ak-handle) and print
    /// what an operator registers for this node: store the output as TRUST_DIR/NODE_NAME.
    Enroll {
        /// The TPM: any tpm: URI naming it (tpm:?tcti=device:/dev/tpmrm0), or the node key's.
        #[arg(long, value_parser = super::KeyUriParser, env = "HWKEY_KEY")]
        key: KeyUri,
        /// Persistent handle of the attestation key.
        #[arg(long, value_parser = parse_handle, default_value = crate::key::attestation::DEFAULT_AK_HANDLE_TEXT)]
        ak_handle: u32,
        /// Which endorsement key to describe (and later activate with). Default: the RSA EK
        /// when the TPM holds its certificate, else the ECC EK.
        #[arg(long, value_enum)]
        ek: Option<crate::key::attestation::EkKind>,
    },
    /// Check a request (PEM or DER) the way the approver does: its signature, its TPM evidence,
    /// and that the evidence's attestation key is registered in --trust. Prints the node and
    /// exits 0, or prints the reason (NoEvidence, EvidenceInvalid, UnknownAttestationKey) and
    /// exits 1.
    Verify {
        /// The request file.
        csr: PathBuf,
        /// The registered nodes: one file per node, named after it, holding its enrollment.
        #[arg(long)]
        trust: PathBuf,
    },
    /// Verifier, step 1 of registering a node by its EK certificate: check the enrollment's EK
    /// certificate against the manufacturer CAs and its AK, then write a challenge for the node
    /// (--out) and the answer to expect (--expect, mode 0600: keep it here).
    Challenge {
        /// The node's `hwkey attest enroll` output.
        enrollment: PathBuf,
        /// The TPM manufacturers' CA certificates (PEM bundle; each one is trusted).
        #[arg(long)]
        ek_ca: PathBuf,
        /// The manufacturers' certificate revocation lists (PEM bundle or one DER CRL;
        /// repeatable): an EK certificate listed by its issuer is refused, and so is one whose
        /// issuer's list here is stale or not the issuer's.
        #[arg(long)]
        ek_crl: Vec<PathBuf>,
        /// Where to write the challenge for the node.
        #[arg(long)]
        out: PathBuf,
        /// Where to keep the expected answer (secret).
        #[arg(long)]
        expect: PathBuf,
        /// The node being registered: the answer can register this name only.
        #[arg(long)]
        node: String,
    },
    /// Node, step 2: TPM2_ActivateCredential with the attestation key and the EK the challenge
    /// was made for (RSA-2048 or ECC P-256); prints the answer (only the TPM holding both can
    /// recover it). Also opens the credential of a carrier certificate (PEM) the approver
    /// issued to `hwkey bootstrap --ek-proof`.
    Activate {
        /// The challenge file, or a carrier certificate.
        challenge: PathBuf,
        /// The TPM: any tpm: URI naming it.
        #[arg(long, value_parser = super::KeyUriParser, env = "HWKEY_KEY")]
        key: KeyUri,
        /// Persistent handle of the attestation key.
        #[arg(long, value_parser = parse_handle, default_value = crate::key::attestation::DEFAULT_AK_HANDLE_TEXT)]
        ak_handle: u32,
    },
    /// Verifier, step 3: check the node's answer and register it: writes TRUST_DIR/NODE (a
    /// canonical registration built from the checked fields), which the approver and `attest
    /// verify` read, and deletes the --expect file (an answer registers once). Refuses another
    /// node name than the challenge's, an AK registered under another node, and replacing a
    /// registration without --replace.
    Register {
        /// The node's enrollment (the same file that was challenged).
        enrollment: PathBuf,
        /// The expected answer written by `challenge`.
        #[arg(long)]
        expect: PathBuf,
        /// The node's answer (`activate`'s output; - for standard input).
        #[arg(long)]
        answer: PathBuf,
        /// The node's name (its registration file's name).
        #[arg(long)]
        node: String,
        /// The trust directory.
        #[arg(long)]
        trust: PathBuf,
        /// Replace an existing registration of this node.
        #[arg(long)]
        replace: bool,
    },
    /// Check a YubiKey PIV attestation before enrolling the token, as the approver does: the
    /// slot's attestation certificate, signed by the device's f9 certificate, chained to
    /// Yubico's PIV attestation roots (or --roots). Prints the serial, firmware, PIN and touch
    /// policy, form factor and slot, and exits 0; or prints what failed and exits 1. Register
    /// the serial for the person (people trust entry `piv: {serials: [SERIAL]}`).
    PivVerify {
        /// The slot's attestation certificate (PEM or DER; `ykman piv keys attest`, or the
        /// token's "X.509 Certificate for PIV Attestation 9a" object).
        #[arg(long)]
        attestation: PathBuf,
        /// The device's attestation certificate, slot f9 (PEM or DER).
        #[arg(long)]
        intermediate: PathBuf,
        /// PIV attestation roots and intermediates to trust instead of Yubico's (PEM bundle).
        #[arg(long)]
        roots: Option<PathBuf>,
        /// The public key the attestation must be for (PEM SubjectPublicKeyInfo, or a
        /// certificate or request for it).
        #[arg(long)]
        pubkey: Option<PathBuf>,
    },
}

/// `--attest` / `--ak-handle`, shared by the commands that make requests.
#[derive(Debug, Clone, Copy, clap::Args)]
pub(crate) struct AttestArgs {
    /// Carry TPM2_Certify evidence in the request (TPM keys): an approver with the node's
    /// enrollment (`hwkey attest enroll`) can then tell the key lives in this TPM.
    #[arg(long)]
    attest: bool,
    /// With --attest: the persistent handle of the attestation key (made there once if missing).
    #[arg(long, value_parser = parse_handle, default_value = crate::key::attestation::DEFAULT_AK_HANDLE_TEXT)]
    ak_handle: u32,
}

impl AttestArgs {
    /// The attestation key's handle when evidence was asked for.
    pub(crate) fn ak_handle(self) -> Option<u32> {
        self.attest.then_some(self.ak_handle)
    }
}

/// Parses a TPM handle written in hex (`0x81010002`) or decimal.
pub(crate) fn parse_handle(s: &str) -> Result<u32, crate::key::attestation::HandleError> {
    crate::key::attestation::parse_persistent_handle(s)
}

pub fn run(command: AttestCommand) -> anyhow::Result<()> {
    match command {
        AttestCommand::Enroll { key, ak_handle, ek } => {
            let e = key::enroll(&key, ak_handle, ek)?;
            print!("{}", e.to_yaml(ak_handle));
            Ok(())
        }
        AttestCommand::Verify { csr, trust } => verify(&csr, &trust),
        AttestCommand::PivVerify {
            attestation,
            intermediate,
            roots,
            pubkey,
        } => piv_verify(
            &attestation,
            &intermediate,
            roots.as_deref(),
            pubkey.as_deref(),
        ),
        AttestCommand::Challenge {
            enrollment,
            ek_ca,
            ek_crl,
            out,
            expect,
            node,
        } => ek::challenge(&enrollment, &ek_ca, &ek_crl, &out, &expect, &node),
        AttestCommand::Activate {
            challenge,
            key,
            ak_handle,
        } => ek::activate(&challenge, &key, ak_handle),
        AttestCommand::Register {
            enrollment,
            expect,
            answer,
            node,
            trust,
            replace,
        } => ek::register(&enrollment, &expect, &answer, &node, &trust, replace),
    }
}

/// Registering a node by its EK certificate (`pki::ek_trust`).
#[cfg(feature = "tpm")]
mod ek {
    use std::path::Path;

    use anyhow::{bail, Context};
    use base64::Engine as _;

    use crate::atomic_file;
    use crate::key::{self, KeyUri};
    use crate::pki::ek_trust::{self, ChallengeFile, ExpectedAnswer};

    pub(super) fn challenge(
        enrollment: &Path,
        ek_ca: &Path,
        ek_crl: &[std::path::PathBuf],
        out: &Path,
        expect: &Path,
        node: &str,
    ) -> anyhow::Result<()> {
        let text = ek_trust::read_text(enrollment, "the enrollment")?;
        let ca = std::fs::read(ek_ca)
            .with_context(|| format!("cannot read --ek-ca {}", ek_ca.display()))?;
        let mut crl_bytes = Vec::new();
        for path in ek_crl {
            let bytes = crate::small_file::read(path)
                .with_context(|| format!("cannot read --ek-crl {}", path.display()))?;
            let crls = crate::pki::ek_crl::EkCrls::parse(&bytes)
                .with_context(|| format!("--ek-crl {}", path.display()))?;
            crl_bytes.push(crls);
        }
        let crls = crate::pki::ek_crl::EkCrls::join(crl_bytes);
        let (challenge, expected) = ek_trust::challenge(&text, &ca, &crls, node)
            .map_err(|e| anyhow::anyhow!("{}: {e}", enrollment.display()))?;
        let expected = zeroize::Zeroizing::new(serde_yaml_ng::to_string(&expected)?);
        atomic_file::write_atomic(expect, expected.as_bytes(), 0o600)
            .with_context(|| format!("cannot write --expect {}", expect.display()))?;
        atomic_file::write_atomic(out, serde_yaml_ng::to_string(&challenge)?.as_bytes(), 0o644)
            .with_context(|| format!("cannot write --out {}", out.display()))?;
        eprintln!(
            "challenge for AK {} written to {}: run `hwkey attest activate {}` on the node",
            challenge.ak_name,
            out.display(),
            out.display()
        );
        Ok(())
    }

    pub(super) fn activate(challenge: &Path, uri: &KeyUri, ak_handle: u32) -> anyhow::Result<()> {
        let text = std::fs::read_to_string(challenge)
            .with_context(|| format!("cannot read the challenge {}", challenge.display()))?;
        let (blob, secret, ak) = if text.trim_start().starts_with("-----BEGIN CERTIFICATE") {
            // A carrier certificate (the approver's answer to `hwkey bootstrap --ek-proof`).
            let c = crate::pki::ek_join::credential_of(text.as_bytes())
                .with_context(|| format!("{} is not a carrier certificate", challenge.display()))?;
            (
                c.credential_blob,
                c.encrypted_secret,
                "the carrier's".to_string(),
            )
        } else {
            let c: ChallengeFile = serde_yaml_ng::from_str(&text).with_context(|| {
                format!(
                    "{} is not a challenge from `hwkey attest challenge` nor a carrier certificate",
                    challenge.display()
                )
            })?;
            let b64 = base64::engine::general_purpose::STANDARD;
            let blob = b64
                .decode(c.credential_blob.trim())
                .context("credentialBlob is not base64")?;
            let secret = b64
                .decode(c.encrypted_secret.trim())
                .context("encryptedSecret is not base64")?;
            (blob, secret, c.ak_name)
        };
        let answer = key::activate(uri, ak_handle, &blob, &secret).with_context(|| {
            format!(
                "the TPM did not release the secret: its EK or the AK at {ak_handle:#010x} is not the one enrolled (AK {ak})"
            )
        })?;
        println!("{}", hex::encode(&answer));
        Ok(())
    }

    pub(super) fn register(
        enrollment: &Path,
        expect: &Path,
        answer: &Path,
        node: &str,
        trust: &Path,
        replace: bool,
    ) -> anyhow::Result<()> {
        crate::pki::registration::check_node_name(node)
            .map_err(|e| anyhow::anyhow!("--node: {e}"))?;
        let text = ek_trust::read_text(enrollment, "the enrollment")?;
        let expected: ExpectedAnswer = serde_yaml_ng::from_str(
            &std::fs::read_to_string(expect)
                .with_context(|| format!("cannot read --expect {}", expect.display()))?,
        )
        .with_context(|| {
            format!(
                "{} is not what `hwkey attest challenge` kept",
                expect.display()
            )
        })?;
        let answer = if answer == Path::new("-") {
            let mut s = String::new();
            std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)
                .context("cannot read the answer from standard input")?;
            s
        } else {
            std::fs::read_to_string(answer)
                .with_context(|| format!("cannot read --answer {}", answer.display()))?
        };
        let (ak_name, registration) = ek_trust::register(&text, &expected, &answer, node)
            .map_err(|e| anyhow::anyhow!("{node} is not registered: {e}"))?;
        let others: Vec<String> = crate::pki::registration::nodes_with_ak(trust, &ak_name)?
            .into_iter()
            .filter(|n| n != node)
            .collect();
        if !others.is_empty() {
            bail!(
                "{node} is not registered: its AK {} is registered already as {} (one TPM is one node: remove that registration first)",
                hex::encode(&ak_name),
                others.join(", ")
            );
        }
        let path = trust.join(node);
        let written = if replace {
            atomic_file::write_atomic(&path, registration.as_bytes(), 0o644)
        } else {
            atomic_file::create_atomic(&path, registration.as_bytes(), 0o644)
        };
        match written {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => bail!(
                "{} exists: {node} is registered already (pass --replace to register its TPM anew)",
                path.display()
            ),
            Err(e) => return Err(e).with_context(|| format!("cannot write {}", path.display())),
        }
        // An answer registers once: the secret it was checked against is gone.
        if let Err(e) = std::fs::remove_file(expect) {
            eprintln!(
                "warning: cannot delete --expect {} ({e}): delete it, it registers {node} again",
                expect.display()
            );
        }
        println!(
            "registered {node}: EK certificate issued by {}; AK {}",
            expected.ek_issuer, expected.ak_name
        );
        Ok(())
    }
}

#[cfg(not(feature = "tpm"))]
mod ek {
    use std::path::Path;

    use crate::key::KeyUri;

    const NO_TPM: &str = "this hwkey was built without the TPM 2.0 backend: rebuild it with `cargo build --features tpm`";

    pub(super) fn challenge(
        _: &Path,
        _: &Path,
        _: &[std::path::PathBuf],
        _: &Path,
        _: &Path,
        _: &str,
    ) -> anyhow::Result<()> {
        anyhow::bail!(NO_TPM)
    }
    pub(super) fn activate(_: &Path, _: &KeyUri, _: u32) -> anyhow::Result<()> {
        anyhow::bail!(NO_TPM)
    }
    pub(super) fn register(
        _: &Path,
        _: &Path,
        _: &Path,
        _: &str,
        _: &Path,
        _: bool,
    ) -> anyhow::Result<()> {
        anyhow::bail!(NO_TPM)
    }
}

#[cfg(feature = "tpm")]
fn verify(csr: &std::path::Path, trust: &std::path::Path) -> anyhow::Result<()> {
    use crate::approver::policy;
    use crate::pki::attestation;
    use crate::pki::request::Request;
    use anyhow::Context;
    let data = std::fs::read(csr).with_context(|| format!("cannot read {}", csr.display()))?;
    if data.is_empty() {
        bail!(
            "{} is empty: pass the request file `hwkey csr --attest` wrote",
            csr.display()
        );
    }
    // PEM is read exactly as the approver reads spec.request; anything else is taken as DER.
    let request = if data.windows(5).any(|w| w == b"-----") {
        Request::from_pem(&data)
    } else {
        Request::from_der(data)
    }
    .map_err(|m| anyhow::anyhow!("{}: MalformedRequest: {m}", csr.display()))?;
    let identity = policy::check_node_client(&request, None)
        .map_err(|v| anyhow::anyhow!("{}: {v}", csr.display()))?;
    let read = attestation::read_trust_dir(trust)?;
    for invalid in &read.invalid {
        eprintln!(
            "warning: {}: entry '{}' is skipped: {}",
            trust.display(),
            invalid.entry.escape_debug(),
            invalid.problem
        );
    }
    let read = read
        .usable()
        .map_err(|e| anyhow::anyhow!("{}: {e}", trust.display()))?;
    match attestation::verify_request(&request, &identity.node, &read.nodes) {
        Ok(a) => {
            println!(
                "admitted: {} is in the TPM of node '{}' (attestation key {}{})",
                a.subject,
                a.node,
                a.ak_name,
                a.ek_certificate_issuer
                    .map(|i| format!(
                        "; the evidence carries the TPM's EK certificate, issued by {i}"
                    ))
                    .unwrap_or_default()
            );
            Ok(())
        }
        Err(refused) => bail!("{refused}"),
    }
}

#[cfg(not(feature = "tpm"))]
fn verify(_csr: &std::path::Path, _trust: &std::path::Path) -> anyhow::Result<()> {
    bail!("this hwkey was built without the TPM 2.0 backend, which checks TPM evidence: rebuild it with `cargo build --features tpm`")
}

/// A certificate file, PEM (its first CERTIFICATE) or DER.
fn certificate_file(path: &std::path::Path, what: &str) -> anyhow::Result<Vec<u8>> {
    use anyhow::Context as _;
    let bytes = crate::small_file::read(path)
        .with_context(|| format!("{what} {}: cannot read it", path.display()))?;
    if bytes.starts_with(b"-----BEGIN") {
        let block = pem::parse_many(&bytes)
            .with_context(|| format!("{what} {}: not PEM", path.display()))?
            .into_iter()
            .find(|b| b.tag() == "CERTIFICATE")
            .with_context(|| format!("{what} {}: no CERTIFICATE block", path.display()))?;
        Ok(block.into_contents())
    } else {
        Ok(bytes)
    }
}

/// The SubjectPublicKeyInfo in a PEM file: a PUBLIC KEY, or a certificate's or request's key.
fn public_key_file(path: &std::path::Path) -> anyhow::Result<Vec<u8>> {
    use anyhow::Context as _;
    let text = crate::small_file::read_to_string(path)
        .with_context(|| format!("--pubkey {}: cannot read it", path.display()))?;
    let block =
        pem::parse(&text).with_context(|| format!("--pubkey {}: not PEM", path.display()))?;
    match block.tag() {
        "PUBLIC KEY" => Ok(block.into_contents()),
        "CERTIFICATE" => Ok(crate::pki::certificate::Certificate::from_der_in_chain(
            block.contents(),
        )
        .with_context(|| format!("--pubkey {}", path.display()))?
        .spki_der()
        .to_vec()),
        "CERTIFICATE REQUEST" => Ok(
            crate::pki::request::Request::from_der(block.into_contents())
                .with_context(|| format!("--pubkey {}", path.display()))?
                .spki_der()
                .to_vec(),
        ),
        other => bail!(
            "--pubkey {}: a {other} block; give a PUBLIC KEY, CERTIFICATE or CERTIFICATE REQUEST",
            path.display()
        ),
    }
}

fn piv_verify(
    attestation: &std::path::Path,
    f9: &std::path::Path,
    roots: Option<&std::path::Path>,
    pubkey: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    use crate::pki::piv::{self, PivRoots};
    let leaf = certificate_file(attestation, "--attestation")?;
    let device = certificate_file(f9, "--intermediate")?;
    let roots = match roots {
        Some(path) => {
            let text = crate::small_file::read_to_string(path)
                .map_err(|e| anyhow::anyhow!("--roots {}: {e}", path.display()))?;
            PivRoots::from_pem(&text)
                .map_err(|e| anyhow::anyhow!("--roots {}: {e}", path.display()))?
        }
        None => PivRoots::yubico(),
    };
    let now = i64::try_from(crate::pki::attestation::unix_now()).unwrap_or(i64::MAX);
    let facts = piv::verify_attestation(&leaf, &device, &roots, now)
        .map_err(|e| anyhow::anyhow!("the PIV attestation does not hold: {e}"))?;
    if let Some(path) = pubkey {
        if public_key_file(path)? != facts.spki {
            bail!(
                "the PIV attestation is for another key than --pubkey {}",
                path.display()
            );
        }
    }
    println!("serial: {}", facts.serial);
    println!("firmware: {}", facts.firmware);
    println!("slot: {}", facts.slot.as_deref().unwrap_or("unknown"));
    println!("pinPolicy: {}", facts.pin_policy);
    println!("touchPolicy: {}", facts.touch_policy);
    match facts.form_factor {
        Some(b) => println!("formFactor: {}", piv::form_factor_name(b)),
        None => println!("formFactor: not stated (firmware before 5.2.4)"),
    }
    println!("root: {}", facts.root);
    Ok(())
}
