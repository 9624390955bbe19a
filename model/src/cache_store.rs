//! The engine's per-sequence KV caches under a memory bound, least recently used evicted
//! first. A cache is an optimisation only: an evicted sequence is recomputed on its next use.
//! A sequence may also start from a copy of another's cache when their contexts share a
//! prefix (a system prompt, a repeated document): see [`CacheStore::shared_prefix_copy`].

use std::collections::HashMap;

use crate::error::Result;
use crate::kv_cache::KvCache;

pub struct CacheStore {
    caches: HashMap<String, (KvCache, u64)>,
    max_bytes: usize,
    clock: u64,
    evictions: u64,
}

impl CacheStore {
    pub fn new(max_bytes: usize) -> Self {
        Self {
            caches: HashMap::new(),
            max_bytes,
            clock: 0,
            evictions: 0,
        }
    }

    /// Takes a sequence's cache out of the store (to run it), if there is one.
    pub fn take(&mut self, sequence: &str) -> Option<KvCache> {
        self.caches.remove(sequence).map(|(cache, _)| cache)
    }

    /// Puts a cache back as most recently used.
    pub fn put(&mut self, sequence: String, cache: KvCache) {
        self.clock += 1;
        self.caches.insert(sequence, (cache, self.clock));
    }

    /// The cached sequence sharing the longest prefix with `context` (counting at most
    /// `limit` tokens), and that length; `None` when no cache shares a token. A scan of the
    /// caches, each compared only up to its first differing token.
    fn longest_shared_prefix(&self, context: &[u32], limit: usize) -> Option<(&KvCache, usize)> {
        let context = &context[..limit.min(context.len())];
        self.caches
            .values()
            .map(|(cache, _)| (cache, cache.common_prefix_len(context)))
            .filter(|&(_, shared)| shared > 0)
            .max_by_key(|&(_, shared)| shared)
    }

    /// A copy of the prefix another cached sequence shares with `context` (counting at most
    /// `limit` tokens) and its length, where copying it beats computing the positions past
    /// `own` (those the sequence's own cache holds); `None` where no copy pays. Not looked
    /// for when no copy could (a decode step's usual hit).
    pub fn shared_prefix_copy(
        &self,
        context: &[u32],
        limit: usize,
        own: usize,
    ) -> Result<Option<(KvCache, usize)>> {
        if !worth_copying(limit, own) {
            return Ok(None);
        }
        match self.longest_shared_prefix(context, limit) {
            Some((donor, shared)) if worth_copying(shared, own) => {
                Ok(Some((donor.prefix_copy(shared)?, shared)))
            }
            _ => Ok(None),
        }
    }

    pub fn remove(&mut self, sequence: &str) -> bool {
        self.caches.remove(sequence).is_some()
    }

    pub fn bytes(&self) -> usize {
        self.caches.values().map(|(c, _)| c.allocated_bytes()).sum()
    }

    pub fn len(&self) -> usize {
        self.caches.len()
    }

    pub fn is_empty(&self) -> bool {
        self.caches.is_empty()
    }

    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    /// Evicts least recently used caches until the store fits its bound. The most recently
    /// used cache always stays, even if it alone is over the bound.
    pub fn enforce_bound(&mut self) {
        while self.caches.len() > 1 && self.bytes() > self.max_bytes {
            let oldest = self
                .caches
                .iter()
                .min_by_key(|(_, (_, used))| *used)
                .map(|(k, _)| k.clone())
                .expect("non-empty");
            self.caches.remove(&oldest);
            self.evictions += 1;
        }
    }
}

/// Whether copying `shared` positions of another sequence's cache beats computing the
/// `shared - own` positions this sequence's own cache lacks. Copying a position moves its
/// keys and values (23 KB for SmolLM2-135M); computing one runs the whole model over it,
/// about a hundred times as long, so a copy pays when it saves a 32nd of what it moves (and
/// a few tokens at least).
fn worth_copying(shared: usize, own: usize) -> bool {
    const MIN_SAVED: usize = 4;
    let saved = shared.saturating_sub(own);
    saved >= MIN_SAVED && saved * 32 >= shared
}

#[cfg(test)]
mod tests {
    use super::worth_copying;

    #[test]
    fn a_short_shared_prefix_is_computed_rather_than_copied() {
        assert!(worth_copying(100, 0));
        assert!(!worth_copying(3, 0), "a few tokens are not worth a copy");
        assert!(!worth_copying(1000, 990), "copying 1000 positions to save 10");
        assert!(worth_copying(1000, 960));
    }
}
