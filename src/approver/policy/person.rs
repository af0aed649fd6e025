//! The self-renewal policy for people (`kubernetes.io/kube-apiserver-client`, opt-in with
//! `--people-trust`): a person renews their own identity, with a key that hardware registered
//! for them vouches for, every time, and nothing else.
//!
//! What the request alone decides ([`check_request`], then the proof in
//! [`judge`]), in order:
//!
//! 1. `spec.usages` are a client certificate's;
//! 2. the requester is a person: not `system:*` (service accounts, nodes, bootstrap tokens,
//!    `system:anonymous`, control-plane components) and in none of the groups those carry;
//! 3. the subject is the requester: exactly one CN equal to `spec.username`, every O one of
//!    `spec.groups` and not a `system:` group (`system:masters` aside, settled against the allow
//!    list), nothing else; no SAN; extensions and attributes as the node policy allows;
//! 4. the lifetime: where the API server knows `spec.expirationSeconds` (1.22 and later) it is
//!    required and at most `--people-max-lifetime`;
//! 5. the proof: TPM evidence, checked and kept fresh exactly as a node's (a new key or the same
//!    one: every issuance carries fresh evidence); a YubiKey's PIV attestation of exactly the
//!    request's key ([`crate::pki::piv`]); or, weaker, the requester's current certificate for
//!    exactly this subject and key ([`crate::pki::same_key`]).
//!
//! What the people trust decides when the decision is written ([`settle`]):
//!
//! - **who**: the requester is named in the allow list (`users`, or `certificateOnly`). A group
//!   admits nobody: a person who authenticates with a client certificate has that
//!   certificate's O values as groups, so a group would vouch for the holder's other
//!   certificates (gus in `devs` by his own `O=devs` renewing `CN=gus,O=qa`). `groups` names only
//!   the groups a certificate may carry that need saying (`system:masters`).
//! - **which proof**: hardware, by default: TPM evidence by an AK registered under the
//!   person's name, or the PIV attestation of a YubiKey whose serial their entry lists
//!   ([`piv_registered`]), for the first certificate and for every renewal. The current certificate
//!   alone proves possession of a key, not where the key lives (a stolen session, a
//!   certificate from before hwkey, a software key): it is accepted only for a person the
//!   allow list names under `certificateOnly`.
//!
//! The trust is read again within two seconds before an approval, so a person removed from it
//! (their name, or their AK or YubiKey entry) is refused from then on, whatever proof they
//! carry.

use k8s_openapi::api::certificates::v1::CertificateSigningRequest;

use super::strict::{self, Purpose};
use super::verdict::{Pending, Settling};
use crate::approver::allow_list::{Admitted, AllowList};
use crate::approver::decision::{Decided, Decision, Effect};
use crate::approver::evaluate::{
    self, Candidate, OnMissingEvidence, PersonCandidate, PersonProof, Seen,
};
use crate::approver::reason::bounded;
use crate::approver::reason::{violation, Reason, Violation};
use crate::approver::rules::PeopleRules;
use crate::approver::trust::Registry;
use crate::pki::piv::PivFacts;
use crate::pki::registration::RegisteredPiv;
use crate::pki::request::{Request, OID_COMMON_NAME};
use crate::pki::same_key::{self, Proof};

/// The group that bypasses authorization: approved into a certificate only when the allow list
/// names it.
pub const MASTERS: &str = "system:masters";

/// Groups that mark a requester as not a person, whatever its name.
const NOT_PEOPLE: [&str; 4] = [
    "system:serviceaccounts",
    "system:nodes",
    "system:bootstrappers",
    "system:unauthenticated",
];

/// The requester, from the request object (set by the API server, not the requester).
fn requester(csr: &CertificateSigningRequest) -> (String, Vec<String>) {
    (
        csr.spec.username.clone().unwrap_or_default(),
        csr.spec.groups.clone().unwrap_or_default(),
    )
}

