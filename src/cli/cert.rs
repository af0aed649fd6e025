//! `hwkey cert import|show`.

use std::path::PathBuf;

use clap::Subcommand;

use crate::key::{self, Key, KeyUri};
use crate::pki::cert;

#[derive(Debug, Subcommand)]
pub enum CertCommand {
    /// Store a certificate (chain) with its key: on the token (PKCS#11) or beside the key file
    /// (TPM). Refuses a certificate for another key.
    Import {
        #[arg(long, value_parser = super::KeyUriParser, env = "HWKEY_KEY")]
        key: KeyUri,
        /// PEM file: the key's certificate first, then intermediates.
        #[arg(long)]
        cert: PathBuf,
        /// The CA bundle that issued it (e.g. /etc/kubernetes/pki/ca.crt): the chain's
        /// signatures are checked against it before anything is replaced.
        #[arg(long)]
        ca: Option<PathBuf>,
    },
    /// Show a key's certificate: subject, issuer, SANs, validity, and whether it matches the key.
    Show {
        #[arg(long, value_parser = super::KeyUriParser, env = "HWKEY_KEY")]
        key: KeyUri,
        /// Show this file instead of the stored certificate.
        #[arg(long)]
        cert: Option<PathBuf>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
}

pub fn run(cmd: CertCommand) -> anyhow::Result<()> {
    match cmd {
        CertCommand::Import {
            key: uri,
            cert: path,
            ca,
        } => {
            let chain = cert::load_chain(&path)?;
            let anchors = match &ca {
                Some(p) => cert::load_chain(p)?,
                None => Vec::new(),
            };
            cert::check_for_import(&chain, &anchors)?;
            let opened = Key::open(&uri)?;
            cert::ensure_matches(&chain[0], &opened)?;
            drop(opened);
            let chain: Vec<Vec<u8>> = chain.into_iter().map(|c| c.to_vec()).collect();
            let place = key::store_chain(&uri, &chain)?;
            eprintln!("stored {place}");
            Ok(())
        }
        CertCommand::Show {
            key: uri,
            cert: path,
            json,
        } => {
            let opened = Key::open(&uri)?;
            let chain = cert::chain_for_key(&opened, path.as_deref())?;
            let mut out = Vec::new();
            for (i, c) in chain.iter().enumerate() {
                let summary = cert::summarize(c)?;
                let matches = if i == 0 {
                    Some(cert::matches_key(c, &opened)?)
                } else {
                    None
                };
                out.push((summary, matches));
            }
            if json {
                print_json(&out)?;
            } else {
                print_text(&out);
            }
            if matches!(out.first(), Some((_, Some(false)))) {
                anyhow::bail!("the certificate does not match {}", opened.describe());
            }
            Ok(())
        }
    }
}

/// `cert show --json`: one object per certificate, the leaf with `matchesKey`.
fn print_json(out: &[(cert::CertSummary, Option<bool>)]) -> anyhow::Result<()> {
    let items: Vec<_> = out
        .iter()
        .map(|(s, m)| {
            let mut v = serde_json::to_value(s).unwrap_or_default();
            if let (Some(m), Some(obj)) = (m, v.as_object_mut()) {
                obj.insert("matchesKey".into(), (*m).into());
            }
            v
        })
        .collect();
    println!("{}", serde_json::to_string_pretty(&items)?);
    Ok(())
}

/// `cert show`: one block per certificate.
fn print_text(out: &[(cert::CertSummary, Option<bool>)]) {
    for (i, (s, m)) in out.iter().enumerate() {
        if i > 0 {
            println!();
        }
        println!("subject:    {}", s.subject);
        println!("issuer:     {}", s.issuer);
        println!("serial:     {}", s.serial);
        println!("not before: {}", s.not_before);
        println!("not after:  {}", s.not_after);
        if !s.subject_alt_names.is_empty() {
            println!("SANs:       {}", s.subject_alt_names.join(", "));
        }
        println!("key:        {}", s.key_algorithm);
        if let Some(m) = m {
            println!(
                "matches key: {}",
                if *m {
                    "yes"
                } else {
                    "NO: this certificate is for another key"
                }
            );
        }
    }
}
