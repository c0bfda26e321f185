//! leyline-engine (placeholder).
