//! Optimizer math, applied in place on one row.
//!
//! All arithmetic is fp32 (bias corrections in f64); weights are loaded from and
//! stored to the table's storage type.

use crate::config::{OptKind, TableConfig};
use crate::elem::Elem;

/// Hyper-parameters in the precision used by the kernels.
#[derive(Clone, Copy, Debug)]
pub struct OptParams {
    pub kind: OptKind,
    pub lr: f32,
    pub weight_decay: f32,
    pub eps: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub beta1_f64: f64,
    pub beta2_f64: f64,
    pub initial_accumulator: f32,
    pub ftrl_alpha: f32,
    pub ftrl_beta: f32,
    pub ftrl_l1: f32,
    pub ftrl_l2: f32,
    pub bound: Option<f32>,
}

impl OptParams {
    pub fn from_config(c: &TableConfig) -> Self {
        OptParams {
            kind: c.optimizer,
            lr: c.lr as f32,
            weight_decay: c.weight_decay as f32,
            eps: c.eps as f32,
            beta1: c.beta1 as f32,
            beta2: c.beta2 as f32,
            beta1_f64: c.beta1,
            beta2_f64: c.beta2,
            initial_accumulator: c.initial_accumulator as f32,
            ftrl_alpha: c.ftrl_alpha as f32,
            ftrl_beta: c.ftrl_beta as f32,
            ftrl_l1: c.ftrl_l1 as f32,
            ftrl_l2: c.ftrl_l2 as f32,
            bound: c.weight_bound.map(|b| b as f32),
        }
    }
}

/// Mutable view of one row's scalar optimizer state.
pub struct RowScalars<'a> {
    /// Row-wise Adagrad accumulator (unused otherwise).
    pub acc: Option<&'a mut f32>,
    /// Adam per-row step count (unused otherwise).
    pub step: Option<&'a mut u32>,
}

#[inline(always)]
fn clip(v: f32, bound: Option<f32>) -> f32 {
    match bound {
        Some(b) => v.clamp(-b, b),
        None => v,
    }
}

/// FTRL-Proximal weight from (z, n).
#[inline(always)]
pub fn ftrl_weight(p: &OptParams, z: f32, n: f32) -> f32 {
    if z.abs() <= p.ftrl_l1 {
        0.0
    } else {
        let sign = if z < 0.0 { -1.0 } else { 1.0 };
        -(z - sign * p.ftrl_l1) / ((p.ftrl_beta + n.sqrt()) / p.ftrl_alpha + p.ftrl_l2)
    }
}

/// The z that reproduces weight `w` for accumulator `n` (used to start FTRL
/// rows from the configured initializer, and by `set_row`).
#[inline(always)]
pub fn ftrl_z_for_weight(p: &OptParams, w: f32, n: f32) -> f32 {
    if w == 0.0 {
        0.0
    } else {
        let d = (p.ftrl_beta + n.sqrt()) / p.ftrl_alpha + p.ftrl_l2;
        let sign = if w < 0.0 { -1.0 } else { 1.0 };
        -(w * d + sign * p.ftrl_l1)
    }
}

/// True if every gradient value is finite.
#[inline(always)]
pub fn all_finite(g: &[f32]) -> bool {
    // Branch-free accumulate: NaN/inf have all exponent bits set.
    let mut bad = 0u32;
    for &x in g {
        bad |= ((x.to_bits() & 0x7F80_0000) == 0x7F80_0000) as u32;
    }
    bad == 0
}

/// Initialize the optimizer state of a fresh row whose weights are `w`.
pub fn init_state<W: Elem>(p: &OptParams, w: &[W], state: &mut [f32], sc: RowScalars<'_>) {
    let dim = w.len();
    match p.kind {
        OptKind::Sgd => {}
        OptKind::Adagrad => state[..dim].fill(p.initial_accumulator),
        OptKind::RowwiseAdagrad => {
            if let Some(a) = sc.acc {
                *a = p.initial_accumulator
            }
        }
        OptKind::Adam => {
            state[..2 * dim].fill(0.0);
            if let Some(s) = sc.step {
                *s = 0
            }
        }
        OptKind::Ftrl => {
            let (z, n) = state[..2 * dim].split_at_mut(dim);
            n.fill(p.initial_accumulator);
            for i in 0..dim {
                z[i] = ftrl_z_for_weight(p, w[i].to_f32(), p.initial_accumulator);
            }
        }
    }
}

