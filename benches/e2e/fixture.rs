//! The fixture every figure shares: one SoftHSM identity, its upstream, a proxy in front of
//! it, and direct clients; plus the round schedule and the row helpers.

use super::*;

pub(crate) struct Fixture {
    pub(crate) id: Identity,
    pub(crate) upstream: TestUpstream,
    pub(crate) proxy: ProxyProcess,
    /// Direct to the upstream with a software key; sessions cached.
    pub(crate) direct: Arc<ClientConfig>,
    /// The same with no session cache: a full handshake each time.
    pub(crate) direct_full: Arc<ClientConfig>,
    /// The same as kubectl's stand-in ([`as_kubectl`]): a full handshake, no ticket.
    pub(crate) direct_kubectl: Arc<ClientConfig>,
    pub(crate) direct_h2: Arc<ClientConfig>,
    /// Direct to the upstream with a software key on hwkey's own crypto provider (its suites
    /// and key exchange, the hybrid first): how the loopback floor originates TLS, as the
    /// proxy does.
    pub(crate) as_proxy: Arc<ClientConfig>,
    pub(crate) as_proxy_h2: Arc<ClientConfig>,
    /// To the proxy's loopback TLS listener with a loopback credential.
    pub(crate) loopback: Arc<ClientConfig>,
    pub(crate) loopback_h2: Arc<ClientConfig>,
    /// As kubectl's stand-in ([`as_kubectl`]): a new kubectl process's full loopback
    /// handshake, no ticket.
    pub(crate) loopback_fresh: Arc<ClientConfig>,
    /// The software client certificate and key files (for kubectl's plain kubeconfig).
    pub(crate) soft_cert: PathBuf,
    pub(crate) soft_key: PathBuf,
    /// Holds the software certificate files.
    pub(crate) _dir: tempfile::TempDir,
}

impl Fixture {
    pub(crate) fn new() -> Fixture {
        let id = Identity::softhsm();
        let upstream = TestUpstream::start(&id.ca);
        let proxy = ProxyProcess::start(&id, &upstream);
        let dir = temp_dir();
        let (soft_cert, soft_key) = id.ca.client_cert(dir.path(), "soft", "alice", Some("devs"));
        let ca = id.ca.ca_pem().into_bytes();
        let cert = std::fs::read(&soft_cert).expect("cert");
        let key = std::fs::read(&soft_key).expect("key");
        let cred = proxy.credential();
        let field = |name: &str| cred[name].as_str().expect(name).as_bytes().to_vec();
        let (lca, lcert, lkey) = (
            field("certificateAuthorityPem"),
            field("clientCertificatePem"),
            field("clientKeyPem"),
        );
        Fixture {
            direct: client_config(&ca, &cert, &key, &[b"http/1.1"], true),
            direct_full: client_config(&ca, &cert, &key, &[b"http/1.1"], false),
            direct_kubectl: as_kubectl(&client_config(&ca, &cert, &key, &[b"http/1.1"], false)),
            direct_h2: client_config(&ca, &cert, &key, &[b"h2"], true),
            as_proxy: client_config_on(
                hwkey::pki::tls::provider(),
                &ca,
                &cert,
                &key,
                &[b"http/1.1"],
                true,
            ),
            as_proxy_h2: client_config_on(
                hwkey::pki::tls::provider(),
                &ca,
                &cert,
                &key,
                &[b"h2"],
                true,
            ),
            loopback: client_config(&lca, &lcert, &lkey, &[b"http/1.1"], true),
            loopback_h2: client_config(&lca, &lcert, &lkey, &[b"h2"], true),
            loopback_fresh: as_kubectl(&client_config(&lca, &lcert, &lkey, &[b"http/1.1"], false)),
            id,
            upstream,
            proxy,
            soft_cert,
            soft_key,
            _dir: dir,
        }
    }
}

/// Rounds of the timed keep-alive trials whose goals are ratios to a floor (UNIX socket and
/// loopback TLS, 8 and 64 connections). One round's ratio spreads about ± 10 % on a shared
/// two-core machine (each trial is under a second), so the median of five moved between 0.92×
/// and 1.11× from run to run of the same build; fifteen rounds narrow the median's spread by
/// √3 for about three more minutes per run.
pub(crate) fn goal_rounds() -> usize {
    pick(15, 2)
}

/// The order of trials: `rounds` rounds of every series, the order reversed every other round
/// so that neither side always runs first (or right after a warm cache).
pub(crate) fn schedule(rounds: usize, series: usize) -> Vec<usize> {
    (0..rounds)
        .flat_map(|round| {
            let order: Vec<usize> = if round % 2 == 0 {
                (0..series).collect()
            } else {
                (0..series).rev().collect()
            };
            order
        })
        .collect()
}

/// "the median's 95 % interval [lo–hi]" of `subject ÷ baseline`, round by round, and how
/// many rounds reached `goal`, for a row whose target is a ratio.
pub(crate) fn interval_note(subject: &[f64], baseline: &[f64], goal: Option<f64>) -> String {
    let ratios: Vec<f64> = paired_ratios(subject, baseline)
        .into_iter()
        .filter(|r| r.is_finite())
        .collect();
    let mut note = match median_interval(&ratios) {
        Some((lo, hi)) => format!(
            "the median's 95 % interval (order statistics, {} rounds): {lo:.3}–{hi:.3}×",
            ratios.len()
        ),
        None => format!("{} rounds: too few for an interval", ratios.len()),
    };
    if let Some(goal) = goal {
        let reached = ratios.iter().filter(|r| **r >= goal).count();
        note += &format!("; {reached} of {} rounds at ≥ {goal}×", ratios.len());
    }
    note
}

pub(crate) fn ratio_row(
    area: &str,
    measure: &str,
    unit: &str,
    subject: &[f64],
    label: &str,
    baseline: &[f64],
) -> Row {
    let ratios = paired_ratios(subject, baseline);
    Row::new(area, measure, unit, Some(Stat::of(subject))).versus(
        label,
        Some(Stat::of(baseline)),
        Some(Stat::of(&ratios)),
    )
}

pub(crate) fn at_least(row: Row, target: f64) -> Row {
    let met = row.ratio.map(|r| r.median >= target);
    row.target(&format!("≥ {target}×"), met)
}
