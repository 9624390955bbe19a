//! Client authentication for the public API: API keys sent as `authorization: Bearer KEY`,
//! checked by a tonic interceptor (a tower layer in front of the Orchestrator service).
//! Keys are kept hashed (SHA-256) in a file, compared in constant time, and re-read when the
//! file changes, so adding or revoking a key needs no restart. Each key has its own limits:
//! requests at once and tokens per minute (prompt + completion), answered with
//! ResourceExhausted and a retry hint; sessions belong to the key that created them.
//!
//! Key file, one key per line (`#` starts a comment):
//!
//! ```text
//! # id   sha256 of the key, 64 hex digits (`specd hash-key`)   limits (optional)
//! alice  <sha256 hex>   max_concurrent=4 tokens_per_minute=20000
//! ```

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tonic::Status;

/// Limits of one key.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct KeyLimits {
    pub max_concurrent: usize,
    pub tokens_per_minute: f64,
}

impl Default for KeyLimits {
    fn default() -> Self {
        Self {
            max_concurrent: 16,
            tokens_per_minute: 100_000.0,
        }
    }
}

/// SHA-256 of a key, hex: what the key file stores.
pub fn hash_key(key: &str) -> String {
    Sha256::digest(key.as_bytes())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

#[derive(Debug)]
struct KeyEntry {
    id: String,
    hash: [u8; 32],
    limits: KeyLimits,
}

fn parse_hex32(text: &str) -> Option<[u8; 32]> {
    if text.len() != 64 {
        return None;
    }
    let mut out = [0u8; 32];
    for (i, byte) in out.iter_mut().enumerate() {
        *byte = u8::from_str_radix(text.get(2 * i..2 * i + 2)?, 16).ok()?;
    }
    Some(out)
}

/// Parses a key file; errors name the line.
fn parse_keys(text: &str) -> Result<Vec<KeyEntry>, String> {
    let mut keys = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.split('#').next().unwrap_or("").trim();
        if line.is_empty() {
            continue;
        }
        let mut fields = line.split_whitespace();
        let id = fields.next().unwrap_or_default().to_string();
        let hash = fields
            .next()
            .and_then(parse_hex32)
            .ok_or_else(|| format!("line {}: expected `id sha256-hex [limits]`", n + 1))?;
        let mut limits = KeyLimits::default();
        for field in fields {
            let (name, value) = field
                .split_once('=')
                .ok_or_else(|| format!("line {}: bad limit {field:?}", n + 1))?;
            let bad = || format!("line {}: bad value in {field:?}", n + 1);
            match name {
                "max_concurrent" => limits.max_concurrent = value.parse().map_err(|_| bad())?,
                "tokens_per_minute" => limits.tokens_per_minute = value.parse().map_err(|_| bad())?,
                _ => return Err(format!("line {}: unknown limit {name:?}", n + 1)),
            }
        }
        if keys.iter().any(|k: &KeyEntry| k.id == id) {
            return Err(format!("line {}: key id {id:?} appears twice", n + 1));
        }
        keys.push(KeyEntry { id, hash, limits });
    }
    Ok(keys)
}

/// Per-key usage: requests in flight and a token bucket refilled per minute.
struct Usage {
    limits: KeyLimits,
    concurrent: Arc<Semaphore>,
    bucket: Mutex<(f64, Instant)>,
}

impl Usage {
    fn new(limits: KeyLimits) -> Self {
        Self {
            limits,
            concurrent: Arc::new(Semaphore::new(limits.max_concurrent.max(1))),
            bucket: Mutex::new((limits.tokens_per_minute, Instant::now())),
        }
    }

    /// Tokens available now (may be negative after a large request).
    fn balance(&self) -> f64 {
        let mut bucket = self.bucket.lock().unwrap_or_else(|e| e.into_inner());
        let rate = self.limits.tokens_per_minute / 60.0;
        bucket.0 = (bucket.0 + bucket.1.elapsed().as_secs_f64() * rate).min(self.limits.tokens_per_minute);
        bucket.1 = Instant::now();
        bucket.0
    }

    fn spend(&self, tokens: f64) {
        self.balance();
        self.bucket.lock().unwrap_or_else(|e| e.into_inner()).0 -= tokens;
    }
}

/// The authenticated caller of one request, with its admission held.
pub struct Caller {
    pub key_id: String,
    usage: Arc<Usage>,
    _permit: OwnedSemaphorePermit,
}

impl Caller {
    /// Charges the request's tokens to the key's per-minute budget.
    pub fn charge(&self, tokens: u64) {
        self.usage.spend(tokens as f64);
    }
}

