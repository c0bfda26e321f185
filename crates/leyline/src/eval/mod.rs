//! Measurements of the benchmarks and of `leyline verify`: the fidelity probes and key drift
//! ([`fidelity`]), the statistics their reports print ([`stats`]) and their plots ([`plot`]).

pub mod fidelity;
pub mod plot;
pub mod stats;
