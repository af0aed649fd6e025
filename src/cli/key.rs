//! `hwkey key create|list|public|info|delete`.

use anyhow::{bail, Context};
use clap::Subcommand;

use crate::key::{self, Key, KeyAlgorithm, KeyUri};

#[derive(Debug, Subcommand)]
pub enum KeyCommand {
    /// Create a key inside the token or TPM and print its public key (PEM).
    ///
    /// Refuses, changing nothing, when a key with that label/id (or that file/handle) exists.
    Create {
        /// The key to create, e.g. pkcs11:token=kube;object=alice?module-path=…&pin-source=file:/p
        /// or tpm:path=/var/lib/hwkey/alice.pem
        #[arg(long, value_parser = super::KeyUriParser, env = "HWKEY_KEY")]
        key: KeyUri,
        /// ec-p256 (recommended), ec-p384, rsa-2048, rsa-3072 or rsa-4096.
        #[arg(long, default_value = "ec-p256")]
        algorithm: String,
    },
    /// List the keys on a token (pkcs11:token=T?…) or TPM (tpm:?tcti=…): one line per key.
    List {
        /// The token or TPM.
        #[arg(long, value_parser = super::KeyUriParser, env = "HWKEY_KEY")]
        key: KeyUri,
        /// Print JSON instead of lines.
        #[arg(long)]
        json: bool,
    },
    /// Print a key's public key (SubjectPublicKeyInfo PEM).
    Public {
        #[arg(long, value_parser = super::KeyUriParser, env = "HWKEY_KEY")]
        key: KeyUri,
    },
    /// Show what a key is and how it is protected (PKCS#11 attributes).
    Info {
        #[arg(long, value_parser = super::KeyUriParser, env = "HWKEY_KEY")]
        key: KeyUri,
    },
    /// Delete a key and the objects tied to it. Needs --yes.
    Delete {
        #[arg(long, value_parser = super::KeyUriParser, env = "HWKEY_KEY")]
        key: KeyUri,
        /// Confirm: the private key is destroyed for good.
        #[arg(long)]
        yes: bool,
    },
}

pub fn run(cmd: KeyCommand) -> anyhow::Result<()> {
    match cmd {
        KeyCommand::Create { key, algorithm } => {
            let algorithm: KeyAlgorithm = algorithm.parse()?;
            let created = Key::create(&key, algorithm)?;
            eprintln!("created {algorithm} key: {}", created.describe());
            print!("{}", created.public_key_pem());
            Ok(())
        }
        KeyCommand::List { key, json } => list(&key, json),
        KeyCommand::Public { key } => {
            let opened = Key::open(&key)?;
            print!("{}", opened.public_key_pem());
            Ok(())
        }
        KeyCommand::Info { key } => info(&key),
        KeyCommand::Delete { key, yes } => {
            if !yes {
                bail!(
                    "refusing to delete {key} without --yes: this destroys the private key for good, and every certificate issued for it becomes useless"
                );
            }
            let removed = key::delete(&key).context("nothing was deleted")?;
            for what in removed {
                eprintln!("deleted {what}");
            }
            Ok(())
        }
    }
}

/// `key list`: one line (or JSON object) per key.
fn list(uri: &KeyUri, json: bool) -> anyhow::Result<()> {
    let keys = key::list(uri)?;
    if json {
        let items: Vec<_> = keys
            .iter()
            .map(|k| {
                serde_json::json!({
                    "uri": k.uri.to_string(),
                    "algorithm": k.algorithm.to_string(),
                    "certificate": k.has_certificate,
                })
            })
            .collect();
        println!("{}", serde_json::to_string_pretty(&items)?);
        return Ok(());
    }
    if keys.is_empty() {
        eprintln!("no keys found");
    }
    for k in keys {
        let cert = if k.has_certificate {
            "\tcertificate"
        } else {
            ""
        };
        println!("{}\t{}{cert}", k.uri, k.algorithm);
    }
    Ok(())
}

/// `key info`: what the key is, how it signs, and whether it can leave its device.
fn info(uri: &KeyUri) -> anyhow::Result<()> {
    let opened = Key::open(uri)?;
    println!("key:       {}", opened.describe());
    println!("uri:       {}", opened.uri());
    println!("algorithm: {}", opened.algorithm());
    let schemes: Vec<String> = opened.schemes().iter().map(|s| s.to_string()).collect();
    println!("schemes:   {}", schemes.join(", "));
    println!("signing:   {}", opened.signing_path());
    let protection = opened.protection()?;
    for (name, value) in &protection.attributes {
        println!("{name}: {value}");
    }
    if protection.pin_always() {
        println!("PIN always: yes (CKA_ALWAYS_AUTHENTICATE: the PIN is presented for every signature; TLS resumption keeps signatures rare)");
    }
    if protection.exportable.is_empty() {
        println!("extractable: no (the device says the private key cannot leave it)");
    } else {
        println!("extractable: YES: {}", protection.exportable.join("; "));
    }
    let cert = match opened.stored_chain() {
        Ok(Some(chain)) => format!("{} stored", chain.len()),
        Ok(None) => "none stored".into(),
        Err(e) => format!("unreadable: {e}"),
    };
    println!("certificate: {cert}");
    Ok(())
}