/// The key file, re-read when it changes, and every key's usage.
pub struct KeyStore {
    path: PathBuf,
    state: Mutex<KeyState>,
}

struct KeyState {
    keys: Vec<KeyEntry>,
    modified: Option<SystemTime>,
    checked: Instant,
    usage: HashMap<String, Arc<Usage>>,
}

/// How often the key file's modification time is looked at.
const RELOAD_CHECK: Duration = Duration::from_millis(500);

impl KeyStore {
    /// Loads `path`; an unreadable or malformed file is an error at start-up.
    pub fn open(path: &Path) -> Result<Self, String> {
        let (keys, modified) = read_keys(path)?;
        tracing::info!(path = %path.display(), keys = keys.len(), "API keys loaded");
        Ok(Self {
            path: path.to_path_buf(),
            state: Mutex::new(KeyState {
                keys,
                modified,
                checked: Instant::now(),
                usage: HashMap::new(),
            }),
        })
    }

    fn reload_if_changed(&self, state: &mut KeyState) {
        if state.checked.elapsed() < RELOAD_CHECK {
            return;
        }
        state.checked = Instant::now();
        let modified = std::fs::metadata(&self.path).and_then(|m| m.modified()).ok();
        if modified == state.modified {
            return;
        }
        match read_keys(&self.path) {
            Ok((keys, modified)) => {
                tracing::info!(keys = keys.len(), "API keys reloaded");
                state.keys = keys;
                state.modified = modified;
            }
            // Keep serving with the keys we have; say why the new file was refused.
            Err(error) => tracing::error!(%error, "API key file not reloaded"),
        }
    }

    /// Checks a presented key and admits one request for it.
    pub fn admit(&self, presented: Option<&str>) -> Result<Caller, Status> {
        let presented = presented
            .ok_or_else(|| Status::unauthenticated("missing API key: send `authorization: Bearer <key>`"))?;
        let digest: [u8; 32] = Sha256::digest(presented.as_bytes()).into();
        let mut state = self.state.lock().unwrap_or_else(|e| e.into_inner());
        self.reload_if_changed(&mut state);
        // Compare against every key, in constant time each, so timing says nothing.
        let mut found: Option<usize> = None;
        for (i, key) in state.keys.iter().enumerate() {
            if bool::from(key.hash.ct_eq(&digest)) {
                found = Some(i);
            }
        }
        let key = found
            .map(|i| &state.keys[i])
            .ok_or_else(|| Status::unauthenticated("invalid API key"))?;
        let (id, limits) = (key.id.clone(), key.limits);
        let usage = state
            .usage
            .entry(id.clone())
            .and_modify(|u| {
                if u.limits != limits {
                    *u = Arc::new(Usage::new(limits));
                }
            })
            .or_insert_with(|| Arc::new(Usage::new(limits)))
            .clone();
        drop(state);
        let permit = usage.concurrent.clone().try_acquire_owned().map_err(|_| {
            exhausted(
                format!(
                    "key {id:?} already has {} requests in flight",
                    limits.max_concurrent
                ),
                Duration::from_secs(1),
            )
        })?;
        let balance = usage.balance();
        if balance <= 0.0 {
            let wait = Duration::from_secs_f64((1.0 - balance) / (limits.tokens_per_minute / 60.0).max(1e-9));
            return Err(exhausted(
                format!(
                    "key {id:?} used its {} tokens per minute",
                    limits.tokens_per_minute
                ),
                wait,
            ));
        }
        Ok(Caller {
            key_id: id,
            usage,
            _permit: permit,
        })
    }
}

fn read_keys(path: &Path) -> Result<(Vec<KeyEntry>, Option<SystemTime>), String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("cannot read API keys {}: {e}", path.display()))?;
    let keys = parse_keys(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    let modified = std::fs::metadata(path).and_then(|m| m.modified()).ok();
    Ok((keys, modified))
}

/// ResourceExhausted with a retry hint in the message and in `retry-after-ms` metadata.
fn exhausted(message: String, retry_after: Duration) -> Status {
    let ms = retry_after.as_millis().max(1);
    let mut status = Status::resource_exhausted(format!("{message}; retry in {ms} ms"));
    if let Ok(value) = ms.to_string().parse() {
        status.metadata_mut().insert("retry-after-ms", value);
    }
    status
}

/// The interceptor that authenticates every call to the Orchestrator service and leaves
/// the [`Caller`] in the request's extensions.
#[derive(Clone)]
pub struct ApiKeyAuth {
    pub store: Arc<KeyStore>,
}

