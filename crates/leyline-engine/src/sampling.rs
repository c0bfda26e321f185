//! Choosing the next token from logits: greedy, or sampled with temperature, top-k and
//! top-p from a seeded generator so a run can be repeated.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// How to pick tokens. `temperature == 0` means greedy.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; 0 selects the argmax.
    pub temperature: f32,
    /// Keep the smallest set of tokens whose probability mass reaches `top_p` (1 = off).
    pub top_p: f32,
    /// Keep the `top_k` most likely tokens (0 = off).
    pub top_k: usize,
    /// Seed of the sampler's generator.
    pub seed: u64,
    /// Report each generated token's log-probability and this many most likely
    /// alternatives ([`TokenLogprobs`]); `None`: no report.
    pub logprobs: Option<usize>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: 0,
            logprobs: None,
        }
    }
}

impl SamplingParams {
    /// Greedy decoding.
    pub fn greedy() -> Self {
        Self::default()
    }

    /// Checks ranges.
    ///
    /// # Errors
    /// A message naming the bad field.
    pub fn validate(&self) -> Result<(), String> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(format!(
                "temperature must be >= 0, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        Ok(())
    }
}

/// A generated token's log-probability and the most likely tokens at its position, under
/// the model's own distribution: the softmax of the raw logits (temperature 1, before top-k
/// and top-p), as OpenAI's `logprobs` report it.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    /// The token chosen.
    pub token: u32,
    /// Its natural-log probability.
    pub logprob: f32,
    /// The most likely tokens with their log-probabilities, most likely first (ties: the
    /// lower id first); the chosen token among them where it ranks.
    pub top: Vec<(u32, f32)>,
}

/// `token`'s log-probability under `softmax(logits)` and the `k` most likely tokens'.
/// Non-finite logits count as probability 0. The normalizer is summed in f64.
pub fn logprobs(logits: &[f32], token: u32, k: usize) -> TokenLogprobs {
    let finite = || logits.iter().copied().filter(|x| x.is_finite());
    let max = finite().fold(f32::NEG_INFINITY, f32::max) as f64;
    let sum: f64 = finite().map(|x| (x as f64 - max).exp()).sum();
    let lse = max + sum.ln();
    let lp = |x: f32| {
        if x.is_finite() {
            (x as f64 - lse) as f32
        } else {
            f32::NEG_INFINITY
        }
    };
    let mut ids: Vec<u32> = (0..logits.len() as u32).collect();
    let by_logit_desc = |a: &u32, b: &u32| {
        let (x, y) = (logits[*a as usize], logits[*b as usize]);
        let key = |v: f32| if v.is_nan() { f32::NEG_INFINITY } else { v };
        key(y).total_cmp(&key(x)).then(a.cmp(b))
    };
    let k = k.min(ids.len());
    if k > 0 && k < ids.len() {
        ids.select_nth_unstable_by(k - 1, by_logit_desc);
    }
    ids.truncate(k);
    ids.sort_unstable_by(by_logit_desc);
    TokenLogprobs {
        token,
        logprob: logits
            .get(token as usize)
            .map_or(f32::NEG_INFINITY, |&x| lp(x)),
        top: ids
            .into_iter()
            .map(|i| (i, lp(logits[i as usize])))
            .collect(),
    }
}

/// A stateful sampler for one sequence.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
}

/// Index of the largest logit (the first one on ties); `None` for empty input.
pub fn argmax(logits: &[f32]) -> Option<u32> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &x) in logits.iter().enumerate() {
        if best.is_none_or(|(_, b)| x > b) {
            best = Some((i, x));
        }
    }
    best.map(|(i, _)| i as u32)
}