/// A person, not a service account, node, bootstrap token, anonymous or a component.
fn check_person(user: &str, groups: &[String]) -> Result<(), Violation> {
    let refuse = |m: String| violation(Reason::RequesterNotAllowed, m);
    if user.is_empty() || user.starts_with("system:") {
        return Err(refuse(format!(
            "'{}' is not a person (a system: identity: service account, node, bootstrap token, anonymous or component): only people renew through this policy",
            bounded(user)
        )));
    }
    if let Some(g) = groups.iter().find(|g| {
        NOT_PEOPLE
            .iter()
            .any(|n| g.as_str() == *n || g.starts_with(&format!("{n}:")))
    }) {
        return Err(refuse(format!(
            "'{}' is in group {}: not a person",
            bounded(user),
            bounded(g)
        )));
    }
    Ok(())
}

/// Exactly one CN equal to the requester's name; each O one of the requester's groups and not
/// a `system:` group other than `system:masters`; nothing else. Returns the O values.
pub fn check_subject(
    request: &Request,
    user: &str,
    groups: &[String],
) -> Result<Vec<String>, Violation> {
    let refuse = |m: String| violation(Reason::SubjectNotAllowed, m);
    let (name, orgs) = strict::cn_and_o(request, "a person's")?;
    if name != user {
        return Err(violation(
            Reason::RequesterNotAllowed,
            format!(
                "'{}' may not ask for CN={}: a person renews only their own identity",
                bounded(user),
                bounded(name)
            ),
        ));
    }
    for org in &orgs {
        if !groups.iter().any(|g| g == org) {
            return Err(refuse(format!(
                "O={} is not one of {}'s groups ({})",
                bounded(org),
                bounded(user),
                bounded(&groups.join(", "))
            )));
        }
        if org.starts_with("system:") && *org != MASTERS {
            return Err(refuse(format!(
                "O={} is a system group: a person's certificate does not carry it",
                bounded(org)
            )));
        }
    }
    Ok(orgs.into_iter().map(str::to_string).collect())
}

/// For a request that carries no proof (left to a human by default): the requester asks for
/// their own name, as Go reads it (the last CN), or the request is denied with the reason.
pub fn check_requester_is_subject(
    csr: &CertificateSigningRequest,
    request: &Request,
) -> Result<(), Violation> {
    let (user, _) = requester(csr);
    let cns = request.subject_values(OID_COMMON_NAME);
    match cns.as_slice() {
        [name] if *name == user && !user.is_empty() => Ok(()),
        _ => Err(violation(
            Reason::RequesterNotAllowed,
            format!(
                "'{}' asks for {} with no proof of the key: a request without proof waits for a human only when the requester asks for their own name",
                bounded(&user),
                if cns.is_empty() {
                    "no CN".to_string()
                } else {
                    format!("CN={}", bounded(&cns.join(", CN=")))
                }
            ),
        )),
    }
}

/// `spec.expirationSeconds` where the API server knows it: required, and at most the maximum.
fn check_lifetime(csr: &CertificateSigningRequest, rules: &PeopleRules) -> Result<(), Violation> {
    let max = rules.max_lifetime.as_secs();
    // A lifetime over the maximum is denied whatever this reading of the API server says: behind
    // a load balancer of mixed versions another one may keep it.
    if !rules.expiration_known.known() && csr.spec.expiration_seconds.is_none() {
        return Ok(());
    }
    match csr.spec.expiration_seconds {
        None => Err(violation(
            Reason::LifetimeNotAllowed,
            format!("the request asks for no lifetime (spec.expirationSeconds): a person's certificate is asked for at most {max} s (hwkey renew --expiration-seconds)"),
        )),
        Some(s) if u64::try_from(s).map_or(true, |s| s > max) => Err(violation(
            Reason::LifetimeNotAllowed,
            format!("the request asks for {s} s: at most {max} s"),
        )),
        Some(_) => Ok(()),
    }
}

/// The checks the request alone decides, up to (not including) its proof of the key.
pub fn check_request(
    csr: &CertificateSigningRequest,
    request: &Request,
    rules: &PeopleRules,
) -> Result<(String, Vec<String>, Vec<String>), Violation> {
    strict::check_usages(
        &csr.spec.usages.clone().unwrap_or_default(),
        Purpose::Client,
    )?;
    let (user, groups) = requester(csr);
    check_person(&user, &groups)?;
    let orgs = check_subject(request, &user, &groups)?;
    strict::check_attributes(request)?;
    strict::check_extensions(request, Purpose::Client)?;
    check_lifetime(csr, rules)?;
    Ok((user, groups, orgs))
}

