//! GGUF block formats → the kernels' layout. 4-bit formats become 32-value blocks of
//! `scale · q + min` with 16 bytes of nibbles (low nibbles hold values 0..16); Q8_0 keeps its
//! signed bytes. Scales and minimums are widened to f32 once, here, not per product.

use candle_core::quantized::GgmlDType;

use super::{BLOCK, COL_TILE, Family, Layout, QuantMatrix, read_f16, to_f16, to_f32};

/// Q4_K super-block: 256 values in 8 sub-blocks of 32.
const SUPER: usize = 256;

pub(super) fn repack(dtype: GgmlDType, n: usize, k: usize, data: &[u8]) -> Option<QuantMatrix> {
    let (family, block_values, block_bytes) = match dtype {
        GgmlDType::Q4_0 => (Family::Nibbles, BLOCK, 18),
        GgmlDType::Q4_1 => (Family::Nibbles, BLOCK, 20),
        GgmlDType::Q4K => (Family::Nibbles, SUPER, 144),
        GgmlDType::Q8_0 => (Family::Bytes, BLOCK, 34),
        _ => return None,
    };
    if !k.is_multiple_of(block_values) || data.len() != n * k / block_values * block_bytes {
        return None;
    }
    let blocks = n * k / BLOCK;
    let mut matrix = QuantMatrix {
        family,
        layout: Layout::Rows,
        source: dtype,
        n,
        k,
        scales: Vec::with_capacity(blocks),
        mins: Vec::with_capacity(if family == Family::Nibbles { blocks } else { 0 }),
        quants: Vec::with_capacity(blocks * if family == Family::Nibbles { 16 } else { BLOCK }),
    };
    for block in data.chunks_exact(block_bytes) {
        match dtype {
            GgmlDType::Q4_0 => {
                // value = d · (q − 8): a minimum of −8d (exact in f16).
                let d = read_f16(block, 0);
                matrix.push_nibbles(d, to_f16(-8.0 * to_f32(d)), &block[2..18]);
            }
            GgmlDType::Q4_1 => matrix.push_nibbles(read_f16(block, 0), read_f16(block, 2), &block[4..20]),
            GgmlDType::Q4K => matrix.push_q4k(block),
            _ => {
                matrix.scales.push(read_f16(block, 0));
                matrix.quants.extend_from_slice(&block[2..34]);
            }
        }
    }
    Some(matrix)
}

impl QuantMatrix {
    fn push_nibbles(&mut self, scale: u16, min: u16, quants: &[u8]) {
        self.scales.push(scale);
        self.mins.push(min);
        self.quants.extend_from_slice(quants);
    }

    /// One Q4_K super-block: f16 d and dmin, 12 bytes of 6-bit sub-block scales and minimums,
    /// then 128 bytes where each 32 bytes hold two sub-blocks (low nibbles, then high).
    /// Sub-block j's values are `d · sc_j · q − dmin · m_j`; `d · sc_j` and `dmin · m_j` are
    /// rounded to f16 (a relative error of at most 2⁻¹¹ per sub-block, far below the 4-bit
    /// quantisation's own).
    fn push_q4k(&mut self, block: &[u8]) {
        let (d, dmin) = (to_f32(read_f16(block, 0)), to_f32(read_f16(block, 2)));
        let packed_scales = &block[4..16];
        let qs = &block[16..144];
        for j in 0..SUPER / BLOCK {
            let (sc, m) = q4k_scale_min(j, packed_scales);
            let source = &qs[(j / 2) * 32..(j / 2) * 32 + 32];
            let shift = if j % 2 == 0 { 0 } else { 4 };
            let value = |i: usize| (source[i] >> shift) & 0x0F;
            let mut nibbles = [0u8; 16];
            for (i, byte) in nibbles.iter_mut().enumerate() {
                *byte = value(i) | (value(i + 16) << 4);
            }
            self.push_nibbles(to_f16(d * f32::from(sc)), to_f16(-dmin * f32::from(m)), &nibbles);
        }
    }
}

