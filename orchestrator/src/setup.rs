//! Building a [`Generator`]: all-in-one (the drafter and verifier cores in this process,
//! sharing one loaded model) or against remote services, after checking that every service
//! speaks the same tokenizer.

use std::sync::Arc;
use std::time::{Duration, Instant};

use specd_drafter::{DrafterCore, LmDrafter, NgramConfig};
use specd_model::{LoadedModel, TextModel};
use specd_verifier::VerifierCore;

use crate::adaptive::CostModel;
use crate::backend::{DrafterBackend, GrpcDrafter, GrpcVerifier, VerifierBackend};
use crate::generate::Generator;
use crate::request::Limits;
use crate::session::SessionStore;

/// Settings shared by both ways of building a generator.
#[derive(Debug, Clone)]
pub struct GeneratorSettings {
    pub limits: Limits,
    pub session_ttl: Duration,
    pub max_sessions: usize,
    pub ngram: NgramConfig,
}

impl Default for GeneratorSettings {
    fn default() -> Self {
        Self {
            limits: Limits::default(),
            session_ttl: Duration::from_secs(600),
            max_sessions: 1024,
            ngram: NgramConfig::default(),
        }
    }
}

/// Everything in this process: the verifier core scores with `loaded`'s engine; the drafter
/// offers prompt lookup and an LM drafter on the same engine (its own cache entries).
pub fn in_process(loaded: LoadedModel, settings: GeneratorSettings) -> Generator {
    let verifier: Arc<dyn VerifierBackend> =
        Arc::new(VerifierCore::new(loaded.engine.clone(), "in-process".into()));
    let drafter: Arc<dyn DrafterBackend> = Arc::new(DrafterCore::new(
        settings.ngram,
        Some(LmDrafter::new(loaded.engine.clone())),
    ));
    Generator {
        verifier,
        drafter: Some(drafter),
        text: TextModel {
            tokenizer: loaded.tokenizer,
            chat_template: loaded.chat_template,
            config: loaded.config,
        },
        costs: Arc::new(CostModel::default()),
        sessions: SessionStore::new(settings.session_ttl, settings.max_sessions),
        limits: settings.limits,
    }
}

/// Remote services. Waits up to `ready_timeout` for the verifier to answer `Info`, then
/// refuses to start if its tokenizer (or an LM drafter's) differs from `text`'s.
pub async fn remote(
    text: TextModel,
    verifier_url: &str,
    drafter_url: Option<&str>,
    deadline: Duration,
    ready_timeout: Duration,
    settings: GeneratorSettings,
) -> Result<Generator, String> {
    let verifier = GrpcVerifier::new(verifier_url, deadline)?;
    let ours = text.tokenizer.identity().to_string();
    let started = Instant::now();
    let info = loop {
        match verifier.info().await {
            Ok(info) => break info,
            Err(status) if started.elapsed() < ready_timeout => {
                tracing::info!(
                    url = verifier_url,
                    message = status.message(),
                    "waiting for the verifier"
                );
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            Err(status) => {
                return Err(format!(
                    "verifier {verifier_url} is not answering: {}",
                    status.message()
                ));
            }
        }
    };
    check_identity("verifier", verifier_url, info.model.as_ref(), &ours)?;
    let drafter: Option<Arc<dyn DrafterBackend>> = match drafter_url {
        None => None,
        Some(url) => {
            let drafter = GrpcDrafter::new(url, deadline)?;
            match drafter.info().await {
                Ok(info) => {
                    if info.model.is_some() {
                        check_identity("drafter", url, info.model.as_ref(), &ours)?;
                    }
                }
                // Speculation is optional: a drafter that is down now may come back.
                Err(status) => {
                    tracing::warn!(url, message = status.message(), "drafter not answering yet")
                }
            }
            Some(Arc::new(drafter))
        }
    };
    Ok(Generator {
        verifier: Arc::new(verifier),
        drafter,
        text,
        costs: Arc::new(CostModel::default()),
        sessions: SessionStore::new(settings.session_ttl, settings.max_sessions),
        limits: settings.limits,
    })
}

fn check_identity(
    role: &str,
    url: &str,
    model: Option<&specd_proto::v1::ModelIdentity>,
    ours: &str,
) -> Result<(), String> {
    let model = model.ok_or_else(|| format!("{role} {url} did not report its model"))?;
    if model.tokenizer_identity != ours {
        return Err(format!(
            "{role} {url} runs `{}` whose tokenizer ({}) differs from the orchestrator's ({ours}); \
             drafts and scores would be meaningless. Point both at models with the same tokenizer.",
            model.name, model.tokenizer_identity
        ));
    }
    Ok(())
}
