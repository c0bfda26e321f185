//! KV storage: one pair of row buffers per layer, indexed by slot.
//!
//! Every layer holds a *key-part* buffer whose rows carry the rotary dimensions, and a
//! *value-part* buffer that is position-free. GQA: a slot's key part is `[kv_heads, head_dim]`
//! post-RoPE keys, its value part the values. MLA: the key part is `k_pe` (one "head" of
//! `rope_dim`), the value part the normalized latent. A splice therefore only ever rotates
//! key rows and never reads values.
//!
//! Both buffers are head-major, `[heads][slots][head width]`: a decode's attention task reads
//! one kv head's rows of consecutive slots, which then lie one after the other in memory
//! (the hardware prefetchers follow them; with the heads side by side in each slot it read
//! every other row: 0.60x the time on the 1.5B's decode at 16K keys, `benches/attend.rs`).
//! Rows go in and out of the storage as slot rows, heads side by side.

use crate::error::{KvError, Result};
use leyline_kernels::attend::KvRows;
use leyline_kernels::convert::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
use leyline_kernels::rope::Rotation;
use leyline_kernels::rotate::shift_rows_with;
use leyline_kernels::rows::{RowsMut, RowsRef, Strides};
use leyline_kernels::Tier;

/// Storage element type of the pool. Rotation math is always f32; this is only how the
/// numbers rest in memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// 4 bytes, exact.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    Bf16,
}

impl KvDtype {
    /// Bytes per stored element.
    pub fn size(self) -> usize {
        match self {
            KvDtype::F32 => 4,
            KvDtype::F16 | KvDtype::Bf16 => 2,
        }
    }

    /// Lower-case name as used on the command line.
    pub fn name(self) -> &'static str {
        match self {
            KvDtype::F32 => "f32",
            KvDtype::F16 => "f16",
            KvDtype::Bf16 => "bf16",
        }
    }
}

impl std::str::FromStr for KvDtype {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" | "float32" => Ok(KvDtype::F32),
            "f16" | "float16" | "half" => Ok(KvDtype::F16),
            "bf16" | "bfloat16" => Ok(KvDtype::Bf16),
            other => Err(format!(
                "unknown KV dtype {other:?} (expected f32, f16 or bf16)"
            )),
        }
    }
}

impl std::fmt::Display for KvDtype {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// Shape of what one slot holds in every layer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvGeometry {
    /// Number of layers.
    pub layers: usize,
    /// Number of rotary "heads" in a key-part row (GQA: kv heads; MLA: 1).
    pub k_heads: usize,
    /// Width of one head in the key-part row.
    pub k_head_dim: usize,
    /// Width of a value-part row (GQA: kv_heads * head_dim; MLA: kv_lora_rank).
    pub v_width: usize,
}

impl KvGeometry {
    /// Elements in a key-part row.
    pub fn k_width(&self) -> usize {
        self.k_heads * self.k_head_dim
    }

    /// Width of one head's value part (the value row split as the key row is).
    pub fn v_head_dim(&self) -> usize {
        self.v_width / self.k_heads.max(1)
    }

    /// Bytes one slot costs across all layers at `dtype`.
    pub fn bytes_per_slot(&self, dtype: KvDtype) -> usize {
        self.layers * (self.k_width() + self.v_width) * dtype.size()
    }
}

/// Alignment of a row buffer's first element, in bytes: a cache line, so that rows whose
/// size is a multiple of it never straddle two lines (and a 64-byte vector load of such a row
/// is never split).
pub const ROW_ALIGN: usize = 64;

/// A zeroed buffer of `len` elements whose first one sits on a [`ROW_ALIGN`] boundary: an
/// over-allocated [`leyline_kernels::mem::HugeBuf`] and the offset of that boundary in it (0 where the
/// buffer is a page-aligned mapping; it never grows, so the offset stays valid).
#[derive(Debug)]
struct Aligned<T: leyline_kernels::mem::Zeroable> {
    buf: leyline_kernels::mem::HugeBuf<T>,
    start: usize,
    len: usize,
}

