//! Fuzzing on stable (issue 9): property tests with a fixed seed and a fixed number of cases
//! over every parser that takes outside input — key URIs, `KUBERNETES_EXEC_INFO`, subjects and
//! DNS names, the proxy config file, kubeconfig merging — plus random bytes at a running
//! proxy's listeners (the ClientHello / HTTP/2-preface peek). The bar is 0 panics: a parser
//! may refuse, never crash, and the proxy must serve an authenticated client afterwards.
//! Inputs that once crashed hwkey are kept as fixed cases beside the properties.

use std::io::Write;
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::time::Duration;

use proptest::prelude::*;
use proptest::test_runner::{Config, RngSeed};

use hwkey::exec::credential::ExecInfo;
use hwkey::key::KeyUri;
use hwkey::pki::csr::CsrRequest;
use hwkey::pki::name::Name;
use support::proxy::{Identity, ProxyProcess};
use support::upstream::TestUpstream;
use support::*;

fn config(cases: u32) -> Config {
    Config {
        cases,
        rng_seed: RngSeed::Fixed(0x0068_776b_6579),
        failure_persistence: None,
        ..Config::default()
    }
}

/// Strings that look like key URIs, with random parts: the structure-aware generator.
fn uri_like() -> impl Strategy<Value = String> {
    let scheme = prop_oneof![Just("pkcs11:"), Just("tpm:"), Just("PKCS11:"), Just("")];
    let part = prop_oneof![
        Just("token=".to_string()),
        Just("object=".to_string()),
        Just("id=%".to_string()),
        Just("serial=".to_string()),
        Just("slot-id=".to_string()),
        Just("path=".to_string()),
        Just("handle=0x".to_string()),
        Just("module-path=".to_string()),
        Just("pin-source=".to_string()),
        Just("pin-value=".to_string()),
        Just("tcti=".to_string()),
        "[a-z%0-9:=/._-]{0,12}",
    ];
    let sep = prop_oneof![Just(";"), Just("?"), Just("&"), Just("")];
    (
        scheme,
        proptest::collection::vec((part, "\\PC{0,8}", sep), 0..8),
    )
        .prop_map(|(scheme, parts)| {
            let mut s = scheme.to_string();
            for (p, v, sep) in parts {
                s.push_str(&p);
                s.push_str(&v);
                s.push_str(sep);
            }
            s
        })
}

#[test]
fn key_uris_never_panic_and_never_leak_a_pin_value() {
    let mut runner = proptest::test_runner::TestRunner::new(config(4000));
    runner
        .run(&prop_oneof![uri_like(), "\\PC{0,80}"], |s| {
            if let Err(e) = s.parse::<KeyUri>() {
                let text = e.to_string();
                // Whatever follows a pin-value= is never echoed.
                // (An attribute named exactly pin-value; its value appearing nowhere else.)
                for (i, _) in s.match_indices("pin-value=") {
                    let named = i > 0 && matches!(s.as_bytes()[i - 1], b':' | b';' | b'?' | b'&');
                    let secret: String = s[i + 10..]
                        .chars()
                        .take_while(|c| !matches!(c, '&' | ';' | '?' | ':'))
                        .collect();
                    let pin_like = secret.chars().all(char::is_alphanumeric);
                    if named
                        && pin_like
                        && secret.len() >= 4
                        && s.matches(secret.as_str()).count() == 1
                    {
                        prop_assert!(!text.contains(&secret), "{text}");
                    }
                }
            }
            Ok(())
        })
        .expect("property");
}

#[test]
fn exec_info_never_panics() {
    let json_like = prop_oneof![
        "\\PC{0,200}",
        (
            prop_oneof![
                Just("client.authentication.k8s.io/v1"),
                Just("client.authentication.k8s.io/v1beta1"),
                Just("x")
            ],
            "\\PC{0,40}",
            any::<bool>(),
        )
            .prop_map(|(v, s, i)| format!(
                r#"{{"apiVersion":"{v}","kind":"ExecCredential","spec":{{"interactive":{i},"cluster":{{"server":"{s}","config":{{"key":"{s}"}}}}}}}}"#
            )),
    ];
    proptest::test_runner::TestRunner::new(config(3000))
        .run(&json_like, |s| {
            let _ = ExecInfo::parse(&s);
            Ok(())
        })
        .expect("property");
}

/// Inputs that made `hwkey csr` exit 101 (a yasna assertion) before.
const CRASHERS: [(&str, &str); 4] = [
    ("C=a\"", "C may hold only"),
    ("SERIALNUMBER=é", "SERIALNUMBER may hold only"),
    ("DC=ünicode", "DC may hold only ASCII"),
    ("EMAILADDRESS=a@ü.de", "EMAILADDRESS may hold only ASCII"),
];

