//! A per-sequence KV cache that lives outside the model: it grows on demand, can be truncated
//! to any length (rollback after a rejected draft) and records the tokens it holds, so a
//! caller can reuse the longest common prefix of a new context.

use candle_core::{DType, Device, Tensor};

use crate::config::LlamaConfig;
use crate::error::{ModelError, Result};

/// Initial capacity in tokens; doubled as needed up to the model's context length.
const INITIAL_CAPACITY: usize = 128;

/// Keys and values of one layer, `[n_head_kv, capacity, head_dim]`, valid up to `len`.
struct LayerCache {
    keys: Tensor,
    values: Tensor,
}

/// The cache of one sequence for all layers.
pub struct KvCache {
    layers: Vec<LayerCache>,
    /// Tokens whose keys/values are stored, in order.
    tokens: Vec<u32>,
    capacity: usize,
    max_len: usize,
    n_head_kv: usize,
    head_dim: usize,
    device: Device,
}

impl KvCache {
    pub fn new(cfg: &LlamaConfig, device: &Device) -> Result<Self> {
        let capacity = INITIAL_CAPACITY.min(cfg.context_length).max(1);
        let mut cache = Self {
            layers: Vec::with_capacity(cfg.n_layer),
            tokens: Vec::new(),
            capacity,
            max_len: cfg.context_length,
            n_head_kv: cfg.n_head_kv,
            head_dim: cfg.head_dim,
            device: device.clone(),
        };
        for _ in 0..cfg.n_layer {
            cache.layers.push(cache.empty_layer(capacity)?);
        }
        Ok(cache)
    }

    fn empty_layer(&self, capacity: usize) -> Result<LayerCache> {
        let shape = (self.n_head_kv, capacity, self.head_dim);
        Ok(LayerCache {
            keys: Tensor::zeros(shape, DType::F32, &self.device)?,
            values: Tensor::zeros(shape, DType::F32, &self.device)?,
        })
    }

    /// Number of cached positions.
    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tokens.is_empty()
    }

    /// The tokens whose keys and values are cached.
    pub fn tokens(&self) -> &[u32] {
        &self.tokens
    }

    /// Bytes held by this cache (allocated capacity, not just the used part).
    pub fn allocated_bytes(&self) -> usize {
        2 * self.layers.len() * self.n_head_kv * self.capacity * self.head_dim * 4
    }

    /// Drops every position from `len` on. Truncating to a longer length is a no-op.
    pub fn truncate(&mut self, len: usize) {
        self.tokens.truncate(len);
    }

    /// Length of the common prefix of the cached tokens and `context`.
    pub fn common_prefix_len(&self, context: &[u32]) -> usize {
        self.tokens
            .iter()
            .zip(context)
            .take_while(|(a, b)| a == b)
            .count()
    }

    /// Makes room for `extra` more positions, growing the buffers if needed.
    pub(crate) fn reserve(&mut self, extra: usize) -> Result<()> {
        let needed = self.len() + extra;
        if needed > self.max_len {
            return Err(ModelError::ContextOverflow {
                requested: needed,
                limit: self.max_len,
            });
        }
        if needed <= self.capacity {
            return Ok(());
        }
        let mut capacity = self.capacity;
        while capacity < needed {
            capacity *= 2;
        }
        let capacity = capacity.min(self.max_len);
        let len = self.len();
        for index in 0..self.layers.len() {
            let grown = self.empty_layer(capacity)?;
            if len > 0 {
                let old = &self.layers[index];
                grown
                    .keys
                    .slice_set(&old.keys.narrow(1, 0, len)?.contiguous()?, 1, 0)?;
                grown
                    .values
                    .slice_set(&old.values.narrow(1, 0, len)?.contiguous()?, 1, 0)?;
            }
            self.layers[index] = grown;
        }
        self.capacity = capacity;
        Ok(())
    }

    /// Writes keys/values `[n_head_kv, n, head_dim]` of layer `layer` at positions
    /// `start..start + n` and returns views of all valid keys and values up to `start + n`.
    /// `reserve` must have been called for the new positions.
    pub(crate) fn write_layer(
        &self,
        layer: usize,
        start: usize,
        keys: &Tensor,
        values: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let cache = &self.layers[layer];
        let n = keys.dim(1)?;
        cache.keys.slice_set(&keys.contiguous()?, 1, start)?;
        cache.values.slice_set(&values.contiguous()?, 1, start)?;
        Ok((
            cache.keys.narrow(1, 0, start + n)?,
            cache.values.narrow(1, 0, start + n)?,
        ))
    }

    /// Records that `tokens` were appended (after every layer was written).
    pub(crate) fn commit(&mut self, tokens: &[u32]) {
        self.tokens.extend_from_slice(tokens);
    }
}