impl<T: leyline_kernels::mem::Zeroable> Aligned<T> {
    fn zeroed(len: usize) -> Self {
        let size = std::mem::size_of::<T>();
        let buf = leyline_kernels::mem::HugeBuf::zeroed(len + ROW_ALIGN / size);
        let start = (ROW_ALIGN - buf.as_ptr() as usize % ROW_ALIGN) % ROW_ALIGN / size;
        Self { buf, start, len }
    }
}

impl<T: leyline_kernels::mem::Zeroable> std::ops::Deref for Aligned<T> {
    type Target = [T];
    fn deref(&self) -> &[T] {
        &self.buf[self.start..self.start + self.len]
    }
}

impl<T: leyline_kernels::mem::Zeroable> std::ops::DerefMut for Aligned<T> {
    fn deref_mut(&mut self) -> &mut [T] {
        &mut self.buf[self.start..self.start + self.len]
    }
}

/// Typed row buffer. Half types are kept as raw bits so kernels can work bit-level.
#[derive(Debug)]
enum Rows {
    F32(Aligned<f32>),
    F16(Aligned<u16>),
    Bf16(Aligned<u16>),
}

impl Rows {
    fn as_ref(&self) -> RowsRef<'_> {
        match self {
            Rows::F32(b) => RowsRef::F32(b),
            Rows::F16(b) => RowsRef::F16(b),
            Rows::Bf16(b) => RowsRef::Bf16(b),
        }
    }

    fn zeros(dtype: KvDtype, n: usize) -> Self {
        match dtype {
            KvDtype::F32 => Rows::F32(Aligned::zeroed(n)),
            KvDtype::F16 => Rows::F16(Aligned::zeroed(n)),
            KvDtype::Bf16 => Rows::Bf16(Aligned::zeroed(n)),
        }
    }

    fn write(&mut self, offset: usize, src: &[f32]) {
        match self {
            Rows::F32(b) => b[offset..offset + src.len()].copy_from_slice(src),
            Rows::F16(b) => {
                for (d, s) in b[offset..offset + src.len()].iter_mut().zip(src) {
                    *d = f32_to_f16(*s);
                }
            }
            Rows::Bf16(b) => {
                for (d, s) in b[offset..offset + src.len()].iter_mut().zip(src) {
                    *d = f32_to_bf16(*s);
                }
            }
        }
    }

    fn read(&self, offset: usize, dst: &mut [f32]) {
        match self {
            Rows::F32(b) => dst.copy_from_slice(&b[offset..offset + dst.len()]),
            Rows::F16(b) => {
                for (d, s) in dst.iter_mut().zip(&b[offset..]) {
                    *d = f16_to_f32(*s);
                }
            }
            Rows::Bf16(b) => {
                for (d, s) in dst.iter_mut().zip(&b[offset..]) {
                    *d = bf16_to_f32(*s);
                }
            }
        }
    }

    fn fill_zero(&mut self, offset: usize, len: usize) {
        match self {
            Rows::F32(b) => b[offset..offset + len].fill(0.0),
            Rows::F16(b) | Rows::Bf16(b) => b[offset..offset + len].fill(0),
        }
    }

    fn copy_within(&mut self, src: usize, dst: usize, len: usize) {
        match self {
            Rows::F32(b) => b.copy_within(src..src + len, dst),
            Rows::F16(b) | Rows::Bf16(b) => b.copy_within(src..src + len, dst),
        }
    }

    fn as_mut(&mut self) -> RowsMut<'_> {
        match self {
            Rows::F32(b) => RowsMut::F32(b),
            Rows::F16(b) => RowsMut::F16(b),
            Rows::Bf16(b) => RowsMut::Bf16(b),
        }
    }
}