#[test]
fn subjects_and_dns_names_parse_or_refuse_and_always_encode() {
    let attr = prop_oneof![
        Just("CN"),
        Just("O"),
        Just("OU"),
        Just("C"),
        Just("ST"),
        Just("L"),
        Just("SERIALNUMBER"),
        Just("DC"),
        Just("EMAILADDRESS"),
        Just("X")
    ];
    let subject = proptest::collection::vec((attr, "\\PC{0,12}"), 0..6).prop_map(|parts| {
        parts
            .iter()
            .map(|(a, v)| format!("{a}={v}"))
            .collect::<Vec<_>>()
            .join(",")
    });
    proptest::test_runner::TestRunner::new(config(4000))
        .run(
            &(prop_oneof![subject, "\\PC{0,60}"], "\\PC{0,20}"),
            |(subject, dns)| {
                if let Ok(name) = Name::parse(&subject) {
                    // Whatever parses must encode.
                    let _ = yasna::construct_der(|w| name.write_der(w));
                }
                let _ = CsrRequest::parse(&subject, &[dns], &[]);
                Ok(())
            },
        )
        .expect("property");
    for (subject, needle) in CRASHERS {
        let err = Name::parse(subject).expect_err(subject).to_string();
        assert!(err.contains(needle), "{subject}: {err}");
    }
}

/// The CLI: `hwkey csr` refuses each crasher with exit status 1, a message naming the field,
/// and nothing on stdout.
#[test]
fn hwkey_csr_never_exits_101() {
    let id = Identity::softhsm();
    let mut cases: Vec<(Vec<String>, &str)> = CRASHERS
        .iter()
        .map(|(s, needle)| (vec!["--subject".to_string(), s.to_string()], *needle))
        .collect();
    cases.push((
        vec![
            "--subject".into(),
            "CN=x".into(),
            "--dns".into(),
            "é.com".into(),
        ],
        "invalid --dns 'é.com'",
    ));
    for (args, needle) in cases {
        let out = hwkey()
            .envs(id.envs())
            .args(["csr", "--key", &id.key_uri])
            .args(&args)
            .output()
            .expect("run hwkey");
        assert_eq!(
            out.status.code(),
            Some(1),
            "{args:?}: {}",
            output_text(&out)
        );
        assert!(out.stdout.is_empty(), "{args:?} printed on stdout");
        assert!(
            output_text(&out).contains(needle),
            "{args:?}: {}",
            output_text(&out)
        );
    }
}

#[test]
fn config_files_never_panic() {
    let dir = temp_dir();
    let toml_like = proptest::collection::vec(
        (
            prop_oneof![
                Just("key".to_string()),
                Just("listen".to_string()),
                Just("handshake-timeout".to_string()),
                Just("max-connections".to_string()),
                Just("allow-uid".to_string()),
                Just("renew".to_string()),
                Just("rotation-close".to_string()),
                "[a-z-]{1,10}"
            ],
            prop_oneof![
                "\"\\PC{0,10}\"".prop_map(|s| s),
                "[0-9]{1,20}",
                Just("true".to_string()),
                Just("[1, 2]".to_string()),
                Just("[\"a\"]".to_string()),
                "\\PC{0,10}"
            ],
        ),
        0..6,
    )
    .prop_map(|kv| {
        kv.iter()
            .map(|(k, v)| format!("{k} = {v}\n"))
            .collect::<String>()
    });
    let n = std::sync::atomic::AtomicU32::new(0);
    proptest::test_runner::TestRunner::new(config(1500))
        .run(&(toml_like, any::<bool>()), |(text, yaml)| {
            let n = n.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let path = dir
                .path()
                .join(format!("c{n}.{}", if yaml { "yaml" } else { "toml" }));
            std::fs::write(&path, text.replace(" = ", if yaml { ": " } else { " = " }))
                .expect("write");
            let _ = hwkey::proxy::SettingsInput::from_file(&path);
            Ok(())
        })
        .expect("property");
}

/// Random bytes at the loopback TLS listener and the UNIX socket (2,000 payloads, bounded):
/// the proxy stays up and serves an authenticated client afterwards.
#[test]
fn random_bytes_at_the_listeners_do_not_hurt_the_proxy() {
    let id = Identity::softhsm();
    let upstream = TestUpstream::start(&id.ca);
    let mut proxy = ProxyProcess::start(&id, &upstream);
    let mut runner = proptest::test_runner::TestRunner::new(config(1000));
    let tls_record =
        (any::<u8>(), proptest::collection::vec(any::<u8>(), 0..300)).prop_map(|(t, body)| {
            // Often a plausible TLS record header, so the ClientHello parser is reached.
            let mut v = vec![0x16, 0x03, 0x01, (body.len() >> 8) as u8, body.len() as u8];
            if t % 3 == 0 {
                v[0] = t;
            }
            v.extend(body);
            v
        });
    runner
        .run(&tls_record, |bytes| {
            if let Ok(mut s) = TcpStream::connect(("127.0.0.1", proxy.tcp_port)) {
                let _ = s.write_all(&bytes);
            }
            Ok(())
        })
        .expect("property");
    let preface_like = prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..64),
        "PRI \\* HTTP/2\\.0\\PC{0,10}".prop_map(String::into_bytes),
    ];
    runner
        .run(&preface_like, |bytes| {
            if let Ok(mut s) = UnixStream::connect(&proxy.socket) {
                s.set_write_timeout(Some(Duration::from_secs(2))).ok();
                let _ = s.write_all(&bytes);
            }
            Ok(())
        })
        .expect("property");
    let out = proxy.curl_unix(&["--fail"], "/version");
    assert!(
        out.status.success(),
        "{}\n{}",
        output_text(&out),
        proxy.log()
    );
    assert!(proxy.guard.try_wait().is_none(), "the proxy died");
}
