//! leyline-core (placeholder).