/// Key-part rows saved by [`KvStorage::save_k`]: every layer's rows of some slots.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct KRowsBackup {
    slots: Vec<u32>,
    f32s: Vec<f32>,
    halves: Vec<u16>,
}

struct LayerRows {
    k: Rows,
    v: Rows,
}

/// Where each head's key and value rows of a slot lie in a layer's two buffers.
#[derive(Debug, Clone, Copy)]
struct HeadRows {
    k: Strides,
    v: Strides,
    heads: usize,
}

impl HeadRows {
    /// `(key offset, value offset)` of each head's rows of `slot`, head by head.
    fn of(self, slot: u32) -> impl Iterator<Item = (usize, usize)> + Clone {
        let s = slot as usize;
        (0..self.heads).map(move |h| (self.k.at(s, h), self.v.at(s, h)))
    }
}

/// The pool's storage: `capacity` slots of [`KvGeometry`] at one [`KvDtype`].
///
/// It knows nothing of which slot is free; the slot allocator does.
pub struct KvStorage {
    geometry: KvGeometry,
    dtype: KvDtype,
    capacity: usize,
    layers: Vec<LayerRows>,
}

impl KvStorage {
    /// Allocates zeroed storage for `capacity` slots.
    ///
    /// # Errors
    /// [`KvError::Sizing`] for a zero capacity or geometry, or a size that overflows.
    pub fn new(geometry: KvGeometry, dtype: KvDtype, capacity: usize) -> Result<Self> {
        if capacity == 0 || geometry.layers == 0 || geometry.k_width() == 0 {
            return Err(KvError::Sizing(format!(
                "capacity {capacity} and geometry {geometry:?} must be non-zero"
            )));
        }
        if !geometry.v_width.is_multiple_of(geometry.k_heads) {
            return Err(KvError::Sizing(format!(
                "value rows of {} do not split into {} heads",
                geometry.v_width, geometry.k_heads
            )));
        }
        capacity
            .checked_mul(geometry.bytes_per_slot(dtype))
            .ok_or_else(|| KvError::Sizing(format!("{capacity} slots overflow memory")))?;
        let layers = (0..geometry.layers)
            .map(|_| LayerRows {
                k: Rows::zeros(dtype, capacity * geometry.k_width()),
                v: Rows::zeros(dtype, capacity * geometry.v_width),
            })
            .collect();
        Ok(Self {
            geometry,
            dtype,
            capacity,
            layers,
        })
    }

    /// How many slots fit into `bytes` of storage for this geometry (at least 0).
    pub fn slots_for_bytes(geometry: KvGeometry, dtype: KvDtype, bytes: usize) -> usize {
        bytes / geometry.bytes_per_slot(dtype).max(1)
    }

    /// The geometry.
    pub fn geometry(&self) -> KvGeometry {
        self.geometry
    }

    /// The storage dtype.
    pub fn dtype(&self) -> KvDtype {
        self.dtype
    }

    /// Number of slots.
    pub fn capacity(&self) -> usize {
        self.capacity
    }

    /// Bytes held by the buffers.
    pub fn bytes(&self) -> usize {
        self.capacity * self.geometry.bytes_per_slot(self.dtype)
    }

    fn check_slot(&self, slot: u32) -> Result<()> {
        if (slot as usize) < self.capacity {
            Ok(())
        } else {
            Err(KvError::SlotOutOfRange {
                slot,
                capacity: self.capacity,
            })
        }
    }

