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

    /// Opens a new session, or fails with ResourceExhausted when the store is full.
    pub fn create(&self) -> Result<SessionGuard, OrchestratorError> {
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
            },
        );
        Ok(guard)
    }

    /// Takes an existing session for one request.
    pub fn acquire(&self, id: &str) -> Result<SessionGuard, OrchestratorError> {
        let mut entries = self.entries.lock().expect("session lock");
        self.sweep(&mut entries);
        let entry = entries
            .get_mut(id)
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
        let guard = store.create().unwrap();
        let id = guard.id.clone();
        assert!(matches!(
            store.acquire(&id),
            Err(OrchestratorError::SessionBusy(_))
        ));
        drop(guard);
        assert_eq!(store.acquire(&id).unwrap().id, id);
        assert!(matches!(
            store.acquire("nope"),
            Err(OrchestratorError::SessionNotFound(_))
        ));
    }

    #[test]
    fn the_store_is_bounded() {
        let store = SessionStore::new(Duration::from_secs(60), 2);
        let _a = store.create().unwrap();
        let _b = store.create().unwrap();
        assert!(matches!(
            store.create(),
            Err(OrchestratorError::ResourceExhausted(_))
        ));
    }

    #[test]
    fn idle_sessions_expire_but_busy_ones_stay() {
        let store = SessionStore::new(Duration::from_millis(20), 10);
        let idle = store.create().unwrap().id.clone();
        let busy = store.create().unwrap();
        std::thread::sleep(Duration::from_millis(40));
        assert!(matches!(
            store.acquire(&idle),
            Err(OrchestratorError::SessionNotFound(_))
        ));
        assert_eq!(store.len(), 1);
        drop(busy);
    }
}