/// Apply one optimizer step with (already summed, finite) gradient `g`.
#[inline]
pub fn apply<W: Elem>(p: &OptParams, w: &mut [W], g: &[f32], state: &mut [f32], sc: RowScalars<'_>) {
    let dim = w.len();
    debug_assert_eq!(g.len(), dim);
    let lr = p.lr;
    let wd = p.weight_decay;
    match p.kind {
        OptKind::Sgd => {
            for i in 0..dim {
                let wi = w[i].to_f32();
                let gi = g[i] + wd * wi;
                w[i] = W::from_f32(clip(wi - lr * gi, p.bound));
            }
        }
        OptKind::Adagrad => {
            let acc = &mut state[..dim];
            for i in 0..dim {
                let wi = w[i].to_f32();
                let gi = g[i] + wd * wi;
                let a = acc[i] + gi * gi;
                acc[i] = a;
                w[i] = W::from_f32(clip(wi - lr * gi / (a.sqrt() + p.eps), p.bound));
            }
        }
        OptKind::RowwiseAdagrad => {
            let acc = match sc.acc {
                Some(a) => a,
                None => return,
            };
            let mut sq = 0.0f32;
            if wd == 0.0 {
                for &gi in g {
                    sq += gi * gi;
                }
            } else {
                for i in 0..dim {
                    let gi = g[i] + wd * w[i].to_f32();
                    sq += gi * gi;
                }
            }
            let a = *acc + sq / dim as f32;
            *acc = a;
            let step = lr / (a.sqrt() + p.eps);
            for i in 0..dim {
                let wi = w[i].to_f32();
                let gi = g[i] + wd * wi;
                w[i] = W::from_f32(clip(wi - step * gi, p.bound));
            }
        }
        OptKind::Adam => {
            let t = match sc.step {
                Some(s) => {
                    *s = s.saturating_add(1);
                    *s
                }
                None => return,
            };
            let bc1 = (1.0 - p.beta1_f64.powi(t.min(i32::MAX as u32) as i32)) as f32;
            let bc2 = (1.0 - p.beta2_f64.powi(t.min(i32::MAX as u32) as i32)) as f32;
            let (m, v) = state[..2 * dim].split_at_mut(dim);
            let (b1, b2) = (p.beta1, p.beta2);
            for i in 0..dim {
                let wi = w[i].to_f32();
                let gi = g[i] + wd * wi;
                let mi = b1 * m[i] + (1.0 - b1) * gi;
                let vi = b2 * v[i] + (1.0 - b2) * gi * gi;
                m[i] = mi;
                v[i] = vi;
                let upd = (mi / bc1) / ((vi / bc2).sqrt() + p.eps);
                w[i] = W::from_f32(clip(wi - lr * upd, p.bound));
            }
        }
        OptKind::Ftrl => {
            let (z, n) = state[..2 * dim].split_at_mut(dim);
            let inv_alpha = 1.0 / p.ftrl_alpha;
            for i in 0..dim {
                let gi = g[i];
                let wi = w[i].to_f32();
                let ni = n[i];
                let nn = ni + gi * gi;
                let sigma = (nn.sqrt() - ni.sqrt()) * inv_alpha;
                let zi = z[i] + gi - sigma * wi;
                z[i] = zi;
                n[i] = nn;
                w[i] = W::from_f32(clip(ftrl_weight(p, zi, nn), p.bound));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::TableConfig;

    fn params(kind: OptKind) -> OptParams {
        let mut c = TableConfig::new("t", 3);
        c.optimizer = kind;
        c.lr = 0.1;
        OptParams::from_config(&c)
    }

    #[test]
    fn sgd_with_weight_decay() {
        let mut p = params(OptKind::Sgd);
        p.weight_decay = 0.5;
        let mut w = [1.0f32, -2.0, 0.0];
        apply(&p, &mut w, &[1.0, 1.0, 1.0], &mut [], RowScalars { acc: None, step: None });
        // w - lr*(g + wd*w)
        assert_eq!(w, [1.0 - 0.1 * 1.5, -2.0 - 0.1 * 0.0, -0.1]);
    }

    #[test]
    fn adagrad_elementwise() {
        let mut p = params(OptKind::Adagrad);
        p.initial_accumulator = 1.0;
        let mut w = [0.0f32; 3];
        let mut st = [0.0f32; 3];
        init_state(&p, &w, &mut st, RowScalars { acc: None, step: None });
        assert_eq!(st, [1.0; 3]);
        apply(&p, &mut w, &[3.0, 0.0, -1.0], &mut st, RowScalars { acc: None, step: None });
        assert_eq!(st, [10.0, 1.0, 2.0]);
        let e = 1e-6;
        assert!((w[0] - (-0.1 * 3.0 / (10f32.sqrt() + 1e-8))).abs() < e);
        assert_eq!(w[1], 0.0);
        assert!((w[2] - (0.1 / (2f32.sqrt() + 1e-8))).abs() < e);
    }

    #[test]
    fn rowwise_adagrad() {
        let p = params(OptKind::RowwiseAdagrad);
        let mut w = [0.0f32; 3];
        let mut acc = 0.0f32;
        apply(&p, &mut w, &[1.0, 2.0, 2.0], &mut [], RowScalars { acc: Some(&mut acc), step: None });
        assert!((acc - 3.0).abs() < 1e-6); // mean of squares = 9/3
        let s = 0.1 / (3f32.sqrt() + 1e-8);
        assert!((w[1] + 2.0 * s).abs() < 1e-6);
    }

    #[test]
    fn adam_bias_correction_first_step() {
        let p = params(OptKind::Adam);
        let mut w = [0.0f32; 3];
        let mut st = [0.0f32; 6];
        let mut t = 0u32;
        apply(&p, &mut w, &[0.5, -2.0, 0.0], &mut st, RowScalars { acc: None, step: Some(&mut t) });
        assert_eq!(t, 1);
        // First Adam step moves each coordinate by ~lr*sign(g).
        assert!((w[0] + 0.1).abs() < 1e-5);
        assert!((w[1] - 0.1).abs() < 1e-5);
        assert_eq!(w[2], 0.0);
    }

    #[test]
    fn ftrl_matches_closed_form_and_init() {
        let mut p = params(OptKind::Ftrl);
        p.ftrl_alpha = 0.5;
        p.ftrl_beta = 1.0;
        p.ftrl_l1 = 0.01;
        p.ftrl_l2 = 0.1;
        // init: z reproduces w
        let w0 = [0.02f32, -0.03, 0.0];
        let mut st = [0.0f32; 6];
        init_state(&p, &w0, &mut st, RowScalars { acc: None, step: None });
        for i in 0..3 {
            assert!((ftrl_weight(&p, st[i], st[3 + i]) - w0[i]).abs() < 1e-7);
        }
        let mut w = w0;
        apply(&p, &mut w, &[1.0, 0.0, -0.5], &mut st, RowScalars { acc: None, step: None });
        // Coordinate 0 by hand.
        let z0 = -(0.02 * (1.0 / 0.5 + 0.1) + 0.01);
        let sigma = (1.0f32.sqrt() - 0.0) / 0.5;
        let z1 = z0 + 1.0 - sigma * 0.02;
        let w1 = -(z1 - z1.signum() * 0.01) / ((1.0 + 1.0) / 0.5 + 0.1);
        assert!((w[0] - w1).abs() < 1e-6, "{} vs {}", w[0], w1);
        assert!((w[1] - w0[1]).abs() < 1e-7);
    }

    #[test]
    fn weight_bound_and_finite() {
        let mut p = params(OptKind::Sgd);
        p.bound = Some(0.05);
        let mut w = [0.0f32; 3];
        apply(&p, &mut w, &[-10.0, 10.0, 0.1], &mut [], RowScalars { acc: None, step: None });
        assert_eq!(&w[..2], &[0.05, -0.05]);
        assert!((w[2] + 0.01).abs() < 1e-7);
        assert!(all_finite(&[0.0, 1.0, -3.0]));
        assert!(!all_finite(&[0.0, f32::NAN]));
        assert!(!all_finite(&[f32::INFINITY]));
        assert!(!all_finite(&[f32::NEG_INFINITY]));
    }
}
