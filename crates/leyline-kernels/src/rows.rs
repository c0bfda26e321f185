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