    /// Writes one slot's key-part and value-part rows of `layer`, rounding once to the
    /// storage dtype.
    ///
    /// # Errors
    /// Out-of-range slot or rows of the wrong width.
    pub fn write(&mut self, layer: usize, slot: u32, k: &[f32], v: &[f32]) -> Result<()> {
        self.check_slot(slot)?;
        let (kw, vw) = (self.geometry.k_width(), self.geometry.v_width);
        if k.len() != kw {
            return Err(KvError::WidthMismatch {
                what: "key row",
                expected: kw,
                got: k.len(),
            });
        }
        if v.len() != vw {
            return Err(KvError::WidthMismatch {
                what: "value row",
                expected: vw,
                got: v.len(),
            });
        }
        let (khd, vhd) = (self.geometry.k_head_dim, self.geometry.v_head_dim());
        let at = self.head_rows().of(slot);
        let l = &mut self.layers[layer];
        for ((ko, vo), (kh, vh)) in at.zip(k.chunks_exact(khd).zip(v.chunks_exact(vhd))) {
            l.k.write(ko, kh);
            l.v.write(vo, vh);
        }
        Ok(())
    }

    /// Gathers the key-part rows of `slots` in `layer` into `out` (`slots.len() * k_width`
    /// f32 values, in slot-list order).
    ///
    /// # Errors
    /// Out-of-range slot or an `out` of the wrong length.
    pub fn gather_k(&self, layer: usize, slots: &[u32], out: &mut [f32]) -> Result<()> {
        let w = self.geometry.k_width();
        self.gather(layer, slots, out, w, true)
    }

    /// Gathers the value-part rows of `slots` in `layer` into `out`.
    ///
    /// # Errors
    /// Out-of-range slot or an `out` of the wrong length.
    pub fn gather_v(&self, layer: usize, slots: &[u32], out: &mut [f32]) -> Result<()> {
        let w = self.geometry.v_width;
        self.gather(layer, slots, out, w, false)
    }

    fn gather(
        &self,
        layer: usize,
        slots: &[u32],
        out: &mut [f32],
        w: usize,
        k: bool,
    ) -> Result<()> {
        if out.len() != slots.len() * w {
            return Err(KvError::WidthMismatch {
                what: "gather output",
                expected: slots.len() * w,
                got: out.len(),
            });
        }
        let rows = if k {
            &self.layers[layer].k
        } else {
            &self.layers[layer].v
        };
        let (map, hw) = (self.head_rows(), w / self.geometry.k_heads);
        for (i, &s) in slots.iter().enumerate() {
            self.check_slot(s)?;
            for (dst, (ko, vo)) in out[i * w..(i + 1) * w].chunks_exact_mut(hw).zip(map.of(s)) {
                rows.read(if k { ko } else { vo }, dst);
            }
        }
        Ok(())
    }

    /// Zeroes every layer's rows of `slot` (used when forgotten slots are freed).
    ///
    /// # Errors
    /// Out-of-range slot.
    pub fn zero_slot(&mut self, slot: u32) -> Result<()> {
        self.check_slot(slot)?;
        let (khd, vhd) = (self.geometry.k_head_dim, self.geometry.v_head_dim());
        let at = self.head_rows().of(slot);
        for l in &mut self.layers {
            for (ko, vo) in at.clone() {
                l.k.fill_zero(ko, khd);
                l.v.fill_zero(vo, vhd);
            }
        }
        Ok(())
    }

    /// Copies every layer's rows of each `(src, dst)` pair's `src` into its `dst`
    /// (copy-on-write before a rotation), in pair order. Layer by layer, so each row buffer
    /// is walked once instead of once per slot.
    ///
    /// # Errors
    /// Out-of-range slot; nothing is copied then.
    pub fn copy_slots(&mut self, pairs: &[(u32, u32)]) -> Result<()> {
        for &(src, dst) in pairs {
            self.check_slot(src)?;
            self.check_slot(dst)?;
        }
        let (khd, vhd) = (self.geometry.k_head_dim, self.geometry.v_head_dim());
        let at = self.head_rows();
        for l in &mut self.layers {
            for &(src, dst) in pairs {
                for ((ks, vs), (kd, vd)) in at.of(src).zip(at.of(dst)) {
                    l.k.copy_within(ks, kd, khd);
                    l.v.copy_within(vs, vd, vhd);
                }
            }
        }
        Ok(())
    }

