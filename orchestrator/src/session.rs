//! Sessions: the orchestrator is the owner of every conversation's token context (services
//! only cache it). Sessions expire after a TTL of inactivity and are bounded in number; a
//! session serves one request at a time.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use specd_model::ChatMessage;
use tokio::sync::OwnedMutexGuard;

use crate::adaptive::KPolicy;
use crate::error::OrchestratorError;

/// A conversation's state.
#[derive(Debug, Default)]
pub struct Session {
    pub id: String,
    /// Every token so far: prompts, generated tokens and end markers.
    pub context: Vec<u32>,
    /// Chat history, when the session was started with chat messages.
    pub messages: Vec<ChatMessage>,
    pub policy: KPolicy,
}

struct Entry {
    session: Arc<tokio::sync::Mutex<Session>>,
    last_used: Instant,
    /// The API key that created the session (None without authentication).
    owner: Option<String>,
}

pub struct SessionStore {
    entries: Mutex<HashMap<String, Entry>>,
    ttl: Duration,
    max_sessions: usize,
}

/// A session held exclusively for one request.
pub type SessionGuard = OwnedMutexGuard<Session>;

impl SessionStore {
    pub fn new(ttl: Duration, max_sessions: usize) -> Self {
        Self {
            entries: Mutex::new(HashMap::new()),
            ttl,
            max_sessions,
        }
    }

    /// Opens a new session owned by `owner`, or fails with ResourceExhausted when the store
    /// is full.
    pub fn create(&self, owner: Option<&str>) -> Result<SessionGuard, OrchestratorError> {
        let mut entries = self.entries.lock().expect("session lock");
        self.sweep(&mut entries);
        if entries.len() >= self.max_sessions {
            return Err(OrchestratorError::ResourceExhausted(format!(
                "too many open sessions ({}); retry later",
                self.max_sessions
            )));
        }
        let id = uuid::Uuid::new_v4().to_string();
        let session = Arc::new(tokio::sync::Mutex::new(Session {
            id: id.clone(),
            ..Session::default()
        }));
        let guard = session.clone().try_lock_owned().expect("a new session is free");
        entries.insert(
            id,
            Entry {
                session,
                last_used: Instant::now(),
                owner: owner.map(str::to_string),
            },
        );
        Ok(guard)
    }

    /// Takes an existing session for one request. Another owner's session is NotFound, as
    /// if it did not exist.
    pub fn acquire(&self, id: &str, owner: Option<&str>) -> Result<SessionGuard, OrchestratorError> {
        let mut entries = self.entries.lock().expect("session lock");
        self.sweep(&mut entries);
        let entry = entries
            .get_mut(id)
            .filter(|e| e.owner.as_deref() == owner)
            .ok_or_else(|| OrchestratorError::SessionNotFound(id.to_string()))?;
        entry.last_used = Instant::now();
        entry
            .session
            .clone()
            .try_lock_owned()
            .map_err(|_| OrchestratorError::SessionBusy(id.to_string()))
    }

    /// Marks a session used now (call when a request on it finishes).
    pub fn touch(&self, id: &str) {
        if let Some(entry) = self.entries.lock().expect("session lock").get_mut(id) {
            entry.last_used = Instant::now();
        }
    }

    pub fn remove(&self, id: &str) {
        self.entries.lock().expect("session lock").remove(id);
    }

    pub fn len(&self) -> usize {
        self.entries.lock().expect("session lock").len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops idle sessions past their TTL (never one in use).
    fn sweep(&self, entries: &mut HashMap<String, Entry>) {
        let now = Instant::now();
        entries
            .retain(|_, e| now.duration_since(e.last_used) < self.ttl || Arc::strong_count(&e.session) > 1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sessions_are_created_found_and_exclusive() {
        let store = SessionStore::new(Duration::from_secs(60), 10);
        let guard = store.create(None).unwrap();
        let id = guard.id.clone();
        assert!(matches!(
            store.acquire(&id, None),
            Err(OrchestratorError::SessionBusy(_))
        ));
        drop(guard);
        assert_eq!(store.acquire(&id, None).unwrap().id, id);
        assert!(matches!(
            store.acquire("nope", None),
            Err(OrchestratorError::SessionNotFound(_))
        ));
    }

    #[test]
    fn sessions_belong_to_the_key_that_created_them() {
        let store = SessionStore::new(Duration::from_secs(60), 10);
        let id = store.create(Some("alice")).unwrap().id.clone();
        for other in [Some("bob"), None] {
            assert!(matches!(
                store.acquire(&id, other),
                Err(OrchestratorError::SessionNotFound(_))
            ));
        }
        assert_eq!(store.acquire(&id, Some("alice")).unwrap().id, id);
    }

    #[test]
    fn the_store_is_bounded() {
        let store = SessionStore::new(Duration::from_secs(60), 2);
        let _a = store.create(None).unwrap();
        let _b = store.create(None).unwrap();
        assert!(matches!(
            store.create(None),
            Err(OrchestratorError::ResourceExhausted(_))
        ));
    }

    #[test]
    fn idle_sessions_expire_but_busy_ones_stay() {
        let store = SessionStore::new(Duration::from_millis(20), 10);
        let idle = store.create(None).unwrap().id.clone();
        let busy = store.create(None).unwrap();
        std::thread::sleep(Duration::from_millis(40));
        assert!(matches!(
            store.acquire(&idle, None),
            Err(OrchestratorError::SessionNotFound(_))
        ));
        assert_eq!(store.len(), 1);
        drop(busy);
    }
}
