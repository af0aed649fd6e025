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
pub(crate) fn parse_handle(s: &str) -> Result<u32, String> {
    crate::key::attestation::parse_persistent_handle(s)
}

pub fn run(command: AttestCommand) -> anyhow::Result<()> {
    match command {
        AttestCommand::Enroll { key, ak_handle } => {
            let e = key::enroll(&key, ak_handle)?;
            use base64::Engine as _;
            let b64 = base64::engine::general_purpose::STANDARD;
            let indent = |pem: String| pem.lines().map(|l| format!("  {l}\n")).collect::<String>();
            print!(
                "# hwkey attest enroll: store this file as TRUST_DIR/NODE_NAME for the approver\n\
                 akHandle: {ak_handle:#010x}\n\
                 akName: {}\n\
                 akPublic: {}\n\
                 akPublicKeyPem: |\n{}\
                 ekPublicKeyPem: |\n{}",
                key::attestation::hex(&e.ak_name),
                b64.encode(&e.ak_public),
                indent(key::der::to_pem("PUBLIC KEY", &e.ak_spki)),
                indent(key::der::to_pem("PUBLIC KEY", &e.ek_spki)),
            );
            if let Some(cert) = &e.ek_certificate {
                print!(
                    "ekCertificatePem: |\n{}",
                    indent(key::der::to_pem("CERTIFICATE", cert))
                );
            }
            Ok(())
        }
        AttestCommand::Verify { csr, trust } => verify(&csr, &trust),
    }
}

#[cfg(feature = "tpm")]
fn verify(csr: &std::path::Path, trust: &std::path::Path) -> anyhow::Result<()> {
    use crate::pki::attestation;
    use anyhow::Context;
    let data = std::fs::read(csr).with_context(|| format!("cannot read {}", csr.display()))?;
    let der = match pem::parse(&data) {
        Ok(p) if p.tag() == "CERTIFICATE REQUEST" || p.tag() == "NEW CERTIFICATE REQUEST" => {
            p.into_contents()
        }
        Ok(p) => bail!(
            "{} holds a {} PEM block, not a CERTIFICATE REQUEST",
            csr.display(),
            p.tag()
        ),
        Err(_) => data,
    };
    if der.is_empty() {
        bail!(
            "{} is empty: pass the request file `hwkey csr --attest` wrote",
            csr.display()
        );
    }
    let trusted = attestation::read_trust_dir(trust)?;
    match attestation::verify_request(&der, &trusted) {
        Ok(a) => {
            println!(
                "admitted: {} is in the TPM of node '{}' (attestation key {})",
                a.subject, a.node, a.ak_name
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
