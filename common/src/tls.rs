//! TLS for every server and client (rustls through tonic). A service given a certificate
//! serves TLS; an internal service (drafter, verifier) given a CA also demands a client
//! certificate signed by it (mutual TLS), and a client (the orchestrator calling them)
//! verifies servers against the CA and presents its own certificate. [`DevCa`] makes a
//! development CA and certificates (`specd dev-certs`, and the tests).

use std::path::{Path, PathBuf};

use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};

/// TLS flags every binary takes.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct TlsArgs {
    /// PEM certificate this process presents: as a server, and as a client to the services
    /// it calls. With --tls-key, turns TLS on.
    #[arg(long, env = "SPECD_TLS_CERT", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "SPECD_TLS_KEY", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// PEM CA certificate: servers accept only clients with a certificate it signed (mutual
    /// TLS); clients accept only servers it signed.
    #[arg(long, env = "SPECD_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
}

fn read(path: &Path, what: &str) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("cannot read the TLS {what} {}: {e}", path.display()))
}

impl TlsArgs {
    pub fn enabled(&self) -> bool {
        self.tls_cert.is_some()
    }

    fn identity(&self) -> Result<Option<Identity>, String> {
        match (&self.tls_cert, &self.tls_key) {
            (Some(cert), Some(key)) => Ok(Some(Identity::from_pem(
                read(cert, "certificate")?,
                read(key, "key")?,
            ))),
            _ => Ok(None),
        }
    }

    fn ca(&self) -> Result<Option<Certificate>, String> {
        self.tls_ca
            .as_deref()
            .map(|p| read(p, "CA certificate").map(Certificate::from_pem))
            .transpose()
    }

    /// The server side. `mutual`: refuse clients without a certificate of the CA (internal
    /// services); a CA is then required.
    pub fn server(&self, mutual: bool) -> Result<Option<ServerTlsConfig>, String> {
        let Some(identity) = self.identity()? else {
            return Ok(None);
        };
        let mut config = ServerTlsConfig::new().identity(identity);
        match self.ca()? {
            // A public port accepts clients without certificates (they use API keys).
            Some(ca) => config = config.client_ca_root(ca).client_auth_optional(!mutual),
            None if mutual => {
                return Err(
                    "an internal service serving TLS needs --tls-ca to verify its clients (mutual TLS)"
                        .into(),
                );
            }
            None => {}
        }
        Ok(Some(config))
    }

    /// The client side, verifying the server as `domain`. Without a CA, the system's roots.
    pub fn client(&self, domain: &str) -> Result<Option<ClientTlsConfig>, String> {
        if !self.enabled() && self.tls_ca.is_none() {
            return Ok(None);
        }
        let mut config = ClientTlsConfig::new().domain_name(domain);
        if let Some(ca) = self.ca()? {
            config = config.ca_certificate(ca);
        }
        if let Some(identity) = self.identity()? {
            config = config.identity(identity);
        }
        Ok(Some(config))
    }

    /// `http` or `https`, as URLs to peers should say.
    pub fn scheme(&self) -> &'static str {
        if self.enabled() || self.tls_ca.is_some() {
            "https"
        } else {
            "http"
        }
    }
}

/// A development certificate authority.
pub struct DevCa {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    pem: String,
}

/// A certificate and its key, PEM.
pub struct IssuedCert {
    pub cert_pem: String,
    pub key_pem: String,
}

impl DevCa {
    pub fn new(name: &str) -> Result<Self, String> {
        let err = |e: rcgen::Error| format!("cannot make the CA: {e}");
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(err)?;
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params.distinguished_name.push(rcgen::DnType::CommonName, name);
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::CrlSign,
        ];
        params.not_before = rcgen::date_time_ymd(2025, 1, 1);
        params.not_after = rcgen::date_time_ymd(2035, 1, 1);
        let key = rcgen::KeyPair::generate().map_err(err)?;
        let cert = params.self_signed(&key).map_err(err)?;
        Ok(Self {
            issuer: rcgen::Issuer::new(params, key),
            pem: cert.pem(),
        })
    }

    pub fn cert_pem(&self) -> &str {
        &self.pem
    }

    /// A certificate for `names` (DNS names or IP addresses) good for both server and client
    /// use; `expired` makes one whose validity ended in 2025 (for tests).
    pub fn issue(&self, names: &[&str], expired: bool) -> Result<IssuedCert, String> {
        let err = |e: rcgen::Error| format!("cannot issue a certificate for {names:?}: {e}");
        let mut params =
            rcgen::CertificateParams::new(names.iter().map(|n| n.to_string()).collect::<Vec<_>>())
                .map_err(err)?;
        params.distinguished_name.push(
            rcgen::DnType::CommonName,
            names.first().copied().unwrap_or("specd"),
        );
        params.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.not_before = rcgen::date_time_ymd(2025, 1, 1);
        params.not_after = if expired {
            rcgen::date_time_ymd(2025, 6, 1)
        } else {
            rcgen::date_time_ymd(2035, 1, 1)
        };
        let key = rcgen::KeyPair::generate().map_err(err)?;
        let cert = params.signed_by(&key, &self.issuer).map_err(err)?;
        Ok(IssuedCert {
            cert_pem: cert.pem(),
            key_pem: key.serialize_pem(),
        })
    }

    /// Writes `ca.pem` and, per name, `NAME.pem` and `NAME-key.pem` (valid for NAME and the
    /// extra `sans`) into `dir`.
    pub fn write(&self, dir: &Path, names: &[&str], sans: &[&str]) -> Result<(), String> {
        std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
        let write = |file: String, text: &str| {
            let path = dir.join(file);
            std::fs::write(&path, text).map_err(|e| format!("cannot write {}: {e}", path.display()))
        };
        write("ca.pem".into(), &self.pem)?;
        for name in names {
            let mut all = vec![*name];
            all.extend_from_slice(sans);
            let issued = self.issue(&all, false)?;
            write(format!("{name}.pem"), &issued.cert_pem)?;
            write(format!("{name}-key.pem"), &issued.key_pem)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn internal_servers_insist_on_a_ca_and_clients_use_https() {
        let dir = tempfile::tempdir().unwrap();
        let ca = DevCa::new("test CA").unwrap();
        ca.write(dir.path(), &["verifier"], &["localhost"]).unwrap();
        let mut args = TlsArgs {
            tls_cert: Some(dir.path().join("verifier.pem")),
            tls_key: Some(dir.path().join("verifier-key.pem")),
            tls_ca: None,
        };
        assert!(args.server(true).unwrap_err().contains("--tls-ca"));
        assert!(args.server(false).unwrap().is_some());
        args.tls_ca = Some(dir.path().join("ca.pem"));
        assert!(args.server(true).unwrap().is_some());
        assert!(args.client("verifier").unwrap().is_some());
        assert_eq!(args.scheme(), "https");
        assert_eq!(TlsArgs::default().scheme(), "http");
        assert!(TlsArgs::default().server(true).unwrap().is_none());
        let missing = TlsArgs {
            tls_cert: Some("/no/such.pem".into()),
            tls_key: Some("/no/such-key.pem".into()),
            tls_ca: None,
        };
        assert!(missing.server(false).unwrap_err().contains("/no/such.pem"));
    }
}