    /// Whether every element of `slot` in every layer is zero.
    ///
    /// # Errors
    /// Out-of-range slot.
    pub fn slot_is_zero(&self, slot: u32) -> Result<bool> {
        self.check_slot(slot)?;
        let mut k = vec![0.0f32; self.geometry.k_head_dim];
        let mut v = vec![0.0f32; self.geometry.v_head_dim()];
        let at = self.head_rows().of(slot);
        for l in &self.layers {
            for (ko, vo) in at.clone() {
                l.k.read(ko, &mut k);
                l.v.read(vo, &mut v);
                if k.iter().chain(&v).any(|x| x.to_bits() != 0) {
                    return Ok(false);
                }
            }
        }
        Ok(true)
    }

    /// The key-part rows of `slots` in every layer, bit-exact, so that an in-place rotation
    /// can be undone ([`Self::restore_k`]).
    ///
    /// # Errors
    /// Out-of-range slot; nothing is saved then.
    pub fn save_k(&self, slots: &[u32]) -> Result<KRowsBackup> {
        for &s in slots {
            self.check_slot(s)?;
        }
        let (map, khd) = (self.head_rows(), self.geometry.k_head_dim);
        let mut out = KRowsBackup {
            slots: slots.to_vec(),
            ..KRowsBackup::default()
        };
        for l in &self.layers {
            for &s in slots {
                for (at, _) in map.of(s) {
                    match &l.k {
                        Rows::F32(b) => out.f32s.extend_from_slice(&b[at..at + khd]),
                        Rows::F16(b) | Rows::Bf16(b) => {
                            out.halves.extend_from_slice(&b[at..at + khd])
                        }
                    }
                }
            }
        }
        Ok(out)
    }

    /// Writes back what [`Self::save_k`] saved, bit for bit.
    ///
    /// # Errors
    /// A backup taken from storage of another shape or dtype; nothing is written then.
    pub fn restore_k(&mut self, backup: &KRowsBackup) -> Result<()> {
        let kw = self.geometry.k_width();
        let want = backup.slots.len() * kw * self.layers.len();
        let got = match self.dtype {
            KvDtype::F32 => backup.f32s.len(),
            KvDtype::F16 | KvDtype::Bf16 => backup.halves.len(),
        };
        if got != want {
            return Err(KvError::WidthMismatch {
                what: "key backup",
                expected: want,
                got,
            });
        }
        for &s in &backup.slots {
            self.check_slot(s)?;
        }
        let (map, khd) = (self.head_rows(), self.geometry.k_head_dim);
        let mut i = 0;
        for l in &mut self.layers {
            for &s in &backup.slots {
                for (at, _) in map.of(s) {
                    match &mut l.k {
                        Rows::F32(b) => b[at..at + khd].copy_from_slice(&backup.f32s[i..i + khd]),
                        Rows::F16(b) | Rows::Bf16(b) => {
                            b[at..at + khd].copy_from_slice(&backup.halves[i..i + khd])
                        }
                    }
                    i += khd;
                }
            }
        }
        Ok(())
    }

    fn head_rows(&self) -> HeadRows {
        HeadRows {
            k: self.k_strides(),
            v: self.v_strides(),
            heads: self.geometry.k_heads,
        }
    }

    /// Where a head's key row of a slot lies in a layer's key buffer.
    pub fn k_strides(&self) -> Strides {
        Strides::head_major(self.capacity, self.geometry.k_head_dim)
    }

    /// Where a head's value row of a slot lies in a layer's value buffer.
    pub fn v_strides(&self) -> Strides {
        Strides::head_major(self.capacity, self.geometry.v_head_dim())
    }

