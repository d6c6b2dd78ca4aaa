//! Robust trend of a series: the Theil–Sen slope (the median of all pairwise slopes) with
//! Sen's nonparametric confidence interval. A leak grows memory steadily; an allocator's
//! spikes and the odd bad sample do not move the median, where least squares would follow them.

use serde::{Deserialize, Serialize};

/// A fitted trend. Units: y per x.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Trend {
    /// The Theil–Sen slope.
    pub slope: f64,
    /// Median of `y − slope·x`.
    pub intercept: f64,
    /// Lower bound of the 95% confidence interval of the slope.
    pub ci_low: f64,
    /// Upper bound of the 95% confidence interval of the slope.
    pub ci_high: f64,
    /// Number of points.
    pub n: usize,
}

impl Trend {
    /// Whether the interval excludes zero on the rising side: a steady increase.
    pub fn rising(&self) -> bool {
        self.ci_low > 0.0
    }
}

fn median(sorted: &[f64]) -> f64 {
    let n = sorted.len();
    if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    }
}

/// Fits `points` (x, y). `None` with fewer than three points or no spread in x.
pub fn theil_sen(points: &[(f64, f64)]) -> Option<Trend> {
    let pts: Vec<(f64, f64)> = points
        .iter()
        .copied()
        .filter(|(x, y)| x.is_finite() && y.is_finite())
        .collect();
    let n = pts.len();
    if n < 3 {
        return None;
    }
    let mut slopes = Vec::with_capacity(n * (n - 1) / 2);
    for i in 0..n {
        for j in i + 1..n {
            let dx = pts[j].0 - pts[i].0;
            if dx != 0.0 {
                slopes.push((pts[j].1 - pts[i].1) / dx);
            }
        }
    }
    if slopes.is_empty() {
        return None;
    }
    slopes.sort_by(f64::total_cmp);
    let slope = median(&slopes);
    let mut residuals: Vec<f64> = pts.iter().map(|(x, y)| y - slope * x).collect();
    residuals.sort_by(f64::total_cmp);
    let intercept = median(&residuals);
    // Sen (1968): rank bounds from the variance of Kendall's S under no trend.
    let nf = n as f64;
    let var_s = nf * (nf - 1.0) * (2.0 * nf + 5.0) / 18.0;
    let c = 1.959_964 * var_s.sqrt();
    let m = slopes.len() as f64;
    let lower_rank = ((m - c) / 2.0).floor().max(0.0) as usize;
    let upper_rank = (((m + c) / 2.0).ceil() as usize).min(slopes.len() - 1);
    Some(Trend {
        slope,
        intercept,
        ci_low: slopes[lower_rank.min(slopes.len() - 1)],
        ci_high: slopes[upper_rank],
        n,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_exact_line() {
        let pts: Vec<(f64, f64)> = (0..20).map(|i| (i as f64, 3.0 * i as f64 + 7.0)).collect();
        let t = theil_sen(&pts).unwrap();
        assert_eq!(t.slope, 3.0);
        assert_eq!(t.intercept, 7.0);
        assert_eq!((t.ci_low, t.ci_high), (3.0, 3.0));
        assert!(t.rising());
    }

    #[test]
    fn outliers_do_not_move_it() {
        let mut pts: Vec<(f64, f64)> = (0..50).map(|i| (i as f64, 2.0 * i as f64)).collect();
        pts[10].1 = 10_000.0;
        pts[30].1 = -5_000.0;
        let t = theil_sen(&pts).unwrap();
        assert!((t.slope - 2.0).abs() < 1e-9, "{t:?}");
    }

    #[test]
    fn flat_noise_has_an_interval_around_zero() {
        let pts: Vec<(f64, f64)> = (0..60)
            .map(|i| (i as f64, ((i * 7919) % 13) as f64))
            .collect();
        let t = theil_sen(&pts).unwrap();
        assert!(t.ci_low <= 0.0 && t.ci_high >= 0.0, "{t:?}");
        assert!(!t.rising());
    }

    #[test]
    fn degenerate_inputs() {
        assert!(theil_sen(&[(0.0, 1.0), (1.0, 2.0)]).is_none());
        assert!(theil_sen(&[(1.0, 1.0), (1.0, 2.0), (1.0, 3.0)]).is_none());
        assert!(theil_sen(&[(0.0, f64::NAN), (1.0, 2.0), (2.0, 3.0)]).is_none());
    }

    proptest::proptest! {
        #[test]
        fn the_interval_contains_the_slope(ys in proptest::collection::vec(-1e6f64..1e6, 3..60)) {
            let pts: Vec<(f64, f64)> = ys.iter().enumerate().map(|(i, y)| (i as f64, *y)).collect();
            let t = theil_sen(&pts).unwrap();
            proptest::prop_assert!(t.ci_low <= t.slope && t.slope <= t.ci_high);
        }
    }
}
