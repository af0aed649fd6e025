//! The approver after an etcd restore: every object gone and resource versions starting over,
//! lower than the ones its watch holds. client-go's reflector lists again at once when the API
//! server answers "too large resource version" (or 410); so must the approver.

use std::time::Duration;

use support::kube::{Approval, KubeCluster};
use support::proxy::Identity;
use support::*;

use super::kit::*;
use crate::lifecycle::kit::enroll_node;

/// The API server restarted on a wiped etcd under a running approver, as an operator restoring
/// etcd would (the approver's manifest and trust applied again, the approver left running):
/// a node's request made after the restore is decided within a minute, not at the next
/// 15-minute resync.
#[test]
fn after_an_etcd_restore_the_approver_lists_again_and_decides() {
    require_tool("kubectl", "kubectl (from the machine image)");
    let id = Identity::tpm();
    let mut cluster = KubeCluster::start_with(&id.ca, "10m", Approval::SignerOnly);
    let work = temp_dir();
    let dir = work.path();
    let (trust, tcti) = enroll_node(&id, dir, "node-a");
    let a = Tpm::with(None, tcti, dir, "node-a");
    install_approver(&cluster, &trust);
    // With the admin's certificate: a service account's token does not outlive a wiped etcd
    // (the account is made anew, with another uid).
    let replica = Replica::start(&cluster.admin_kubeconfig, dir, "approver");
    let log = || replica.child.log();
    let subject = "CN=system:node:node-a,O=system:nodes";
    submit_request(
        &cluster,
        dir,
        "before-restore",
        &a.request(subject, &[]),
        KUBELET_SIGNER,
    );
    assert_decided(
        &cluster,
        "before-restore",
        "Approved",
        "AttestedTPMKey",
        &log,
    );

    cluster.restore_wiped_etcd();
    install_approver(&cluster, &trust);
    submit_request(
        &cluster,
        dir,
        "after-restore",
        &a.request(subject, &[]),
        KUBELET_SIGNER,
    );
    if let Err(e) = decided_as(
        &cluster,
        "after-restore",
        "Approved",
        "AttestedTPMKey",
        Duration::from_secs(60),
    ) {
        panic!("{e}\n{}", log());
    }
    assert_eq!(replica.terminate().code(), Some(0));
}