    /// Rotates the key rows of `slots` (every head's row of each slot) in each listed layer
    /// by that layer's rotation, with the kernel of `tier`. With no slots it only checks each
    /// rotation's width and the tier.
    ///
    /// # Errors
    /// A slot out of range, or as [`shift_rows_with`]; on an error in a later layer the
    /// earlier listed layers are already rotated (callers check with no slots first).
    ///
    /// # Panics
    /// A layer out of range.
    pub fn shift_k<'r>(
        &mut self,
        layers: impl IntoIterator<Item = (usize, &'r Rotation)>,
        slots: &[u32],
        tier: Tier,
    ) -> leyline_kernels::Result<()> {
        let (heads, cap) = (self.geometry.k_heads, self.capacity);
        if let Some(&s) = slots.iter().find(|&&s| s as usize >= cap) {
            return Err(leyline_kernels::KernelError::RowOutOfRange { row: s, rows: cap });
        }
        // Head-major rows are the rows of one head, `heads * capacity` slots long: slot `s`
        // of head `h` is its row `h * capacity + s`.
        let rows: Vec<u32> = (0..heads)
            .flat_map(|h| slots.iter().map(move |&s| (h * cap) as u32 + s))
            .collect();
        for (layer, rot) in layers {
            let l = &mut self.layers[layer];
            shift_rows_with(l.k.as_mut(), 1, self.geometry.k_head_dim, &rows, rot, tier)?;
        }
        Ok(())
    }

