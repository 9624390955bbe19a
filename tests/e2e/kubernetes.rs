//! The Kubernetes manifests agree with the binaries: every flag and env var they pass is one
//! the binary accepts (checked against its `--help`), the gRPC port each container listens
//! on is the one its Service targets and its probes check, verifiers sit behind a headless
//! Service that the orchestrator's `--verifier-dns` names, the drafter URL names the drafter
//! Service, and verifiers request CPU, memory (and a GPU in the CUDA variant).

use std::collections::HashMap;
use std::path::Path;
use std::process::Command;

use specd_e2e::binaries;
use yaml_rust2::{Yaml, YamlLoader};

fn load(name: &str) -> Vec<Yaml> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/k8s")
        .join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    YamlLoader::load_from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn kind<'a>(docs: &'a [Yaml], kind: &str) -> Vec<&'a Yaml> {
    docs.iter().filter(|d| d["kind"].as_str() == Some(kind)).collect()
}

fn name(doc: &Yaml) -> &str {
    doc["metadata"]["name"].as_str().expect("metadata.name")
}

fn strings(y: &Yaml) -> Vec<String> {
    y.as_vec()
        .map(|v| {
            v.iter()
                .map(|s| s.as_str().expect("a string").to_string())
                .collect()
        })
        .unwrap_or_default()
}

fn help(binary: &str) -> String {
    let out = Command::new(binary).arg("--help").output().expect("run --help");
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap()
}

/// `--flag=value` or `--flag value` pairs.
fn flags(args: &[String]) -> HashMap<String, String> {
    let mut out = HashMap::new();
    let mut i = 0;
    while i < args.len() {
        let arg = &args[i];
        if let Some((flag, value)) = arg.split_once('=') {
            out.insert(flag.to_string(), value.to_string());
        } else if arg.starts_with("--") {
            let value = args.get(i + 1).filter(|v| !v.starts_with("--")).cloned();
            if value.is_some() {
                i += 1;
            }
            out.insert(arg.clone(), value.unwrap_or_default());
        }
        i += 1;
    }
    out
}

fn port_of(listen: &str) -> i64 {
    listen.rsplit(':').next().unwrap().parse().unwrap()
}

/// Checks one container against its binary; returns its flags.
fn check_container(container: &Yaml, binaries: &HashMap<&str, &str>) -> HashMap<String, String> {
    let command = strings(&container["command"]);
    let binary = binaries
        .get(command[0].as_str())
        .unwrap_or_else(|| panic!("unknown binary {}", command[0]));
    let help = help(binary);
    let args = strings(&container["args"]);
    let flags = flags(&args);
    for flag in flags.keys() {
        assert!(
            help.contains(&format!("{flag} ")) || help.contains(&format!("{flag}\n")),
            "{} does not take {flag}",
            command[0]
        );
    }
    for env in container["env"].as_vec().unwrap() {
        let var = env["name"].as_str().unwrap();
        // A flag's env var (`[env: VAR=]`) or one the help text documents (the model cache).
        assert!(help.contains(var), "{} reads no {var}", command[0]);
    }
    let listen = port_of(&flags["--listen"]);
    let ports = container["ports"].as_vec().unwrap();
    let grpc = ports
        .iter()
        .find(|p| p["name"].as_str() == Some("grpc"))
        .expect("a grpc port");
    assert_eq!(
        grpc["containerPort"].as_i64(),
        Some(listen),
        "{}: grpc port",
        command[0]
    );
    if let Some(metrics) = flags.get("--metrics-listen") {
        let declared = ports
            .iter()
            .find(|p| p["name"].as_str() == Some("metrics"))
            .expect("a metrics port");
        assert_eq!(declared["containerPort"].as_i64(), Some(port_of(metrics)));
    }
    // Probes run `specd health https://127.0.0.1:PORT` (gRPC health over mutual TLS, with
    // the container's own certificate from SPECD_TLS_*) against the serving port.
    for probe in ["readinessProbe", "livenessProbe"] {
        let exec = strings(&container[probe]["exec"]["command"]);
        assert_eq!(exec[..2], ["specd", "health"], "{}: {probe}", command[0]);
        assert_eq!(
            exec[2],
            format!("https://127.0.0.1:{listen}"),
            "{}: {probe} port",
            command[0]
        );
    }
    let mounts = container["volumeMounts"].as_vec().unwrap();
    for env in container["env"].as_vec().unwrap() {
        let var = env["name"].as_str().unwrap();
        if var.starts_with("SPECD_TLS_") {
            let path = env["value"].as_str().unwrap();
            assert!(
                mounts
                    .iter()
                    .any(|m| path.starts_with(m["mountPath"].as_str().unwrap())),
                "{}: {var}={path} is on no mounted volume",
                command[0]
            );
        }
    }
    flags
}

