//! Typed views of a row buffer, as the kernels read and write it: f32 values, or f16 / bf16
//! bit patterns (kept as raw bits so kernels can work bit-level). The KV pool hands its
//! buffers out as these; nothing here knows what a row holds.

/// Mutable view of a row buffer, as handed to rotation kernels.
#[derive(Debug)]
pub enum RowsMut<'a> {
    /// f32 values.
    F32(&'a mut [f32]),
    /// f16 bit patterns.
    F16(&'a mut [u16]),
    /// bf16 bit patterns.
    Bf16(&'a mut [u16]),
}

/// Read-only view of a row buffer, for kernels that read the pool in place (attention).
#[derive(Debug, Clone, Copy)]
pub enum RowsRef<'a> {
    /// f32 values.
    F32(&'a [f32]),
    /// f16 bit patterns.
    F16(&'a [u16]),
    /// bf16 bit patterns.
    Bf16(&'a [u16]),
}

/// Where one head's row of one slot starts in a layer's buffer: at `slot * slot + head * head`
/// elements. Rows of a head are `head_dim` values wide, whatever the layout.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Strides {
    /// Elements from a slot's row of a head to the next slot's.
    pub slot: usize,
    /// Elements from a head's row of a slot to the next head's.
    pub head: usize,
}

impl Strides {
    /// Each slot's heads side by side: `[slots][heads][head_dim]`.
    pub fn slot_major(heads: usize, head_dim: usize) -> Self {
        Self {
            slot: heads * head_dim,
            head: head_dim,
        }
    }

    /// Each head's slots one after the other: `[heads][capacity][head_dim]`, so that one
    /// head's rows of consecutive slots are consecutive in memory.
    pub fn head_major(capacity: usize, head_dim: usize) -> Self {
        Self {
            slot: head_dim,
            head: capacity * head_dim,
        }
    }

    /// The first element of `head`'s row of `slot`.
    #[inline(always)]
    pub fn at(self, slot: usize, head: usize) -> usize {
        slot * self.slot + head * self.head
    }
}