    /// One layer's key and value rows as attention reads them, in place.
    pub fn attend_rows(&self, layer: usize) -> KvRows<'_> {
        let l = &self.layers[layer];
        KvRows {
            k: l.k.as_ref(),
            v: l.v.as_ref(),
            k_strides: self.k_strides(),
            v_strides: self.v_strides(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn geom() -> KvGeometry {
        KvGeometry {
            layers: 2,
            k_heads: 2,
            k_head_dim: 4,
            v_width: 8,
        }
    }

    #[test]
    fn write_gather_roundtrip_each_dtype() {
        for dtype in [KvDtype::F32, KvDtype::F16, KvDtype::Bf16] {
            let mut s = KvStorage::new(geom(), dtype, 4).unwrap();
            let k: Vec<f32> = (0..8).map(|i| i as f32 * 0.5 - 1.0).collect();
            let v: Vec<f32> = (0..8).map(|i| 3.0 - i as f32).collect();
            s.write(1, 2, &k, &v).unwrap();
            let mut out = vec![0.0; 16];
            s.gather_k(1, &[0, 2], &mut out).unwrap();
            assert_eq!(&out[..8], &[0.0; 8]);
            assert_eq!(&out[8..], &k[..]); // halves of small integers are exact
            s.gather_v(1, &[2, 0], &mut out).unwrap();
            assert_eq!(&out[..8], &v[..]);
            assert!(!s.slot_is_zero(2).unwrap());
            // A batch with one bad slot copies nothing, not even its valid first pair.
            assert!(s.copy_slots(&[(2, 3), (9, 1)]).is_err(), "out of range");
            assert!(s.slot_is_zero(3).unwrap(), "a refused batch copied a pair");
            // Every pair is copied: slot 1 (written) takes slot 0's zeros.
            s.write(1, 1, &v, &k).unwrap();
            s.copy_slots(&[(2, 3), (0, 1)]).unwrap();
            assert!(s.slot_is_zero(1).unwrap());
            s.zero_slot(2).unwrap();
            assert!(s.slot_is_zero(2).unwrap());
            s.gather_k(1, &[3], &mut out[..8]).unwrap();
            assert_eq!(&out[..8], &k[..]);
            s.gather_v(1, &[3], &mut out[..8]).unwrap();
            assert_eq!(&out[..8], &v[..]);
        }
    }

    #[test]
    fn row_buffers_start_on_a_cache_line_and_hold_exactly_their_rows() {
        // Several sizes, so that the allocator's own alignment varies.
        for (dtype, slots) in [(KvDtype::F32, 4), (KvDtype::F32, 5000), (KvDtype::Bf16, 3)] {
            let mut s = KvStorage::new(geom(), dtype, slots).unwrap();
            s.write(1, slots as u32 - 1, &[1.0; 8], &[2.0; 8]).unwrap();
            for layer in 0..2 {
                let r = s.attend_rows(layer);
                let (k, v) = (r.k, r.v);
                for (rows, at) in [(k, 0), (v, 1)] {
                    let (addr, len, last) = match rows {
                        RowsRef::F32(r) => (r.as_ptr() as usize, r.len(), r[r.len() - 1]),
                        RowsRef::Bf16(r) | RowsRef::F16(r) => {
                            (r.as_ptr() as usize, r.len(), r[r.len() - 1] as f32)
                        }
                    };
                    assert_eq!(addr % ROW_ALIGN, 0, "{dtype:?} layer {layer} buffer {at}");
                    assert_eq!(len, slots * 8);
                    // The last slot's row ends the buffer.
                    assert_eq!(last != 0.0, layer == 1, "{dtype:?} layer {layer}");
                }
            }
        }
    }

    #[test]
    fn each_heads_rows_of_consecutive_slots_lie_one_after_the_other() {
        let mut s = KvStorage::new(geom(), KvDtype::F32, 3).unwrap();
        let k: Vec<f32> = (0..8).map(|i| 10.0 + i as f32).collect();
        let v: Vec<f32> = (0..8).map(|i| 20.0 + i as f32).collect();
        s.write(0, 1, &k, &v).unwrap();
        let r = s.attend_rows(0);
        let (RowsRef::F32(kb), RowsRef::F32(vb)) = (r.k, r.v) else {
            panic!("f32 storage")
        };
        // Two heads of 4 over 3 slots: head h's row of slot 1 at `h * 12 + 4`.
        for (buf, src, strides) in [(kb, &k, r.k_strides), (vb, &v, r.v_strides)] {
            assert_eq!(strides, Strides { slot: 4, head: 12 });
            assert_eq!(&buf[4..8], &src[..4]);
            assert_eq!(&buf[16..20], &src[4..]);
            let zeros = buf.iter().filter(|&&x| x == 0.0).count();
            assert_eq!(zeros, 24 - 8, "only slot 1's rows were written");
        }
        // The rotation turns every head's row of the slot, and only those.
        let spec = leyline_kernels::rope::RopeSpec::plain(
            10000.0,
            4,
            leyline_kernels::rope::RotaryLayout::Neox,
        );
        let rot = leyline_kernels::rotate::shift_table(&spec, 3).unwrap();
        let mut want = k.clone();
        for head in want.chunks_exact_mut(4) {
            rot.apply_f32(head);
        }
        s.shift_k([(0, &rot)], &[1], Tier::Portable).unwrap();
        let mut got = vec![0.0; 8];
        s.gather_k(0, &[1], &mut got).unwrap();
        assert_eq!(got, want);
        assert!(s.slot_is_zero(0).unwrap() && s.slot_is_zero(2).unwrap());
        assert!(
            s.shift_k([(0, &rot)], &[3], Tier::Portable).is_err(),
            "slot out of range"
        );
    }

    #[test]
    fn bad_input_is_an_error() {
        let mut s = KvStorage::new(geom(), KvDtype::Bf16, 4).unwrap();
        assert!(matches!(
            s.write(0, 4, &[0.0; 8], &[0.0; 8]),
            Err(KvError::SlotOutOfRange { .. })
        ));
        assert!(matches!(
            s.write(0, 0, &[0.0; 7], &[0.0; 8]),
            Err(KvError::WidthMismatch { .. })
        ));
        assert!(KvStorage::new(geom(), KvDtype::F32, 0).is_err());
        assert_eq!(geom().bytes_per_slot(KvDtype::Bf16), 2 * 16 * 2);
    }
}
