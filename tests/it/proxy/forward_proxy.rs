//! Forward proxies as users have them (issue 25, item 1): kubectl through hwkey reaches a real
//! kube-apiserver whose port only a real forward proxy may reach (an iptables rule refuses
//! everyone else), squid with Basic authentication for HTTP CONNECT and dante for SOCKS5. The
//! proxy comes from the cluster's `proxy-url`, carried over by `hwkey kubeconfig`.

use std::process::Command;

use support::forward_proxies::{Dante, OnlyThrough, Squid};
use support::kube::KubeCluster;
use support::kubectl::KubectlUser;
use support::output_text;
use support::proxy::Identity;

/// The user's own kubeconfig entry for the cluster, reached through `proxy_url`.
fn existing_entry(cluster: &KubeCluster, proxy_url: &str) -> String {
    format!(
        "apiVersion: v1\nkind: Config\nclusters:\n- name: hw\n  cluster:\n    server: {}\n    certificate-authority: {}\n    proxy-url: {proxy_url}\ncontexts: []\nusers: []\n",
        cluster.url(),
        cluster.ca_path().display()
    )
}

/// The API server answers only through the proxy: a direct connection is refused.
fn direct_is_refused(cluster: &KubeCluster) {
    let out = Command::new("curl")
        .args(["-sS", "--max-time", "5", "--cacert"])
        .arg(cluster.ca_path())
        .arg(format!("{}/version", cluster.url()))
        .output()
        .expect("curl");
    assert!(
        !out.status.success(),
        "the API server is reachable without the forward proxy: {}",
        output_text(&out)
    );
}

/// kubectl authenticates as alice through hwkey and the forward proxy.
fn kubectl_works(user: &KubectlUser) {
    let out = user
        .kubectl()
        .args(["get", "--raw", "/version"])
        .output()
        .expect("kubectl");
    assert!(
        out.status.success(),
        "{}\n{}",
        output_text(&out),
        user.proxy_log()
    );
    let out = user
        .kubectl()
        .args(["get", "namespaces"])
        .output()
        .expect("kubectl");
    assert!(
        output_text(&out).contains("User \"alice\" cannot list resource"),
        "{}",
        output_text(&out)
    );
}

#[test]
fn kubectl_reaches_the_real_apiserver_only_through_squid_with_authentication() {
    let id = Identity::softhsm();
    let cluster = KubeCluster::start(&id.ca, "10m");
    let squid = Squid::start(Some(("hw", "s3cret")));
    let _firewall = OnlyThrough::user(cluster.port, "proxy");
    direct_is_refused(&cluster);

    let proxy_url = format!("http://hw:s3cret@127.0.0.1:{}", squid.port);
    let user = KubectlUser::over(
        Some(&existing_entry(&cluster, &proxy_url)),
        &id.key_uri,
        &id.cert,
        &cluster.url(),
        &cluster.ca_path(),
        id.envs(),
    );
    // The entry kubectl now uses points at loopback, without the proxy (client-go would send
    // even loopback through it); the hwkey proxy carries it.
    let text = std::fs::read_to_string(user.kubeconfig()).expect("kubeconfig");
    let doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(&text).expect("YAML");
    let cluster_entry = &doc["clusters"][0]["cluster"];
    assert!(cluster_entry.get("proxy-url").is_none(), "{text}");
    assert_eq!(
        cluster_entry["extensions"][0]["extension"]["upstreamProxy"],
        proxy_url.as_str()
    );
    kubectl_works(&user);
    let log = squid.access_log();
    assert!(
        log.contains(&format!("CONNECT 127.0.0.1:{}", cluster.port)) && log.contains(" hw "),
        "squid did not carry the connection as user hw:\n{log}"
    );
    assert!(!user.proxy_log().contains("s3cret"), "{}", user.proxy_log());

    // A wrong proxy password, as kubectl shows it: the error names the proxy and its 407,
    // never the password (nor does the proxy's log).
    let wrong_url = format!("http://hw:wrong-one@127.0.0.1:{}", squid.port);
    let wrong = KubectlUser::over(
        Some(&existing_entry(&cluster, &wrong_url)),
        &id.key_uri,
        &id.cert,
        &cluster.url(),
        &cluster.ca_path(),
        id.envs(),
    );
    let out = wrong
        .kubectl()
        .args(["get", "--raw", "/version"])
        .output()
        .expect("kubectl");
    let text = output_text(&out);
    assert!(
        !out.status.success()
            && text.contains(&format!("forward proxy http://127.0.0.1:{}", squid.port))
            && text.contains("407"),
        "{text}"
    );
    assert!(!text.contains("wrong-one") && !wrong.proxy_log().contains("wrong-one"));
}

#[test]
fn kubectl_and_probe_reach_the_real_apiserver_only_through_dante() {
    let id = Identity::softhsm();
    let cluster = KubeCluster::start(&id.ca, "10m");
    let dante = Dante::start();
    let _firewall = OnlyThrough::user(cluster.port, "nobody");
    direct_is_refused(&cluster);
    let user = KubectlUser::over(
        Some(&existing_entry(&cluster, &dante.url())),
        &id.key_uri,
        &id.cert,
        &cluster.url(),
        &cluster.ca_path(),
        id.envs(),
    );
    kubectl_works(&user);
    assert!(
        dante.log().contains("connect"),
        "dante did not carry the connection:\n{}",
        dante.log()
    );
    // `hwkey probe` goes the same way.
    let text = id.probe(&cluster.url(), &["--proxy-url", &dante.url()]);
    assert!(text.contains("TLSv1.3"), "{text}");
}
