//! The engine's per-sequence KV caches under a memory bound, least recently used evicted
//! first. A cache is an optimisation only: an evicted sequence is recomputed on its next use.
//! A sequence may also start from a copy of another's cache when their contexts share a
//! prefix (a system prompt, a repeated document): see [`CacheStore::longest_shared_prefix`].

use std::collections::HashMap;

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
    pub fn longest_shared_prefix(&self, context: &[u32], limit: usize) -> Option<(&KvCache, usize)> {
        let context = &context[..limit.min(context.len())];
        self.caches
            .values()
            .map(|(cache, _)| (cache, cache.common_prefix_len(context)))
            .filter(|&(_, shared)| shared > 0)
            .max_by_key(|&(_, shared)| shared)
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