fn containers(deployment: &Yaml) -> &Vec<Yaml> {
    deployment["spec"]["template"]["spec"]["containers"]
        .as_vec()
        .unwrap()
}

#[test]
fn manifests_match_the_binaries_flags_ports_and_services() {
    let bins = binaries!();
    let by_command = HashMap::from([
        ("verifier-svc", bins.verifier),
        ("drafter-svc", bins.drafter),
        ("orchestrator", bins.orchestrator),
        ("specd", bins.specd),
    ]);
    let docs = load("specd.yaml");
    let services: HashMap<&str, &Yaml> = kind(&docs, "Service").into_iter().map(|s| (name(s), s)).collect();
    let deployments: HashMap<&str, &Yaml> = kind(&docs, "Deployment")
        .into_iter()
        .map(|d| (name(d), d))
        .collect();
    let mut flags_by_deployment = HashMap::new();
    for (deployment_name, deployment) in &deployments {
        for init in deployment["spec"]["template"]["spec"]["initContainers"]
            .as_vec()
            .unwrap()
        {
            assert_eq!(strings(&init["command"]), ["specd", "fetch-model"]);
            assert!(help(bins.specd).contains("fetch-model"));
        }
        let container = &containers(deployment)[0];
        flags_by_deployment.insert(*deployment_name, check_container(container, &by_command));
        // The Service of the same name selects these pods and targets the grpc port.
        let service = services[deployment_name];
        let labels = &deployment["spec"]["template"]["metadata"]["labels"];
        for (key, value) in service["spec"]["selector"].as_hash().unwrap() {
            assert_eq!(
                &labels[key.as_str().unwrap()],
                value,
                "{deployment_name}: selector"
            );
        }
        let port = &service["spec"]["ports"].as_vec().unwrap()[0];
        assert_eq!(port["targetPort"].as_str(), Some("grpc"));
        assert_eq!(
            port["port"].as_i64(),
            Some(port_of(&flags_by_deployment[deployment_name]["--listen"]))
        );
    }
    // Discovery: the orchestrator resolves the verifiers' headless Service.
    let orchestrator = &flags_by_deployment["specd-orchestrator"];
    let (host, port) = orchestrator["--verifier-dns"].rsplit_once(':').unwrap();
    let verifier_service = services[host];
    assert!(
        verifier_service["spec"]["clusterIP"].as_str() == Some("None"),
        "{host} must be headless so DNS lists every verifier pod"
    );
    assert_eq!(
        port.parse::<i64>().unwrap(),
        port_of(&flags_by_deployment["specd-verifier"]["--listen"])
    );
    let drafter_url = &orchestrator["--drafter"];
    assert_eq!(
        drafter_url,
        &format!(
            "https://specd-drafter:{}",
            port_of(&flags_by_deployment["specd-drafter"]["--listen"])
        )
    );
    // Authentication: the key file is mounted from the Secret.
    let keys_path = &orchestrator["--api-keys-file"];
    let pod = &deployments["specd-orchestrator"]["spec"]["template"]["spec"];
    let mount = containers(deployments["specd-orchestrator"])[0]["volumeMounts"]
        .as_vec()
        .unwrap()
        .iter()
        .find(|m| keys_path.starts_with(m["mountPath"].as_str().unwrap()))
        .expect("the API key file is on a mounted volume");
    let volume = pod["volumes"]
        .as_vec()
        .unwrap()
        .iter()
        .find(|v| v["name"] == mount["name"])
        .unwrap();
    let secret_name = volume["secret"]["secretName"].as_str().expect("a Secret volume");
    let secret = kind(&docs, "Secret")
        .into_iter()
        .find(|s| name(s) == secret_name)
        .expect("the Secret");
    let file = keys_path.rsplit('/').next().unwrap();
    assert!(
        secret["stringData"][file].as_str().is_some(),
        "the Secret holds {file}"
    );
    // Verifiers ask for what they use.
    let resources = &containers(deployments["specd-verifier"])[0]["resources"];
    for key in ["cpu", "memory"] {
        assert!(
            !resources["requests"][key].is_badvalue(),
            "verifier requests {key}"
        );
    }

    // The CUDA variant replaces the verifier Deployment: same name and labels, a GPU each.
    let cuda = load("verifier-cuda.yaml");
    let gpu = kind(&cuda, "Deployment")[0];
    assert_eq!(name(gpu), "specd-verifier");
    assert_eq!(
        gpu["spec"]["template"]["metadata"]["labels"],
        deployments["specd-verifier"]["spec"]["template"]["metadata"]["labels"]
    );
    let container = &containers(gpu)[0];
    let flags = check_container(container, &by_command);
    assert_eq!(flags["--device"], "cuda");
    assert_eq!(
        container["resources"]["limits"]["nvidia.com/gpu"].as_i64(),
        Some(1)
    );
}
