//! `hwkey csr`: a PKCS#10 request signed inside the hardware.

use std::path::PathBuf;

use clap::Args;

use super::{emit, parse_uri};
use crate::key::{Key, KeyUri};
use crate::pki::csr::{self, CsrRequest};

#[derive(Debug, Args)]
pub struct CsrArgs {
    /// The key that signs the request.
    #[arg(long, value_parser = parse_uri, env = "HWKEY_KEY")]
    key: KeyUri,
    /// Subject, e.g. "CN=alice,O=devs" (Kubernetes: CN = user, each O = a group).
    #[arg(long)]
    subject: String,
    /// A DNS subject alternative name (repeatable).
    #[arg(long = "dns")]
    dns: Vec<String>,
    /// An IP subject alternative name (repeatable).
    #[arg(long = "ip")]
    ip: Vec<String>,
    /// Write the PEM here (atomically) instead of stdout.
    #[arg(long)]
    out: Option<PathBuf>,
}

pub fn run(args: CsrArgs) -> anyhow::Result<()> {
    let request = CsrRequest::parse(&args.subject, &args.dns, &args.ip)?;
    let key = Key::open(&args.key)?;
    let der = csr::build(&key, &request)?;
    emit(args.out.as_deref(), &csr::to_pem(&der))
}