/// The 6-bit scale and minimum of Q4_K sub-block `j` (ggml's `get_scale_min_k4`).
fn q4k_scale_min(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

impl QuantMatrix {
    /// Block `b` of row `j`: f16 scale and minimum (zero for 8-bit) and its 32 values.
    pub(super) fn block(&self, j: usize, b: usize) -> (u16, u16, [i16; BLOCK]) {
        let nb = self.k / BLOCK;
        let mut values = [0i16; BLOCK];
        match self.layout {
            Layout::Rows => {
                let block = j * nb + b;
                match self.family {
                    Family::Nibbles => {
                        let q = &self.quants[block * 16..block * 16 + 16];
                        for i in 0..16 {
                            values[i] = i16::from(q[i] & 0x0F);
                            values[i + 16] = i16::from(q[i] >> 4);
                        }
                        (self.scales[block], self.mins[block], values)
                    }
                    Family::Bytes => {
                        for (v, &q) in values
                            .iter_mut()
                            .zip(&self.quants[block * BLOCK..(block + 1) * BLOCK])
                        {
                            *v = i16::from(q as i8);
                        }
                        (self.scales[block], 0, values)
                    }
                }
            }
            Layout::Groups => {
                let pairs = nb.div_ceil(2);
                let (g, c, p, second) = (j / COL_TILE, j % COL_TILE, b / 2, b % 2);
                let record = g * pairs + p;
                let meta = record * 2 * COL_TILE + 2 * c + second;
                match self.family {
                    Family::Nibbles => {
                        let q = &self.quants[(record * COL_TILE + c) * BLOCK..][..BLOCK];
                        for (v, &byte) in values.iter_mut().zip(q) {
                            *v = i16::from((byte >> (4 * second)) & 0x0F);
                        }
                        (self.scales[meta], self.mins[meta], values)
                    }
                    Family::Bytes => {
                        let q = &self.quants[(record * COL_TILE + c) * 2 * BLOCK + second * BLOCK..][..BLOCK];
                        for (v, &byte) in values.iter_mut().zip(q) {
                            *v = i16::from(byte as i8);
                        }
                        (self.scales[meta], 0, values)
                    }
                }
            }
        }
    }

    /// The same matrix in [`Layout::Groups`] (rows padded to a multiple of [`COL_TILE`] and
    /// blocks to an even count, with zeros).
    pub(super) fn into_groups(self) -> Self {
        let nb = self.k / BLOCK;
        let (groups, pairs) = (self.n.div_ceil(COL_TILE), nb.div_ceil(2));
        let records = groups * pairs;
        let quant_bytes = match self.family {
            Family::Nibbles => BLOCK,
            Family::Bytes => 2 * BLOCK,
        };
        let mut quants = vec![0u8; records * COL_TILE * quant_bytes];
        let mut scales = vec![0u16; records * 2 * COL_TILE];
        let mut mins = vec![
            0u16;
            if self.family == Family::Nibbles {
                scales.len()
            } else {
                0
            }
        ];
        for g in 0..groups {
            for p in 0..pairs {
                let record = g * pairs + p;
                for c in 0..COL_TILE {
                    let j = g * COL_TILE + c;
                    for second in 0..2 {
                        let b = 2 * p + second;
                        if j >= self.n || b >= nb {
                            continue;
                        }
                        let (scale, min, values) = self.block(j, b);
                        let meta = record * 2 * COL_TILE + 2 * c + second;
                        scales[meta] = scale;
                        match self.family {
                            Family::Nibbles => {
                                mins[meta] = min;
                                let q = &mut quants[(record * COL_TILE + c) * BLOCK..][..BLOCK];
                                for (byte, &v) in q.iter_mut().zip(&values) {
                                    *byte |= (v as u8) << (4 * second);
                                }
                            }
                            Family::Bytes => {
                                let q = &mut quants[(record * COL_TILE + c) * 2 * BLOCK + second * BLOCK..]
                                    [..BLOCK];
                                for (byte, &v) in q.iter_mut().zip(&values) {
                                    *byte = v as i8 as u8;
                                }
                            }
                        }
                    }
                }
            }
        }
        Self {
            layout: Layout::Groups,
            quants,
            scales,
            mins,
            ..self
        }
    }
}
