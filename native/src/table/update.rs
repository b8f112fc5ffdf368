//! A shard's writes: the batched optimizer update (gradients of duplicate ids summed,
//! ids without a row dropped, non-finite sums skipped) and `set_row`.

use crate::config::{OptKind, Result, StoreError};
use crate::elem::Elem;
use crate::hash::internal_hash;
use crate::index::EMPTY;
use crate::mem::prefetch;
use crate::optim::{self, RowScalars};

use super::{Ctx, Group, Local, Shard};

impl<W: Elem> Shard<W> {
    /// Batched optimizer update. Duplicate ids are summed; ids without a row
    /// are dropped (counted); rows with a non-finite summed gradient are skipped.
    pub fn update(&mut self, ctx: &Ctx, g: &Group, grads: &[f32], local: &mut Local) {
        if self.tier.is_some() {
            self.fault_in(ctx, g.id);
            self.update_resident(ctx, g, grads, local);
            self.spill_over_budget(ctx.layout);
        } else {
            self.update_resident(ctx, g, grads, local);
        }
    }

    /// `update` once a disk tier's rows of the group are resident.
    fn update_resident(&mut self, ctx: &Ctx, g: &Group, grads: &[f32], local: &mut Local) {
        let l = ctx.layout;
        let dim = l.dim;
        let mut pairs: Vec<u64> = Vec::with_capacity(g.len());
        let mut dropped = 0;
        self.pipeline(
            l,
            g,
            |_| {},
            |_, k, s| {
                if s == EMPTY {
                    dropped += 1;
                } else {
                    pairs.push(((s as u64) << 32) | g.pos[k] as u64);
                }
            },
        );
        local.dropped += dropped;
        pairs.sort_unstable();
        let mut tmp = vec![0f32; dim];
        let mut i = 0;
        let n = pairs.len();
        while i < n {
            let slot = (pairs[i] >> 32) as u32;
            let mut j = i + 1;
            while j < n && (pairs[j] >> 32) as u32 == slot {
                j += 1;
            }
            // Prefetch the next group's row and gradient.
            if j < n {
                let ns = (pairs[j] >> 32) as u32;
                let np = (pairs[j] as u32) as usize;
                self.prefetch_rec(l, ns);
                let gp = grads.as_ptr().wrapping_add(np * dim) as *const u8;
                for line in 0..(dim * 4).div_ceil(64).min(8) {
                    prefetch(gp.wrapping_add(line * 64));
                }
            }
            let p0 = (pairs[i] as u32) as usize;
            let g: &[f32] = if j - i == 1 {
                &grads[p0 * dim..(p0 + 1) * dim]
            } else {
                tmp.copy_from_slice(&grads[p0 * dim..(p0 + 1) * dim]);
                for &pp in &pairs[i + 1..j] {
                    let p = (pp as u32) as usize;
                    for (t, x) in tmp.iter_mut().zip(&grads[p * dim..(p + 1) * dim]) {
                        *t += *x;
                    }
                }
                &tmp
            };
            i = j;
            if !optim::all_finite(g) {
                local.nan += 1;
                continue;
            }
            let (now, batch) = (ctx.now_secs, ctx.batch);
            let version = self.version_word(ctx.version);
            let r = self.row_mut(l, slot);
            optim::apply(ctx.opt, r.w, g, r.state, RowScalars { acc: r.acc, step: r.step });
            *r.version = version;
            if let Some(t) = r.utime {
                *t = now;
            }
            if let Some(t) = r.utick {
                *t = batch;
            }
            // LRU recency is refreshed by lookups only (a row is always looked
            // up before it is updated).
            local.updated += 1;
        }
    }

    /// Overwrite (or create, bypassing admission) the weights of `id`.
    pub fn set_row(&mut self, ctx: &Ctx, id: u64, values: &[f32], local: &mut Local) -> Result<()> {
        if self.tier.is_none() {
            return self.set_row_resident(ctx, id, values, local);
        }
        self.fault_in(ctx, &[id]);
        let r = self.set_row_resident(ctx, id, values, local);
        self.spill_over_budget(ctx.layout);
        r
    }

    fn set_row_resident(&mut self, ctx: &Ctx, id: u64, values: &[f32], local: &mut Local) -> Result<()> {
        let l = ctx.layout;
        let h = internal_hash(id);
        let (slot, fresh) = match self.find(l, id, h) {
            Some(s) => (s, false),
            None => match self.alloc(ctx, id, h, local) {
                Some(s) => (s, true),
                None => return Err(StoreError::Value("internal shard is full".into())),
            },
        };
        if fresh {
            local.admitted += 1;
        }
        let (now, batch) = (ctx.now_secs, ctx.batch.wrapping_add(1));
        let version = self.version_word(ctx.version);
        let opt = ctx.opt;
        let r = self.row_mut(l, slot);
        W::store_row(values, r.w);
        if fresh {
            optim::init_state(opt, r.w, r.state, RowScalars { acc: r.acc, step: r.step });
        } else if opt.kind == OptKind::Ftrl {
            let (z, n) = r.state.split_at_mut(l.dim);
            for i in 0..l.dim {
                z[i] = optim::ftrl_z_for_weight(opt, r.w[i].to_f32(), n[i]);
            }
        }
        *r.version = version;
        if let Some(t) = r.utime {
            *t = now;
        }
        if let Some(t) = r.utick {
            *t = batch;
        }
        self.touch(l, slot);
        Ok(())
    }
}
