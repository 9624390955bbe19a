//! A per-sequence KV cache that lives outside the model: it grows on demand, can be truncated
//! to any length (rollback after a rejected draft) and records the tokens it holds, so a
//! caller can reuse the longest common prefix of a new context.
//!
//! On the CPU keys and values are plain f16 buffers (as llama.cpp's default cache; attention
//! is bound by reading them, and f16 halves that) read directly by [`crate::attention`]:
//! values `[position][kv_head][head_dim]`, keys the same or, for the AVX-512 and AVX2 attention,
//! in tiles of [`KEY_TILE`] positions `[tile][kv_head][head_dim][position in tile]` (see
//! [`KeyLayout`]); on other devices they are candle tensors `[kv_head, capacity, head_dim]`
//! grown by doubling.

use candle_core::{DType, Device, Tensor};
use half::f16;
use half::slice::HalfFloatSliceExt;

use crate::config::LlamaConfig;
use crate::error::{ModelError, Result};

/// Initial capacity in tokens of device caches; doubled as needed up to the context length.
const INITIAL_CAPACITY: usize = 128;

/// Positions per key tile.
pub const KEY_TILE: usize = 16;

/// How a host cache stores its keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyLayout {
    /// `[position][kv_head][head_dim]`, like the values.
    Positions,
    /// `[tile][kv_head][head_dim][KEY_TILE]`: one 16-value load (two with AVX2) holds one dimension of 16
    /// positions, so scores for 16 positions are plain multiply-adds, with no horizontal
    /// sums. Positions past the cached length in the last tile hold stale values and are
    /// never read as scores (attention masks them).
    Tiles,
}

impl KeyLayout {
    /// The layout the detected attention kernel reads best.
    pub fn for_this_cpu(head_dim: usize) -> Self {
        let simd = crate::kernels::Kernel::detect() != crate::kernels::Kernel::Portable;
        if simd && matches!(head_dim, 64 | 128) {
            KeyLayout::Tiles
        } else {
            KeyLayout::Positions
        }
    }
}

/// Keys and values of one layer.
enum LayerCache {
    Host { keys: Vec<f16>, values: Vec<f16> },
    Device { keys: Tensor, values: Tensor },
}

/// The cache of one sequence for all layers.
pub struct KvCache {
    layers: Vec<LayerCache>,
    /// Tokens whose keys/values are stored, in order.
    tokens: Vec<u32>,
    /// Capacity of device tensors, in positions (unused on the host).
    capacity: usize,
    max_len: usize,
    n_head_kv: usize,
    head_dim: usize,
    key_layout: KeyLayout,
    device: Device,
}

impl KvCache {
    /// An empty cache; host keys in the layout this CPU's attention reads best.
    pub fn new(cfg: &LlamaConfig, device: &Device) -> Result<Self> {
        let key_layout = KeyLayout::for_this_cpu(cfg.head_dim);
        let capacity = INITIAL_CAPACITY.min(cfg.context_length).max(1);
        let mut cache = Self {
            layers: Vec::with_capacity(cfg.n_layer),
            tokens: Vec::new(),
            capacity,
            max_len: cfg.context_length,
            n_head_kv: cfg.n_head_kv,
            head_dim: cfg.head_dim,
            key_layout,
            device: device.clone(),
        };
        for _ in 0..cfg.n_layer {
            let layer = cache.empty_layer(capacity)?;
            cache.layers.push(layer);
        }
        Ok(cache)
    }

