//! leyline-kv (placeholder).
