//! leyline-policy (placeholder).
