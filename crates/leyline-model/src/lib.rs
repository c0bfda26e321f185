//! leyline-model (placeholder).
