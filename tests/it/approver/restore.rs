//! The approver after an etcd restore: every object gone and resource versions starting over,
//! lower than the ones its watch holds. client-go's reflector lists again at once when the API
//! server answers "too large resource version" (or 410); so must the approver.

use std::process::Command;
use std::time::Duration;

use support::kube::{Approval, KubeCluster};
use support::proxy::Identity;
use support::*;

use super::kit::*;
use crate::lifecycle::kit::enroll_node;

/// The API server restarted on a wiped etcd under an approver, as an operator restoring etcd
/// would (the approver's manifest and trust applied again, the approver left in place): a
/// node's request made after the restore is decided within a minute, not at the next 15-minute
/// resync.
///
/// The approver is stopped (SIGSTOP, a stalled node) from before the wipe until the new
/// store's revision has passed the one its watch holds, with the request made before that: its
/// watch then resumes without an error, past the request, and no resource version went back
/// when it looks. Only the Lease it had seen, gone from the new store, tells it to list again.
/// (Before that check, the test failed this way at random when the first look came late; now
/// it does every time without it: 3cffb2b never decides the request.)
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

    let watched = resource_version(&cluster);
    let pid = replica.child.id().to_string();
    run_ok(Command::new("kill").args(["-STOP", &pid]));
    cluster.restore_wiped_etcd();
    install_approver(&cluster, &trust);
    submit_request(
        &cluster,
        dir,
        "after-restore",
        &a.request(subject, &[]),
        KUBELET_SIGNER,
    );
    let made = bump_past(&cluster, dir, watched + 100);
    run_ok(Command::new("kill").args(["-CONT", &pid]));
    if let Err(e) = decided_as(
        &cluster,
        "after-restore",
        "Approved",
        "AttestedTPMKey",
        Duration::from_secs(60),
    ) {
        panic!("{e}\n{}", log());
    }
    assert!(
        log().contains("listing every request again"),
        "the approver says why it listed again ({made} writes after the wipe):\n{}",
        log()
    );
    assert_eq!(replica.terminate().code(), Some(0));
}

/// The API server's current resource version (etcd's revision), from a list of one.
fn resource_version(cluster: &KubeCluster) -> u64 {
    let out = run_ok(cluster.kubectl().args([
        "get",
        "--raw",
        "/api/v1/namespaces/default/configmaps?limit=1",
    ]));
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).expect("a list");
    list["metadata"]["resourceVersion"]
        .as_str()
        .and_then(|v| v.parse().ok())
        .expect("a resource version")
}

/// Writes ConfigMaps, 250 per `kubectl create`, until the revision passes `target`; returns
/// how many were written.
fn bump_past(cluster: &KubeCluster, dir: &std::path::Path, target: u64) -> usize {
    let mut made = 0;
    while resource_version(cluster) <= target {
        let items: Vec<serde_json::Value> = (0..250)
            .map(|i| {
                serde_json::json!({
                    "apiVersion": "v1",
                    "kind": "ConfigMap",
                    "metadata": {"name": format!("bump-{}", made + i), "namespace": "default"},
                })
            })
            .collect();
        let file = dir.join("bump.json");
        let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": items});
        std::fs::write(&file, list.to_string()).expect("write the bump list");
        run_ok(cluster.kubectl().arg("create").arg("-f").arg(&file));
        made += 250;
    }
    made
}
