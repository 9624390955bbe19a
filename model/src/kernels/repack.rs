//! GGUF block formats → the kernels' layout. 4-bit formats become 32-value blocks of
//! `scale · q + min` with 16 bytes of nibbles (low nibbles hold values 0..16); Q8_0 keeps its
//! signed bytes. Scales and minimums are widened to f32 once, here, not per product.

use candle_core::quantized::GgmlDType;

use super::{BLOCK, COL_TILE, Family, Layout, QuantMatrix, TILE_COLS, read_f16, to_f16, to_f32};

/// Q4_K super-block: 256 values in 8 sub-blocks of 32.
const SUPER: usize = 256;

pub(super) fn repack(dtype: GgmlDType, n: usize, k: usize, data: &[u8]) -> Option<QuantMatrix> {
    let (family, block_values, block_bytes) = match dtype {
        GgmlDType::Q4_0 => (Family::Nibbles, BLOCK, 18),
        GgmlDType::Q4_1 => (Family::Nibbles, BLOCK, 20),
        GgmlDType::Q4K => (Family::Nibbles, SUPER, 144),
        GgmlDType::Q8_0 => (Family::Bytes, BLOCK, 34),
        GgmlDType::Q6K => (Family::Bytes16, SUPER, 210),
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
        scales: Vec::with_capacity(blocks * if family == Family::Bytes16 { 2 } else { 1 }),
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
            GgmlDType::Q6K => matrix.push_q6k(block),
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

impl QuantMatrix {
    /// One Q6_K super-block: 128 bytes of low 4 bits, 64 of high 2 bits, 16 signed 8-bit
    /// scales (one per 16 values) and f16 d; value v is `d · sc[v / 16] · (q − 32)`. Each 32
    /// values become one signed-byte block with two f16 scales `d · sc` (rounded to f16, as
    /// for Q4_K).
    fn push_q6k(&mut self, block: &[u8]) {
        let (ql, qh, sc) = (&block[0..128], &block[128..192], &block[192..208]);
        let d = to_f32(read_f16(block, 208));
        let mut values = [0i8; SUPER];
        for half in 0..2 {
            let (ql, qh) = (&ql[64 * half..], &qh[32 * half..]);
            for l in 0..32 {
                let v = &mut values[128 * half..];
                v[l] = ((ql[l] & 0x0F) | ((qh[l] & 3) << 4)) as i8 - 32;
                v[l + 32] = ((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) as i8 - 32;
                v[l + 64] = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i8 - 32;
                v[l + 96] = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i8 - 32;
            }
        }
        for (j, chunk) in values.chunks_exact(BLOCK).enumerate() {
            for h in 0..2 {
                self.scales.push(to_f16(d * f32::from(sc[2 * j + h] as i8)));
            }
            self.quants.extend(chunk.iter().map(|&v| v as u8));
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
    /// Scales stored per 32-value block: two (one per 16 values) for Q6_K, else one.
    pub(super) fn halves(&self) -> usize {
        if self.family == Family::Bytes16 { 2 } else { 1 }
    }

    /// Where the f16 scale of half `h` of block `b` of row `j` is kept (minimums likewise).
    fn meta_index(&self, j: usize, b: usize, h: usize) -> usize {
        let (nb, halves) = (self.k / BLOCK, self.halves());
        let h = h.min(halves - 1);
        match self.layout {
            Layout::Rows => (j * nb + b) * halves + h,
            Layout::Groups | Layout::Lanes => {
                let record = (j / COL_TILE) * nb.div_ceil(2) + b / 2;
                record * 2 * halves * COL_TILE + (j % COL_TILE) * 2 * halves + (b % 2) * halves + h
            }
            Layout::Tiles => ((j / TILE_COLS) * nb + b) * TILE_COLS + j % TILE_COLS,
        }
    }

    /// Byte offset of block `b` of row `j`'s quants (16 bytes for 4-bit rows, 32 for 8-bit)
    /// in [`Layout::Rows`], the only layout that keeps a block's bytes together.
    fn quant_offset(&self, j: usize, b: usize) -> usize {
        let nb = self.k / BLOCK;
        match (self.layout, self.family) {
            (Layout::Rows, Family::Nibbles) => (j * nb + b) * 16,
            (Layout::Rows, _) => (j * nb + b) * BLOCK,
            _ => unreachable!("group-, lane- and tile-layout blocks are spread"),
        }
    }

    /// Where value `v` of block `b` of row `j` lies in [`Layout::Lanes`] (and
    /// [`Layout::Groups`], which places 8-bit values as it does): byte offset, and the shift
    /// of its nibble (4-bit).
    fn lane_byte(&self, j: usize, b: usize, v: usize) -> (usize, u32) {
        let record = (j / COL_TILE) * (self.k / BLOCK).div_ceil(2) + b / 2;
        let slot = 2 * (j % COL_TILE) + b % 2;
        let (register, half, i) = ((v % 16) / 4, v / 16, v % 4);
        let within = 8 * slot + 4 * half + i;
        match self.family {
            Family::Nibbles => (
                record * 128 + (register / 2) * 64 + within,
                4 * (register as u32 % 2),
            ),
            _ => (record * 256 + register * 64 + within, 0),
        }
    }

    /// Where value `v` of block `b` of row `j` lies in [`Layout::Tiles`]: byte offset, and
    /// the shift of its nibble (4-bit).
    fn tile_byte(&self, j: usize, b: usize, v: usize) -> (usize, u32) {
        let record = (j / TILE_COLS) * (self.k / BLOCK) + b;
        let (tile_row, within) = (v / 4, 4 * (j % TILE_COLS) + v % 4);
        match self.family {
            Family::Nibbles => (
                record * TILE_COLS * BLOCK / 2 + 64 * (tile_row % 4) + within,
                4 * (tile_row as u32 / 4),
            ),
            _ => (record * TILE_COLS * BLOCK + 64 * tile_row + within, 0),
        }
    }

    /// Block `b` of row `j`: the f16 scales of its two halves of 16 values (equal unless
    /// Q6_K), its f16 minimum (zero for 8-bit) and its 32 values.
    pub(super) fn block(&self, j: usize, b: usize) -> ([u16; 2], u16, [i16; BLOCK]) {
        let mut values = [0i16; BLOCK];
        match (self.layout, self.family) {
            (Layout::Tiles, family) => {
                for (v, value) in values.iter_mut().enumerate() {
                    let (at, shift) = self.tile_byte(j, b, v);
                    let byte = self.quants[at];
                    *value = match family {
                        Family::Nibbles => i16::from((byte >> shift) & 0x0F),
                        _ => i16::from(byte as i8),
                    };
                }
            }
            (layout @ (Layout::Lanes | Layout::Groups), family) => {
                for (v, value) in values.iter_mut().enumerate() {
                    let (at, shift) = self.lane_byte(j, b, v);
                    let byte = self.quants[at];
                    *value = match (family, layout) {
                        (Family::Nibbles, _) => i16::from((byte >> shift) & 0x0F),
                        (_, Layout::Groups) => i16::from(byte as i8),
                        _ => i16::from(byte) - 128,
                    };
                }
            }
            (Layout::Rows, Family::Nibbles) => {
                let at = self.quant_offset(j, b);
                let q = &self.quants[at..at + 16];
                for i in 0..16 {
                    values[i] = i16::from(q[i] & 0x0F);
                    values[i + 16] = i16::from(q[i] >> 4);
                }
            }
            _ => {
                let at = self.quant_offset(j, b);
                for (v, &byte) in values.iter_mut().zip(&self.quants[at..at + BLOCK]) {
                    *v = i16::from(byte as i8);
                }
            }
        }
        let scales = [
            self.scales[self.meta_index(j, b, 0)],
            self.scales[self.meta_index(j, b, 1)],
        ];
        let min = if self.family == Family::Nibbles {
            self.mins[self.meta_index(j, b, 0)]
        } else {
            0
        };
        (scales, min, values)
    }

    /// The same matrix in [`Layout::Groups`] (8-bit weights only) or [`Layout::Lanes`] (rows
    /// padded to a multiple of [`COL_TILE`] and blocks to an even count, with zero values),
    /// or [`Layout::Tiles`] (not Q6_K; rows padded to a multiple of 16).
    pub(super) fn into_layout(self, layout: Layout) -> Self {
        assert!(layout != Layout::Rows && self.layout == Layout::Rows);
        assert!(
            layout != Layout::Groups || self.family != Family::Nibbles,
            "4-bit weights take the lane layout"
        );
        assert!(
            layout != Layout::Tiles || self.family != Family::Bytes16,
            "Q6_K has no tile layout"
        );
        let nb = self.k / BLOCK;
        // Lane and group records hold `COL_TILE` rows × 2 blocks, tile records `TILE_COLS`
        // rows × 1 block; `per_row` is what one row of a record takes (quants in bytes, f16
        // scales or minimums).
        let (records, rows_per_record, quants_per_row, scales_per_row) = match layout {
            Layout::Tiles => (self.n.div_ceil(TILE_COLS) * nb, TILE_COLS, BLOCK, 1),
            _ => (self.n.div_ceil(COL_TILE) * nb.div_ceil(2), COL_TILE, 2 * BLOCK, 2),
        };
        let quants_per_row = match self.family {
            Family::Nibbles => quants_per_row / 2,
            _ => quants_per_row,
        };
        let record_rows = records * rows_per_record;
        // Lane-layout 8-bit values are offset by 128: padding holds value 0 too.
        let padding = if layout == Layout::Lanes && self.family != Family::Nibbles {
            128
        } else {
            0
        };
        let mut grouped = Self {
            layout,
            quants: vec![padding; record_rows * quants_per_row],
            scales: vec![0u16; record_rows * scales_per_row * self.halves()],
            mins: vec![
                0u16;
                if self.family == Family::Nibbles {
                    record_rows * scales_per_row
                } else {
                    0
                }
            ],
            family: self.family,
            source: self.source,
            n: self.n,
            k: self.k,
        };
        for j in 0..self.n {
            for b in 0..nb {
                let (scales, min, values) = self.block(j, b);
                for (h, &scale) in scales.iter().enumerate().take(self.halves()) {
                    let at = grouped.meta_index(j, b, h);
                    grouped.scales[at] = scale;
                }
                if self.family == Family::Nibbles {
                    let at = grouped.meta_index(j, b, 0);
                    grouped.mins[at] = min;
                }
                if layout == Layout::Tiles {
                    for (i, &v) in values.iter().enumerate() {
                        let (at, shift) = grouped.tile_byte(j, b, i);
                        match self.family {
                            Family::Nibbles => grouped.quants[at] |= (v as u8) << shift,
                            _ => grouped.quants[at] = v as i8 as u8,
                        }
                    }
                    continue;
                }
                for (i, &v) in values.iter().enumerate() {
                    let (at, shift) = grouped.lane_byte(j, b, i);
                    match (self.family, layout) {
                        (Family::Nibbles, _) => grouped.quants[at] |= (v as u8) << shift,
                        (_, Layout::Groups) => grouped.quants[at] = v as i8 as u8,
                        _ => grouped.quants[at] = (v + 128) as u8,
                    }
                }
            }
        }
        grouped
    }
}