/// What the allow list (the `_allow` entry's text) decides for `user` asking for `orgs`:
/// which proofs admit them, or the denial.
pub fn allow_list_admits(
    user: &str,
    orgs: &[String],
    allow: Option<&str>,
) -> Result<Admitted, Violation> {
    let refuse = |m: String| violation(Reason::RequesterNotAllowed, m);
    let list = match allow.map(AllowList::parse) {
        None => {
            return Err(refuse(
                "the people trust has no '_allow' entry: nobody may renew".into(),
            ))
        }
        Some(Err(e)) => {
            return Err(refuse(format!(
                "the people trust's '_allow' entry is refused ({}): nobody may renew",
                bounded(&e.to_string())
            )))
        }
        Some(Ok(list)) => list,
    };
    let Some(admitted) = list.admits(user) else {
        let groups = list.groups.iter().filter(|g| *g != MASTERS).count();
        let note = if groups > 0 {
            " (its groups admit nobody: a person's groups come from their own certificate; list people by name)"
        } else {
            ""
        };
        return Err(refuse(format!(
            "'{}' is not named in the people allow list (users, certificateOnly){note}",
            bounded(user)
        )));
    };
    if orgs.iter().any(|o| o == MASTERS) && !list.groups.iter().any(|g| g == MASTERS) {
        return Err(violation(
            Reason::SubjectNotAllowed,
            format!("O={MASTERS} is allowed only when the allow list names that group"),
        ));
    }
    Ok(admitted)
}

/// [`allow_list_admits`], then the proof the allow list asks of `user`: a renewal with the current
/// certificate alone (`certificate_only_proof`) only for a person named under
/// `certificateOnly`.
pub fn admit_person(
    user: &str,
    orgs: &[String],
    certificate_only_proof: bool,
    allow: Option<&str>,
) -> Result<(), Violation> {
    match allow_list_admits(user, orgs, allow)? {
        Admitted::Hardware if certificate_only_proof => Err(violation(
            Reason::HardwareProofRequired,
            format!(
                "'{}' renews with their current certificate alone, which proves possession of the key, not that hardware holds it: renew with hardware proof (hwkey renew --attest or a YubiKey's PIV attestation; hwkey kubeconfig --renew --attest), or an administrator names them under certificateOnly in the people allow list",
                bounded(user)
            ),
        )),
        _ => Ok(()),
    }
}