impl Sampler {
    /// A sampler with its own generator seeded from `params.seed`.
    pub fn new(params: SamplingParams) -> Self {
        Self {
            params,
            rng: StdRng::seed_from_u64(params.seed),
        }
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Picks the next token from `logits` (one row of the vocabulary).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        let p = self.params;
        if p.temperature == 0.0 || p.top_k == 1 {
            return argmax(logits).unwrap_or(0);
        }
        let Some(top) = logits
            .iter()
            .copied()
            .filter(|x| x.is_finite())
            .max_by(f32::total_cmp)
        else {
            return 0;
        };
        // Shifted before scaling: the top logit becomes 0, so a temperature near zero
        // sends the others to -inf (probability 0), never to inf - inf = NaN.
        let mut cand: Vec<(u32, f32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, x)| x.is_finite())
            .map(|(i, &x)| (i as u32, (x - top) / p.temperature))
            .collect();
        let by_logit_desc = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1);
        if p.top_k > 0 && p.top_k < cand.len() {
            cand.select_nth_unstable_by(p.top_k - 1, by_logit_desc);
            cand.truncate(p.top_k);
        }
        cand.sort_unstable_by(by_logit_desc);
        let max = cand[0].1;
        let mut probs: Vec<f32> = cand.iter().map(|(_, x)| (x - max).exp()).collect();
        let sum: f32 = probs.iter().sum();
        probs.iter_mut().for_each(|x| *x /= sum);
        if p.top_p < 1.0 {
            let mut acc = 0.0;
            let keep = probs
                .iter()
                .position(|&x| {
                    acc += x;
                    acc >= p.top_p
                })
                .map_or(probs.len(), |i| i + 1);
            probs.truncate(keep);
            let s: f32 = probs.iter().sum();
            probs.iter_mut().for_each(|x| *x /= s);
        }
        let r: f32 = self.rng.random();
        let mut acc = 0.0;
        for (i, &q) in probs.iter().enumerate() {
            acc += q;
            if r < acc {
                return cand[i].0;
            }
        }
        cand[probs.len() - 1].0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn greedy_picks_first_max() {
        assert_eq!(argmax(&[0.0, 3.0, 1.0, 3.0]), Some(1));
        assert_eq!(argmax(&[]), None);
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&[-1.0, -0.5, -2.0]), 1);
    }

    #[test]
    fn top_k_one_and_tiny_top_p_are_greedy() {
        let logits = [0.1, 2.0, 1.9, -3.0];
        let mut k1 = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 1,
            ..Default::default()
        });
        let mut p = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_p: 1e-6,
            ..Default::default()
        });
        for _ in 0..50 {
            assert_eq!(k1.sample(&logits), 1);
            assert_eq!(p.sample(&logits), 1);
        }
    }

    #[test]
    fn a_temperature_near_zero_is_greedy_not_nan() {
        // 1e-40 is a subnormal f32: dividing raw logits by it overflows to inf, and
        // inf - inf in the softmax is NaN.
        let logits = [30.0, 31.5, -2.0, 31.0];
        for t in [1e-40f32, 1e-30, f32::MIN_POSITIVE] {
            let mut s = Sampler::new(SamplingParams {
                temperature: t,
                seed: 3,
                ..Default::default()
            });
            for _ in 0..50 {
                assert_eq!(s.sample(&logits), 1, "temperature {t}");
            }
        }
    }

    #[test]
    fn sampling_follows_the_distribution_and_the_seed() {
        // p = softmax([0, ln 3]) = [0.25, 0.75].
        let logits = [0.0, 3f32.ln()];
        let params = SamplingParams {
            temperature: 1.0,
            seed: 7,
            ..Default::default()
        };
        let mut s = Sampler::new(params);
        let draws: Vec<u32> = (0..4000).map(|_| s.sample(&logits)).collect();
        let ones = draws.iter().filter(|&&x| x == 1).count() as f64 / 4000.0;
        assert!((ones - 0.75).abs() < 0.03, "frequency {ones}");
        let mut again = Sampler::new(params);
        let replay: Vec<u32> = (0..4000).map(|_| again.sample(&logits)).collect();
        assert_eq!(draws, replay);
    }

    #[test]
    fn top_k_excludes_the_tail() {
        let logits = [5.0, 4.9, -1.0, 4.8];
        let mut s = Sampler::new(SamplingParams {
            temperature: 2.0,
            top_k: 2,
            seed: 1,
            ..Default::default()
        });
        for _ in 0..500 {
            let t = s.sample(&logits);
            assert!(t == 0 || t == 1, "{t}");
        }
    }

    #[test]
    fn logprobs_are_the_log_softmax_and_its_top() {
        // softmax([ln 1, ln 2, ln 3, ln 4, -inf]) = [0.1, 0.2, 0.3, 0.4, 0].
        let logits = [
            1f32.ln(),
            2f32.ln(),
            3f32.ln(),
            4f32.ln(),
            f32::NEG_INFINITY,
        ];
        let r = logprobs(&logits, 1, 3);
        assert_eq!(r.token, 1);
        assert!((r.logprob - 0.2f32.ln()).abs() < 1e-6, "{}", r.logprob);
        let ids: Vec<u32> = r.top.iter().map(|t| t.0).collect();
        assert_eq!(ids, [3, 2, 1]);
        for ((_, got), want) in r.top.iter().zip([0.4f32, 0.3, 0.2]) {
            assert!((got - want.ln()).abs() < 1e-6, "{got} vs ln {want}");
        }
        // A shift of every logit changes nothing; large logits do not overflow.
        let shifted: Vec<f32> = logits.iter().map(|x| x + 80.0).collect();
        let s = logprobs(&shifted, 1, 3);
        assert!((s.logprob - r.logprob).abs() < 1e-5);
        assert_eq!(logprobs(&logits, 4, 0).logprob, f32::NEG_INFINITY);
        assert!(logprobs(&logits, 0, 9).top.len() == 5);
        // Ties: the lower id first.
        let tie = logprobs(&[2.0, 5.0, 5.0, 1.0], 2, 2);
        assert_eq!(tie.top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 2]);
    }

    #[test]
    fn validation_names_the_field() {
        let bad = SamplingParams {
            temperature: -1.0,
            ..Default::default()
        };
        assert!(bad.validate().unwrap_err().contains("temperature"));
        let bad = SamplingParams {
            top_p: 0.0,
            ..Default::default()
        };
        assert!(bad.validate().unwrap_err().contains("top_p"));
    }
}
