//! Where the verifier replicas are: a static list of endpoints, and DNS names re-resolved
//! periodically, every address behind a name being one replica (what `docker compose up
//! --scale verifier=N` and a Kubernetes headless Service publish). A name that fails to
//! resolve keeps its last known addresses, so a resolver hiccup does not empty the pool.

use std::collections::{BTreeMap, BTreeSet};

/// One configured source of replicas.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// An endpoint used as given, e.g. `http://10.0.0.5:50052`.
    Static(String),
    /// A `host:port` whose every address is a replica.
    Dns { host: String, port: u16 },
}

/// Parses `--verifier` URLs and `--verifier-dns` names.
pub fn parse_targets(urls: &[String], dns_names: &[String]) -> Result<Vec<Target>, String> {
    let mut targets = Vec::new();
    for url in urls.iter().map(|u| u.trim()).filter(|u| !u.is_empty()) {
        if !(url.starts_with("http://") || url.starts_with("https://")) {
            return Err(format!(
                "verifier endpoint {url:?} must start with http:// or https://"
            ));
        }
        targets.push(Target::Static(url.to_string()));
    }
    for name in dns_names.iter().map(|n| n.trim()).filter(|n| !n.is_empty()) {
        let (host, port) = name
            .rsplit_once(':')
            .ok_or_else(|| format!("verifier DNS name {name:?} must be host:port"))?;
        let port: u16 = port
            .parse()
            .map_err(|_| format!("verifier DNS name {name:?} has a bad port"))?;
        if host.is_empty() {
            return Err(format!("verifier DNS name {name:?} has no host"));
        }
        targets.push(Target::Dns {
            host: host.to_string(),
            port,
        });
    }
    if targets.is_empty() {
        return Err("no verifier configured: give --verifier URLs or --verifier-dns names".into());
    }
    Ok(targets)
}

/// Resolves targets to replica endpoints, remembering each name's last good answer.
pub struct Resolver {
    /// `http` or `https` for the endpoints a DNS name yields.
    scheme: &'static str,
    last_known: BTreeMap<String, BTreeSet<String>>,
}

impl Default for Resolver {
    fn default() -> Self {
        Self::new("http")
    }
}

impl Resolver {
    pub fn new(scheme: &'static str) -> Self {
        Self {
            scheme,
            last_known: BTreeMap::new(),
        }
    }

    /// Every replica endpoint the targets name now, with the name its TLS certificate must
    /// carry (the URL's host, or the DNS name it was found under).
    pub async fn resolve(&mut self, targets: &[Target]) -> BTreeMap<String, String> {
        let mut endpoints = BTreeMap::new();
        for target in targets {
            match target {
                Target::Static(url) => {
                    endpoints.insert(url.clone(), crate::backend::host_of(url).to_string());
                }
                Target::Dns { host, port } => {
                    let name = format!("{host}:{port}");
                    match tokio::net::lookup_host(&name).await {
                        Ok(addresses) => {
                            let scheme = self.scheme;
                            let found: BTreeSet<String> =
                                addresses.map(|a| format!("{scheme}://{a}")).collect();
                            if found.is_empty() {
                                tracing::warn!(%name, "DNS name resolves to no address; keeping the last known replicas");
                            } else {
                                self.last_known.insert(name.clone(), found);
                            }
                        }
                        Err(error) => {
                            tracing::warn!(%name, %error, "cannot resolve; keeping the last known replicas");
                        }
                    }
                    if let Some(known) = self.last_known.get(&name) {
                        endpoints.extend(known.iter().map(|e| (e.clone(), host.clone())));
                    }
                }
            }
        }
        endpoints
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn targets_are_parsed_with_precise_errors() {
        let urls = vec!["http://10.0.0.1:50052".to_string(), " ".to_string()];
        let names = vec!["verifier:50052".to_string()];
        assert_eq!(
            parse_targets(&urls, &names).unwrap(),
            vec![
                Target::Static("http://10.0.0.1:50052".into()),
                Target::Dns {
                    host: "verifier".into(),
                    port: 50052
                }
            ]
        );
        assert!(
            parse_targets(&["10.0.0.1:1".into()], &[])
                .unwrap_err()
                .contains("http://")
        );
        assert!(
            parse_targets(&[], &["verifier".into()])
                .unwrap_err()
                .contains("host:port")
        );
        assert!(
            parse_targets(&[], &["verifier:x".into()])
                .unwrap_err()
                .contains("bad port")
        );
        assert!(parse_targets(&[], &[]).unwrap_err().contains("no verifier"));
    }

    #[tokio::test]
    async fn names_resolve_to_one_replica_per_address_and_failures_keep_the_last_answer() {
        let mut resolver = Resolver::default();
        let targets = vec![
            Target::Static("http://127.0.0.9:1".into()),
            Target::Dns {
                host: "127.0.0.1".into(),
                port: 7,
            },
        ];
        let found = resolver.resolve(&targets).await;
        assert_eq!(
            found.into_iter().collect::<Vec<_>>(),
            vec![
                ("http://127.0.0.1:7".to_string(), "127.0.0.1".to_string()),
                ("http://127.0.0.9:1".to_string(), "127.0.0.9".to_string())
            ]
        );
        // "localhost" answers from /etc/hosts without a DNS server.
        let local = resolver
            .resolve(&[Target::Dns {
                host: "localhost".into(),
                port: 9,
            }])
            .await;
        assert_eq!(
            local.get("http://127.0.0.1:9").map(String::as_str),
            Some("localhost"),
            "{local:?}"
        );
        // With TLS, DNS endpoints are https and keep the name for certificate checks.
        let tls = Resolver::new("https")
            .resolve(&[Target::Dns {
                host: "localhost".into(),
                port: 9,
            }])
            .await;
        assert!(tls.contains_key("https://127.0.0.1:9"), "{tls:?}");
        // A name that stops resolving keeps its last answer.
        resolver.last_known.insert(
            "no-such-host.invalid:5".into(),
            ["http://10.1.1.1:5".to_string()].into(),
        );
        let kept = resolver
            .resolve(&[Target::Dns {
                host: "no-such-host.invalid".into(),
                port: 5,
            }])
            .await;
        assert_eq!(
            kept.into_keys().collect::<Vec<_>>(),
            vec!["http://10.1.1.1:5".to_string()]
        );
    }
}
