//! deploy/: the Kubernetes manifests pass the Kubernetes schema (offline, with the
//! `kubernetes-validate` package that .ci/run installs), and nginx's ConfigMap is the shared
//! template with the StatefulSet's replicas filled in.

use std::path::{Path, PathBuf};
use std::process::Command;

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../deploy")
        .canonicalize()
        .expect("deploy/ at the repository root")
}

fn validate(files: &[PathBuf]) -> std::process::Output {
    Command::new("kubernetes-validate")
        .arg("--strict")
        .args(files)
        .output()
        .expect("kubernetes-validate is needed: python3 -m pip install kubernetes-validate (.ci/run does)")
}

#[test]
fn manifests_pass_the_kubernetes_schema_and_a_broken_one_does_not() {
    let k8s = deploy().join("k8s");
    let files = ["leyline.yaml", "nginx.yaml"].map(|f| k8s.join(f));
    let out = validate(&files);
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{text}");
    for kind in [
        "statefulset/leyline",
        "service/leyline",
        "configmap/leyline-nginx",
        "deployment/leyline-nginx",
        "service/leyline-entry",
    ] {
        assert!(
            text.contains(&format!("passed for resource {kind}")),
            "{kind} was not checked: {text}"
        );
    }
    // The same check refuses a manifest with a wrong type, so it is not a no-op.
    let dir = tempfile::tempdir().expect("a scratch directory");
    let bad = dir.path().join("bad.yaml");
    let text = std::fs::read_to_string(&files[0]).expect("leyline.yaml");
    std::fs::write(&bad, text.replace("replicas: 3", "replicas: three")).expect("write");
    assert!(
        !validate(&[bad]).status.success(),
        "a string replica count passed"
    );
}

#[test]
fn the_nginx_configmap_is_the_template_with_one_server_per_replica() {
    let dir = deploy();
    let template = std::fs::read_to_string(dir.join("nginx/leyline.conf.in")).expect("template");
    let yaml = std::fs::read_to_string(dir.join("k8s/nginx.yaml")).expect("nginx.yaml");
    let statefulset = std::fs::read_to_string(dir.join("k8s/leyline.yaml")).expect("leyline.yaml");
    // The ConfigMap's block literal: the lines after `default.conf: |`, indented by 4.
    let mut lines = yaml
        .lines()
        .skip_while(|l| l.trim() != "default.conf: |")
        .skip(1);
    let conf: Vec<&str> = lines
        .by_ref()
        .take_while(|l| l.is_empty() || l.starts_with("    "))
        .map(|l| l.strip_prefix("    ").unwrap_or(l))
        .collect();
    // Folding its upstream lines and its listen line back gives the template.
    let upstream = |l: &str| {
        let t = l.trim_start();
        t.starts_with("server leyline-")
            || t.starts_with("resolver ")
            || t.starts_with("# nginx >= 1.27.3")
    };
    let mut folded = Vec::new();
    let mut servers = 0;
    for l in &conf {
        if upstream(l) {
            servers += usize::from(l.trim_start().starts_with("server "));
            if folded.last() != Some(&"@UPSTREAMS@") {
                folded.push("@UPSTREAMS@");
            }
        } else if l.trim() == "listen 8080;" {
            folded.push("@LISTEN@");
        } else {
            folded.push(l);
        }
    }
    let folded = folded.join("\n");
    assert_eq!(
        folded.trim_end(),
        template.trim_end(),
        "deploy/k8s/nginx.yaml differs from deploy/nginx/leyline.conf.in"
    );
    let replicas: usize = statefulset
        .lines()
        .find_map(|l| l.trim().strip_prefix("replicas: "))
        .and_then(|n| n.parse().ok())
        .expect("the StatefulSet's replica count");
    assert_eq!(servers, replicas, "one nginx server line per replica");
    for i in 0..replicas {
        assert!(
            conf.iter()
                .any(|l| l.contains(&format!("leyline-{i}.leyline."))),
            "replica {i} is not in the ring"
        );
    }
}