/// What the people trust's PIV registrations decide for `user`'s attested key: the approval's
/// message, or the denial. The device must be registered for that user (by serial), and the
/// slot's policies and the firmware at least what the entry requires.
pub fn piv_registered(
    user: &str,
    facts: &PivFacts,
    registered: &[RegisteredPiv],
) -> Result<String, Violation> {
    let who = bounded(user);
    let Some(entry) = registered.iter().find(|p| p.user == user) else {
        return Err(violation(
            Reason::UnknownAttestationKey,
            format!("no YubiKey is registered for '{who}' (a people trust entry '{who}' with piv: serials): the attested device, serial {}, proves nothing for them", facts.serial),
        ));
    };
    if !entry.serials.contains(&facts.serial) {
        return Err(violation(
            Reason::UnknownAttestationKey,
            format!(
                "the key is in YubiKey {}, which is not registered for '{who}' ({})",
                facts.serial,
                entry
                    .serials
                    .iter()
                    .map(u64::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ));
    }
    check_piv_requirements(&who, facts, entry)?;
    Ok(format!(
        "the key is in YubiKey {} (firmware {}, slot {}, PIN {}, touch {}) registered for '{who}', chained to '{}'",
        facts.serial,
        facts.firmware,
        facts.slot.as_deref().unwrap_or("?"),
        facts.pin_policy,
        facts.touch_policy,
        bounded(&facts.root)
    ))
}

/// The slot's policies and the device's firmware at least what `entry` requires.
fn check_piv_requirements(
    who: &str,
    facts: &PivFacts,
    entry: &RegisteredPiv,
) -> Result<(), Violation> {
    let weaker = |what: &str, got: String, want: String| {
        violation(
            Reason::EvidenceInvalid,
            format!("the key's {what} is {got}; '{who}' is registered with at least {want}"),
        )
    };
    if let Some(want) = entry.pin_policy.filter(|w| facts.pin_policy < *w) {
        return Err(weaker(
            "PIN policy",
            facts.pin_policy.to_string(),
            want.to_string(),
        ));
    }
    if let Some(want) = entry.touch_policy.filter(|w| facts.touch_policy < *w) {
        return Err(weaker(
            "touch policy",
            facts.touch_policy.to_string(),
            want.to_string(),
        ));
    }
    if let Some(want) = entry.min_firmware.filter(|w| facts.firmware < *w) {
        return Err(weaker(
            "firmware",
            facts.firmware.to_string(),
            want.to_string(),
        ));
    }
    Ok(())
}

/// Judges a person's request by itself: [`check_request`], then its proof of the key.
pub fn judge(
    csr: &CertificateSigningRequest,
    rules: &evaluate::Rules,
    now: i64,
) -> Result<Option<Pending>, Violation> {
    let Some(people) = &rules.people else {
        return Ok(None);
    };
    let request = Request::from_pem(&csr.spec.request.0)?;
    let proof = same_key::proof_of(&request);
    if proof == Proof::Missing && people.on_missing_proof == OnMissingEvidence::Ignore {
        // Left for a human only when the requester asks for their own name (an enrolment
        // waiting for its first hardware proof); one approval away from someone else's name
        // is a request nobody should have to remember to deny.
        return check_requester_is_subject(csr, &request).map(|()| None);
    }
    let (user, groups, orgs) = check_request(csr, &request, people)?;
    let proof = match proof {
        Proof::Missing => {
            return Err(violation(
                Reason::NoEvidence,
                "the request carries neither the requester's current certificate (a renewal with the same key: hwkey renew) nor TPM evidence (a new key: --attest)",
            ))
        }
        Proof::Unreadable(m) => return Err(violation(Reason::EvidenceInvalid, m)),
        Proof::CurrentCertificate(cert) => PersonProof::SameKey(
            same_key::verify_same_key(&request, &cert, &people.client_cas, now)
                .map_err(|r| violation(Reason::of(r.refusal), r.message))?,
        ),
        Proof::PivAttestation { attestation, certs } => {
            PersonProof::Piv(Box::new(piv_facts(&request, &attestation, &certs, people, now)?))
        }
        Proof::TpmCertify => PersonProof::Attested(Box::new(evaluate::attested(
            csr,
            &request,
            user.clone(),
            0,
            rules,
            now,
        )?)),
    };
    Ok(Some(Pending::Person(Box::new(PersonCandidate {
        user,
        groups,
        orgs,
        proof,
    }))))
}

/// A PIV attestation that holds for this request: exactly one device certificate, a chain to
/// a configured root, the attested key the request's own (and its signature, possession).
fn piv_facts(
    request: &Request,
    attestation: &[u8],
    certs: &[Vec<u8>],
    people: &PeopleRules,
    now: i64,
) -> Result<crate::pki::piv::PivFacts, Violation> {
    let invalid = |m: String| violation(Reason::EvidenceInvalid, m);
    let [f9] = certs else {
        return Err(invalid(format!(
            "a PIV attestation carries exactly the device's attestation certificate (f9), not {} certificates",
            certs.len()
        )));
    };
    if !request.signature_verifies() {
        return Err(invalid(
            "the request's own signature does not verify with its key".into(),
        ));
    }
    let facts = people
        .piv_roots
        .verify(attestation, f9, now)
        .map_err(|e| invalid(format!("the PIV attestation does not hold: {e}")))?;
    if facts.spki != request.spki_der() {
        return Err(invalid(
            "the PIV attestation is for another key than the request's".into(),
        ));
    }
    Ok(facts)
}

/// The decision for a person's request that passed every check of its own: the allow list
/// admits the requester; a TPM key is then settled like a node's, against the AKs
/// registered per user.
pub fn settle(
    s: &mut Settling<'_>,
    seen: Box<Seen>,
    candidate: PersonCandidate,
    people: &Registry,
) -> Decided {
    let (decision, granted) = verdict(s, &seen, candidate, people);
    Decided {
        seen,
        decision,
        granted,
        effect: Effect::None,
    }
}

fn verdict(
    s: &mut Settling<'_>,
    seen: &Seen,
    candidate: PersonCandidate,
    people: &Registry,
) -> (Decision, Option<Box<Candidate>>) {
    let same_key = matches!(candidate.proof, PersonProof::SameKey(_));
    let allowed = admit_person(
        &candidate.user,
        &candidate.orgs,
        same_key,
        people.allow.as_deref(),
    );
    if let Err(v) = allowed {
        if let PersonProof::Attested(c) = &candidate.proof {
            s.index.forget(&c.attested.evidence_digest, &seen.uid);
        }
        let decision = Decision {
            name: seen.name.clone(),
            approved: false,
            reason: v.reason,
            message: v.message,
        };
        return (decision, None);
    }
    match candidate.proof {
        PersonProof::SameKey(held) if held.not_after < s.now => {
            let decision = Decision {
                name: seen.name.clone(),
                approved: false,
                reason: Reason::EvidenceInvalid,
                message: "the attached certificate expired while the request waited: a person whose certificate expired enrols again".into(),
            };
            (decision, None)
        }
        PersonProof::SameKey(held) => {
            let until = time::OffsetDateTime::from_unix_timestamp(held.not_after)
                .map(|t| t.to_string())
                .unwrap_or_else(|_| held.not_after.to_string());
            let decision = Decision {
                name: seen.name.clone(),
                approved: true,
                reason: Reason::SameKeyRenewal,
                message: format!(
                    "'{}' renews with the key of the certificate they hold (serial {}, valid until {until})",
                    bounded(&candidate.user),
                    held.serial
                ),
            };
            (decision, None)
        }
        PersonProof::Attested(c) => {
            super::node_client::settle_attested(s, seen, c, &people.aks, "user")
        }
        PersonProof::Piv(facts) => (settle_piv(seen, &candidate.user, &facts, &people.piv), None),
    }
}

/// The decision for a person's key attested by a YubiKey: the devices registered for them
/// decide ([`piv_registered`]).
fn settle_piv(
    seen: &Seen,
    user: &str,
    facts: &crate::pki::piv::PivFacts,
    registered: &[crate::pki::registration::RegisteredPiv],
) -> Decision {
    let (approved, reason, message) = match piv_registered(user, facts, registered) {
        Ok(m) => (true, Reason::AttestedPivKey, m),
        Err(v) => (false, v.reason, v.message),
    };
    Decision {
        name: seen.name.clone(),
        approved,
        reason,
        message,
    }
}

#[cfg(test)]
mod tests {
    use super::super::signer::tests::request;
    use super::*;

    fn groups(list: &[&str]) -> Vec<String> {
        list.iter().map(|g| g.to_string()).collect()
    }

    #[test]
    fn a_person_asks_for_their_own_name_and_groups_only() {
        use rcgen::DnType::*;
        let alice = request(&[(CommonName, "alice"), (OrganizationName, "devs")]);
        assert_eq!(
            check_subject(&alice, "alice", &groups(&["devs", "system:authenticated"])),
            Ok(vec!["devs".to_string()])
        );
        for (user, member_of, want) in [
            ("bob", &["devs"][..], Reason::RequesterNotAllowed),
            ("alice", &["ops"][..], Reason::SubjectNotAllowed),
        ] {
            let v = check_subject(&alice, user, &groups(member_of)).expect_err(user);
            assert_eq!(v.reason, want, "{v}");
        }
        let ou = request(&[
            (CommonName, "alice"),
            (OrganizationalUnitName, "x"),
            (OrganizationName, "devs"),
        ]);
        assert!(check_subject(&ou, "alice", &groups(&["devs"])).is_err());
        let system = request(&[(CommonName, "alice"), (OrganizationName, "system:nodes")]);
        assert!(check_subject(&system, "alice", &groups(&["system:nodes"])).is_err());
        let masters = request(&[(CommonName, "alice"), (OrganizationName, MASTERS)]);
        assert!(check_subject(&masters, "alice", &groups(&[MASTERS])).is_ok());
    }

    #[test]
    fn system_identities_are_not_people() {
        for (user, member_of) in [
            (
                "system:serviceaccount:default:x",
                &["system:serviceaccounts"][..],
            ),
            ("system:node:n", &["system:nodes"]),
            ("system:bootstrap:abcdef", &["system:bootstrappers"]),
            ("system:anonymous", &["system:unauthenticated"]),
            ("", &[]),
            ("alice", &["system:serviceaccounts:default"]),
        ] {
            assert!(check_person(user, &groups(member_of)).is_err(), "{user}");
        }
        assert!(check_person("alice", &groups(&["devs", "system:authenticated"])).is_ok());
    }

    fn decide(user: &str, orgs: &[&str], allow: Option<&str>) -> Result<Admitted, Violation> {
        allow_list_admits(user, &groups(orgs), allow)
    }

    #[test]
    fn only_a_name_admits_and_masters_is_named_explicitly() {
        let allow = "users: [alice]\ncertificateOnly: [bob]\ngroups: [devs]\n";
        assert_eq!(decide("alice", &[], Some(allow)), Ok(Admitted::Hardware));
        assert_eq!(
            decide("bob", &["devs"], Some(allow)),
            Ok(Admitted::HardwareOrCertificate)
        );
        // A group admits nobody, whether or not the certificate asked for carries it (gus in
        // devs by his own certificate's O, asking for O=qa).
        for orgs in [&[][..], &["devs"], &["qa"]] {
            let v = decide("gus", orgs, Some(allow)).expect_err("a group admits nobody");
            assert_eq!(v.reason, Reason::RequesterNotAllowed);
            assert!(v.message.contains("groups admit nobody"), "{v}");
        }
        assert!(decide("alice", &[], None).is_err());
        assert!(decide("alice", &[], Some("users: alice\n")).is_err());
        assert!(decide("alice", &[], Some("user: [alice]\n")).is_err());
        assert!(decide("alice", &[], Some("certificate_only: [alice]\n")).is_err());
        assert!(decide("alice", &[], Some("users: [alice, '']\n")).is_err());
        let v = decide("alice", &[MASTERS], Some(allow)).expect_err("masters not named");
        assert_eq!(v.reason, Reason::SubjectNotAllowed);
        let with_masters = "users: [alice]\ngroups: [devs, system:masters]\n";
        assert_eq!(
            decide("alice", &[MASTERS], Some(with_masters)),
            Ok(Admitted::Hardware)
        );
    }

    /// A YubiKey decides only for the person it is registered for, by serial, and only with at
    /// least the policies and firmware the entry requires.
    #[test]
    fn a_yubikey_admits_only_its_registered_person_with_the_required_policies() {
        use crate::pki::piv::{Firmware, PinPolicy, TouchPolicy};
        let facts = PivFacts {
            serial: 4242,
            firmware: Firmware(5, 4, 3),
            pin_policy: PinPolicy::Once,
            touch_policy: TouchPolicy::Cached,
            form_factor: None,
            slot: Some("9a".into()),
            spki: Vec::new(),
            root: "root".into(),
        };
        let entry = |user: &str, serials: &[u64]| RegisteredPiv {
            user: user.into(),
            serials: serials.to_vec(),
            pin_policy: Some(PinPolicy::Once),
            touch_policy: Some(TouchPolicy::Cached),
            min_firmware: Some(Firmware(5, 4, 0)),
        };
        assert!(piv_registered(
            "alice",
            &facts,
            &[entry("bob", &[1]), entry("alice", &[4242])]
        )
        .is_ok());
        for (what, registered, want) in [
            ("no entry", vec![], Reason::UnknownAttestationKey),
            (
                "another person's device",
                vec![entry("bob", &[4242])],
                Reason::UnknownAttestationKey,
            ),
            (
                "another serial",
                vec![entry("alice", &[4243])],
                Reason::UnknownAttestationKey,
            ),
            (
                "a PIN policy below",
                vec![RegisteredPiv {
                    pin_policy: Some(PinPolicy::Always),
                    ..entry("alice", &[4242])
                }],
                Reason::EvidenceInvalid,
            ),
            (
                "a touch policy below",
                vec![RegisteredPiv {
                    touch_policy: Some(TouchPolicy::Always),
                    ..entry("alice", &[4242])
                }],
                Reason::EvidenceInvalid,
            ),
            (
                "an older firmware",
                vec![RegisteredPiv {
                    min_firmware: Some(Firmware(5, 7, 4)),
                    ..entry("alice", &[4242])
                }],
                Reason::EvidenceInvalid,
            ),
        ] {
            let v = piv_registered("alice", &facts, &registered).expect_err(what);
            assert_eq!(v.reason, want, "{what}: {v}");
        }
    }
}
