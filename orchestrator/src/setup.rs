//! Building a [`Generator`]: all-in-one (the drafter and verifier cores in this process,
//! sharing one loaded model) or against remote services (a verifier pool and a drafter behind
//! a breaker), after checking that every service speaks the same tokenizer.

use std::sync::Arc;
use std::time::Duration;

use specd_drafter::{DrafterCore, LmDrafter, NgramConfig};
use specd_model::{LoadedModel, TextModel};
use specd_verifier::VerifierCore;

use crate::backend::{DrafterBackend, GrpcDrafter, NgramInProcess, VerifierBackend, check_identity};
use crate::breaker::BreakerConfig;
use crate::generate::Generator;
use crate::pool::{PoolConfig, VerifierPool};
use crate::request::Limits;

/// Settings shared by both ways of building a generator.
#[derive(Debug, Clone)]
pub struct GeneratorSettings {
    pub limits: Limits,
    pub session_ttl: Duration,
    pub max_sessions: usize,
    pub ngram: NgramConfig,
    /// Most requests served at once; more are refused with ResourceExhausted.
    pub max_concurrent_requests: usize,
}

impl Default for GeneratorSettings {
    fn default() -> Self {
        Self {
            limits: Limits::default(),
            session_ttl: Duration::from_secs(600),
            max_sessions: 1024,
            ngram: NgramConfig::default(),
            max_concurrent_requests: 256,
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
    let text = TextModel {
        tokenizer: loaded.tokenizer,
        chat_template: loaded.chat_template,
        config: loaded.config,
    };
    Generator::new(verifier, Some(drafter), text, settings)
}

/// How to reach remote services.
#[derive(Debug, Clone)]
pub struct RemoteSettings {
    pub pool: PoolConfig,
    pub drafter_url: Option<String>,
    pub drafter_breaker: BreakerConfig,
    /// How long to wait at start-up for a verifier replica to be ready.
    pub ready_timeout: Duration,
    /// Answer prompt-lookup drafts in this process (see [`NgramInProcess`]).
    pub ngram_in_process: bool,
}

/// Remote services: a verifier pool and optionally a drafter. Waits up to `ready_timeout`
/// for a verifier replica to be ready; refuses to start if every replica's tokenizer (or an
/// LM drafter's) differs from `text`'s.
pub async fn remote(
    text: TextModel,
    mut remote: RemoteSettings,
    settings: GeneratorSettings,
) -> Result<Generator, String> {
    let ours = text.tokenizer.identity().to_string();
    remote.pool.tokenizer_identity = ours.clone();
    let pool = VerifierPool::start(remote.pool.clone()).await?;
    pool.wait_ready(remote.ready_timeout).await?;
    let drafter: Option<Arc<dyn DrafterBackend>> = match remote.drafter_url.as_deref() {
        None => None,
        Some(url) => {
            let tls = remote.pool.tls.client(crate::backend::host_of(url))?;
            let drafter = GrpcDrafter::new(url, remote.pool.deadline, remote.drafter_breaker, tls)?;
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
    let drafter: Option<Arc<dyn DrafterBackend>> = if remote.ngram_in_process {
        Some(Arc::new(NgramInProcess::new(settings.ngram, drafter)))
    } else {
        drafter
    };
    let mut generator = Generator::new(pool.clone(), drafter, text, settings);
    generator.pool = Some(pool);
    Ok(generator)
}