    fn empty_layer(&self, capacity: usize) -> Result<LayerCache> {
        if self.device.is_cpu() {
            return Ok(LayerCache::Host {
                keys: Vec::new(),
                values: Vec::new(),
            });
        }
        let shape = (self.n_head_kv, capacity, self.head_dim);
        Ok(LayerCache::Device {
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
        let per_position = 2 * self.n_head_kv * self.head_dim * 4;
        self.layers
            .iter()
            .map(|layer| match layer {
                LayerCache::Host { keys, values } => (keys.capacity() + values.capacity()) * 2,
                LayerCache::Device { .. } => self.capacity * per_position,
            })
            .sum()
    }

    /// How host keys are stored.
    pub fn key_layout(&self) -> KeyLayout {
        self.key_layout
    }

    /// Values of host keys holding positions `0..len`.
    fn key_floats(&self, len: usize) -> usize {
        let per_position = self.n_head_kv * self.head_dim;
        match self.key_layout {
            KeyLayout::Positions => len * per_position,
            KeyLayout::Tiles => len.div_ceil(KEY_TILE) * KEY_TILE * per_position,
        }
    }

    /// Drops every position from `len` on. Truncating to a longer length is a no-op.
    pub fn truncate(&mut self, len: usize) {
        self.tokens.truncate(len);
        let floats = self.tokens.len() * self.n_head_kv * self.head_dim;
        let key_floats = self.key_floats(self.tokens.len());
        for layer in &mut self.layers {
            if let LayerCache::Host { keys, values } = layer {
                keys.truncate(key_floats);
                values.truncate(floats);
            }
        }
    }

    /// A new cache holding this one's first `len` positions (at most its length): what a
    /// sequence whose context starts with those tokens would have computed itself, since a
    /// position's keys and values depend only on the tokens up to it and passes are
    /// batch-invariant.
    pub fn prefix_copy(&self, len: usize) -> Result<KvCache> {
        let len = len.min(self.len());
        let floats = len * self.n_head_kv * self.head_dim;
        let key_floats = self.key_floats(len);
        let layers = self
            .layers
            .iter()
            .map(|layer| match layer {
                LayerCache::Host { keys, values } => Ok(LayerCache::Host {
                    keys: keys[..key_floats.min(keys.len())].to_vec(),
                    values: values[..floats].to_vec(),
                }),
                LayerCache::Device { .. } => self.device_layer_from(layer, self.capacity, len),
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(KvCache {
            layers,
            tokens: self.tokens[..len].to_vec(),
            capacity: self.capacity,
            max_len: self.max_len,
            n_head_kv: self.n_head_kv,
            head_dim: self.head_dim,
            key_layout: self.key_layout,
            device: self.device.clone(),
        })
    }

    /// Length of the common prefix of the cached tokens and `context`.
    pub fn common_prefix_len(&self, context: &[u32]) -> usize {
        self.tokens
            .iter()
            .zip(context)
            .take_while(|(a, b)| a == b)
            .count()
    }

    /// Makes room for `extra` more positions, growing device buffers if needed.
    pub(crate) fn reserve(&mut self, extra: usize) -> Result<()> {
        let needed = self.len() + extra;
        if needed > self.max_len {
            return Err(ModelError::ContextOverflow {
                requested: needed,
                limit: self.max_len,
            });
        }
        if self.device.is_cpu() || needed <= self.capacity {
            return Ok(());
        }
        let mut capacity = self.capacity;
        while capacity < needed {
            capacity *= 2;
        }
        let capacity = capacity.min(self.max_len);
        let len = self.len();
        for index in 0..self.layers.len() {
            self.layers[index] = self.device_layer_from(&self.layers[index], capacity, len)?;
        }
        self.capacity = capacity;
        Ok(())
    }

    /// A device layer of `capacity` positions holding the first `len` positions of `layer`.
    fn device_layer_from(&self, layer: &LayerCache, capacity: usize, len: usize) -> Result<LayerCache> {
        let grown = self.empty_layer(capacity)?;
        if let (LayerCache::Device { keys, values }, LayerCache::Device { keys: k, values: v }) =
            (&grown, layer)
            && len > 0
        {
            keys.slice_set(&k.narrow(1, 0, len)?.contiguous()?, 1, 0)?;
            values.slice_set(&v.narrow(1, 0, len)?.contiguous()?, 1, 0)?;
        }
        Ok(grown)
    }

    /// Writes keys and values `[n, n_head_kv * head_dim]` (keys rotated) of layer `layer`
    /// of a host cache at positions `start..start + n`, rounded to f16 (nearest even).
    pub(crate) fn write_host(
        &mut self,
        layer: usize,
        start: usize,
        keys: &[f32],
        values: &[f32],
    ) -> Result<()> {
        let per_position = self.n_head_kv * self.head_dim;
        let floats = start * per_position;
        let n = values.len() / per_position.max(1);
        let key_layout = self.key_layout;
        let key_floats = self.key_floats(start + n);
        match &mut self.layers[layer] {
            LayerCache::Host { keys: k, values: v } => {
                append_f16(v, floats, values);
                match key_layout {
                    KeyLayout::Positions => append_f16(k, floats, keys),
                    KeyLayout::Tiles => {
                        let mut rounded = vec![f16::ZERO; keys.len()];
                        to_f16(keys, &mut rounded);
                        k.resize(key_floats, f16::ZERO);
                        let tile_floats = KEY_TILE * per_position;
                        // A position's keys land in every cache line of its tile, most of them
                        // out of the cache by now: ask for them all at once, so their fetches
                        // overlap rather than each store waiting for its own.
                        for tile in start / KEY_TILE..(start + n).div_ceil(KEY_TILE) {
                            prefetch(&k[tile * tile_floats..][..tile_floats]);
                        }
                        for (i, key) in rounded.chunks_exact(per_position).enumerate() {
                            let p = start + i;
                            let tile = &mut k[(p / KEY_TILE) * tile_floats..][..tile_floats];
                            // Element d = kv_head · head_dim + dim of the position.
                            for (d, &value) in key.iter().enumerate() {
                                tile[d * KEY_TILE + p % KEY_TILE] = value;
                            }
                        }
                    }
                }
                Ok(())
            }
            LayerCache::Device { .. } => {
                Err(ModelError::InvalidRequest("a device cache in a host pass".into()))
            }
        }
    }

    /// Keys and values of layer `layer` of a host cache.
    pub(crate) fn host_layer(&self, layer: usize) -> Result<(&[f16], &[f16])> {
        match &self.layers[layer] {
            LayerCache::Host { keys, values } => Ok((keys, values)),
            LayerCache::Device { .. } => {
                Err(ModelError::InvalidRequest("a device cache in a host pass".into()))
            }
        }
    }

    /// Writes keys `[1, n_head_kv, n, head_dim]` and values `[n, n_head_kv * head_dim]` of
    /// layer `layer` of a device cache at positions `start..start + n` and returns its
    /// storage `[n_head_kv, capacity, head_dim]`. `reserve` must have been called first.
    pub(crate) fn write_device(
        &mut self,
        layer: usize,
        start: usize,
        keys: &Tensor,
        values: &Tensor,
    ) -> Result<(&Tensor, &Tensor)> {
        let n = values.dim(0)?;
        match &mut self.layers[layer] {
            LayerCache::Device { keys: k, values: v } => {
                let keys = keys.squeeze(0)?.contiguous()?;
                let values = values
                    .reshape((n, self.n_head_kv, self.head_dim))?
                    .transpose(0, 1)?
                    .contiguous()?;
                k.slice_set(&keys, 1, start)?;
                v.slice_set(&values, 1, start)?;
                Ok((k, v))
            }
            LayerCache::Host { .. } => {
                Err(ModelError::InvalidRequest("a host cache in a device pass".into()))
            }
        }
    }

    /// Records that `tokens` were appended (after every layer was written).
    pub(crate) fn commit(&mut self, tokens: &[u32]) {
        self.tokens.extend_from_slice(tokens);
    }
}

/// Cuts `buffer` to `len` values and appends `values` rounded to f16 (F16C where the CPU
/// has it; the same rounding without).
fn append_f16(buffer: &mut Vec<f16>, len: usize, values: &[f32]) {
    buffer.truncate(len);
    buffer.resize(len + values.len(), f16::ZERO);
    to_f16(values, &mut buffer[len..]);
}

/// `dst = src` rounded to f16 (to nearest, ties to even), as `half`'s slice conversion,
/// eight values to an F16C instruction where the CPU has it (every kernel but the portable
/// one needs it): `half` converts through temporaries and calls, several times slower for a
/// position's few hundred values.
fn to_f16(src: &[f32], dst: &mut [f16]) {
    assert_eq!(src.len(), dst.len());
    let mut done = 0;
    #[cfg(target_arch = "x86_64")]
    if crate::kernels::Kernel::detect() != crate::kernels::Kernel::Portable {
        // SAFETY: every kernel but the portable one requires F16C (detected); lengths equal.
        done = unsafe { to_f16_f16c(src, dst) };
    }
    dst[done..].convert_from_f32_slice(&src[done..]);
}

/// [`to_f16`] on the multiples of 8 values; returns how many it converted.
///
/// # Safety
/// The CPU must have AVX and F16C; `dst` must be as long as `src`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn to_f16_f16c(src: &[f32], dst: &mut [f16]) -> usize {
    use std::arch::x86_64::*;
    let whole = src.len() / 8 * 8;
    for at in (0..whole).step_by(8) {
        // SAFETY: 8 values at `at` in both (lengths equal, at + 8 <= whole).
        unsafe {
            let rounded = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(_mm256_loadu_ps(src.as_ptr().add(at)));
            _mm_storeu_si128(dst.as_mut_ptr().add(at) as *mut __m128i, rounded);
        }
    }
    whole
}

/// Asks for every cache line of `values` (a hint: never faults, changes nothing).
fn prefetch(values: &[f16]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        const PER_LINE: usize = 64 / std::mem::size_of::<f16>();
        for at in (0..values.len()).step_by(PER_LINE) {
            // SAFETY: a prefetch hint for an address inside the slice (SSE is baseline).
            unsafe { _mm_prefetch::<_MM_HINT_T0>(values.as_ptr().add(at) as *const i8) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = values;
}

#[cfg(test)]
mod tests {
    use half::f16;
    use half::slice::HalfFloatSliceExt;

    #[test]
    fn f16_rounding_is_the_half_crates() {
        // Ties, subnormals, overflow to infinity, signed zeros, and ordinary values, with a
        // tail past the last 8.
        let mut values = vec![
            0.0f32,
            -0.0,
            1.0,
            -1.0,
            65504.0,
            65519.0,
            65520.0,
            -70000.0,
            1e-8,
            -3e-7,
            6.1e-5,
            1.0 + 1.0 / 2048.0,
            1.0 + 3.0 / 2048.0,
            2.0 + 1.0 / 1024.0,
            -(2.0 + 3.0 / 1024.0),
            0.1,
            1e30,
            f32::INFINITY,
        ];
        values.extend((0..1000).map(|i| ((i as f32) * 0.7313).sin() * 10f32.powi(i % 9 - 4)));
        let mut want = vec![f16::ZERO; values.len()];
        want.convert_from_f32_slice(&values);
        let mut got = vec![f16::ZERO; values.len()];
        super::to_f16(&values, &mut got);
        for (i, ((a, b), v)) in got.iter().zip(&want).zip(&values).enumerate() {
            assert_eq!(a.to_bits(), b.to_bits(), "[{i}] {v}: {a} vs {b}");
        }
    }
}
