//! Measurements of the benchmarks and of `leyline verify`: the fidelity probes and key drift
//! ([`fidelity`]) and the statistics their reports print ([`stats`]).

pub mod fidelity;
pub mod stats;