impl tonic::service::Interceptor for ApiKeyAuth {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, Status> {
        let caller = self.store.admit(bearer(request.metadata()))?;
        request.extensions_mut().insert(Arc::new(caller));
        Ok(request)
    }
}

/// The bearer token of a request, if any.
pub fn bearer(metadata: &tonic::metadata::MetadataMap) -> Option<&str> {
    metadata
        .get("authorization")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer ").or_else(|| v.strip_prefix("bearer ")))
        .map(str::trim)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn store(text: &str) -> (tempfile::NamedTempFile, KeyStore) {
        let file = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(file.path(), text).unwrap();
        let store = KeyStore::open(file.path()).unwrap();
        (file, store)
    }

    #[test]
    fn keys_are_checked_by_hash() {
        let (_f, store) = store(&format!(
            "alice {}\nbob {}\n",
            hash_key("a-secret"),
            hash_key("b-secret")
        ));
        assert_eq!(store.admit(Some("a-secret")).unwrap().key_id, "alice");
        assert_eq!(store.admit(Some("b-secret")).unwrap().key_id, "bob");
        let wrong = store.admit(Some("c-secret")).err().unwrap();
        assert_eq!(wrong.code(), tonic::Code::Unauthenticated);
        let missing = store.admit(None).err().unwrap();
        assert_eq!(missing.code(), tonic::Code::Unauthenticated);
        assert!(missing.message().contains("Bearer"));
    }

    #[test]
    fn malformed_files_name_the_line() {
        assert!(parse_keys("alice nothex").unwrap_err().contains("line 1"));
        let h = hash_key("k");
        assert!(
            parse_keys(&format!("# c\n\na {h} max_concurrent=x"))
                .unwrap_err()
                .contains("line 3")
        );
        assert!(
            parse_keys(&format!("a {h} colour=red"))
                .unwrap_err()
                .contains("unknown limit")
        );
        assert!(
            parse_keys(&format!("a {h}\na {h}"))
                .unwrap_err()
                .contains("twice")
        );
        let keys = parse_keys(&format!("a {h} max_concurrent=2 tokens_per_minute=60 # note")).unwrap();
        assert_eq!(
            keys[0].limits,
            KeyLimits {
                max_concurrent: 2,
                tokens_per_minute: 60.0
            }
        );
    }

    #[test]
    fn concurrency_and_token_limits_answer_resource_exhausted_with_a_hint() {
        let (_f, store) = store(&format!(
            "a {} max_concurrent=1 tokens_per_minute=60\n",
            hash_key("k")
        ));
        let first = store.admit(Some("k")).unwrap();
        let busy = store.admit(Some("k")).err().unwrap();
        assert_eq!(busy.code(), tonic::Code::ResourceExhausted);
        assert!(busy.metadata().get("retry-after-ms").is_some());
        first.charge(600);
        drop(first);
        let spent = store.admit(Some("k")).err().unwrap();
        assert_eq!(spent.code(), tonic::Code::ResourceExhausted);
        assert!(spent.message().contains("tokens per minute"), "{spent:?}");
        // 540 tokens over budget at one per second: about nine minutes.
        let hint: u64 = spent
            .metadata()
            .get("retry-after-ms")
            .unwrap()
            .to_str()
            .unwrap()
            .parse()
            .unwrap();
        assert!((500_000..=560_000).contains(&hint), "{hint}");
    }

    #[test]
    fn a_changed_file_adds_and_revokes_keys() {
        let (file, store) = store(&format!("a {}\n", hash_key("old")));
        assert!(store.admit(Some("old")).is_ok());
        std::thread::sleep(Duration::from_millis(20));
        std::fs::write(file.path(), format!("b {}\n", hash_key("new"))).unwrap();
        // Make sure the modification time differs even on coarse clocks.
        let later = SystemTime::now() + Duration::from_secs(5);
        std::fs::File::options()
            .write(true)
            .open(file.path())
            .unwrap()
            .set_modified(later)
            .unwrap();
        std::thread::sleep(RELOAD_CHECK + Duration::from_millis(50));
        assert_eq!(
            store.admit(Some("old")).err().unwrap().code(),
            tonic::Code::Unauthenticated
        );
        assert_eq!(store.admit(Some("new")).unwrap().key_id, "b");
    }

    #[test]
    fn bearer_tokens_are_read_from_metadata() {
        let mut metadata = tonic::metadata::MetadataMap::new();
        assert_eq!(bearer(&metadata), None);
        metadata.insert("authorization", "Bearer  abc ".parse().unwrap());
        assert_eq!(bearer(&metadata), Some("abc"));
    }
}
