//! Learning-rate schedules, as transformers' `get_scheduler` defines them: a factor of the
//! peak learning rate for each optimisation step, counted from 0. The optimizer's step `k`
//! (from 1) runs with `factor(k - 1)`, and that is the rate logged for step `k`
//! (docs/TRAINING.md §3).

use std::f64::consts::PI;

/// A schedule kind, by transformers' `lr_scheduler_type` name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScheduleKind {
    /// `linear`: warm-up, then linear decay to zero at the last step.
    Linear,
    /// `cosine`: warm-up, then half a cosine to zero.
    Cosine,
    /// `constant`: the peak rate throughout (transformers ignores the warm-up here).
    Constant,
    /// `constant_with_warmup`: warm-up, then the peak rate.
    ConstantWithWarmup,
}

impl ScheduleKind {
    /// Every accepted name.
    pub const NAMES: &'static [&'static str] =
        &["linear", "cosine", "constant", "constant_with_warmup"];

    /// The kind named `name`, or `None`.
    pub fn parse(name: &str) -> Option<Self> {
        Some(match name {
            "linear" => ScheduleKind::Linear,
            "cosine" => ScheduleKind::Cosine,
            "constant" => ScheduleKind::Constant,
            "constant_with_warmup" => ScheduleKind::ConstantWithWarmup,
            _ => return None,
        })
    }
}

/// A schedule over a run of `total` optimisation steps with `warmup` warm-up steps.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Schedule {
    /// The shape.
    pub kind: ScheduleKind,
    /// Warm-up steps.
    pub warmup: u64,
    /// Optimisation steps in the run.
    pub total: u64,
}

impl Schedule {
    /// The factor of the peak rate at scheduler step `step` (0 for the first update).
    pub fn factor(&self, step: u64) -> f64 {
        let (s, w, n) = (step as f64, self.warmup as f64, self.total as f64);
        let warm = || s / w.max(1.0);
        match self.kind {
            ScheduleKind::Constant => 1.0,
            ScheduleKind::ConstantWithWarmup if step < self.warmup => warm(),
            ScheduleKind::ConstantWithWarmup => 1.0,
            ScheduleKind::Linear if step < self.warmup => warm(),
            ScheduleKind::Linear => ((n - s) / (n - w).max(1.0)).max(0.0),
            ScheduleKind::Cosine if step < self.warmup => warm(),
            ScheduleKind::Cosine => {
                let progress = (s - w) / (n - w).max(1.0);
                (0.5 * (1.0 + (PI * 0.5 * 2.0 * progress).cos())).max(0.0)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values from transformers 5.24's lambdas, evaluated by hand: linear with 2 warm-up steps
    /// of 10 gives 0, .5, 1, 7/8, …, 0; cosine's midpoint is one half.
    #[test]
    fn factors_follow_transformers() {
        let lin = Schedule {
            kind: ScheduleKind::Linear,
            warmup: 2,
            total: 10,
        };
        let f: Vec<f64> = (0..=10).map(|s| lin.factor(s)).collect();
        assert_eq!(&f[..4], &[0.0, 0.5, 1.0, 0.875]);
        assert_eq!(f[10], 0.0);
        let cos = Schedule {
            kind: ScheduleKind::Cosine,
            warmup: 0,
            total: 4,
        };
        assert_eq!(cos.factor(0), 1.0);
        assert!((cos.factor(2) - 0.5).abs() < 1e-15);
        assert!(cos.factor(4).abs() < 1e-15);
        let c = Schedule {
            kind: ScheduleKind::Constant,
            warmup: 5,
            total: 9,
        };
        assert_eq!(c.factor(0), 1.0);
        let cw = Schedule {
            kind: ScheduleKind::ConstantWithWarmup,
            ..c
        };
        assert_eq!((cw.factor(0), cw.factor(4), cw.factor(5)), (0.0, 0.8, 1.0));
        assert_eq!(ScheduleKind::parse("cosine"), Some(ScheduleKind::Cosine));
        assert_eq!(ScheduleKind::parse("cosine_with_restarts"), None);
    }
}
