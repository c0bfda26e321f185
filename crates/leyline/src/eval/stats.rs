//! The statistics the reports print: one median and one percentile for every measurement.

use std::cmp::Ordering;

/// The median of `v`: the middle value of the sorted values, the upper of the two middle
/// ones for an even count; `None` when `v` is empty.
pub fn median<T: Copy + PartialOrd>(v: &[T]) -> Option<T> {
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.partial_cmp(b).unwrap_or(Ordering::Equal));
    s.get(s.len() / 2).copied()
}

/// Nearest-rank percentile (`q` in 0..=1) of `v`; NaN when empty.
pub fn percentile(v: &[f64], q: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let rank = (q * s.len() as f64).ceil().max(1.0) as usize;
    s[rank.min(s.len()) - 1]
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn median_takes_the_middle_or_the_upper_middle() {
        assert_eq!(median(&[3.0, 1.0, 2.0]), Some(2.0));
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), Some(3.0));
        assert_eq!(median(&[7usize]), Some(7));
        assert_eq!(median(&[9usize, 2, 5, 5]), Some(5));
        assert_eq!(median::<f64>(&[]), None);
    }

    #[test]
    fn nearest_rank_percentiles() {
        let v: Vec<f64> = (1..=20).map(f64::from).collect();
        assert_eq!(percentile(&v, 0.5), 10.0);
        assert_eq!(percentile(&v, 0.95), 19.0);
        assert_eq!(percentile(&v, 1.0), 20.0);
        assert_eq!(percentile(&[3.0, 1.0, 2.0], 0.5), 2.0);
        assert_eq!(percentile(&[7.0], 0.0), 7.0);
        assert!(percentile(&[], 0.5).is_nan());
    }
}
