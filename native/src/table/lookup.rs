//! A shard's batched lookup: found rows are copied out (their LRU tick refreshed and
//! their TTL checked where the table keeps them); the missing ids are admitted (or not),
//! inserted with their initial values, or read as zeros.

use crate::config::AdmissionKind;
use crate::elem::{Elem, OutElem};
use crate::hash::admission_draw;
use crate::index::EMPTY;
use crate::mem::{prefetch, SendPtr};

use super::{Ctx, Group, Local, Shard};

impl<W: Elem> Shard<W> {
    /// Admission decision for a missing id seen `m` times in a lookup batch.
    fn admit(ctx: &Ctx, id: u64, m: u32) -> bool {
        match ctx.cfg.admission {
            AdmissionKind::Off => true,
            AdmissionKind::Probability => admission_draw(ctx.cfg.seed, id) < ctx.cfg.admission_probability,
            AdmissionKind::Threshold => match ctx.sketch {
                Some(sk) => sk.add(id, m) >= ctx.cfg.admission_threshold,
                None => true,
            },
        }
    }

    /// Batched lookup of a group of batch positions; writes rows into `out`.
    pub fn lookup<O: OutElem>(&mut self, ctx: &Ctx, g: &Group, out: SendPtr<O>, create: bool, local: &mut Local) {
        if self.tier.is_some() {
            let n = self.fault_in(ctx, g.id);
            if let Some(t) = &self.tier {
                t.lookup_hits.fetch_add(n as u64, std::sync::atomic::Ordering::Relaxed);
            }
        }
        self.lookup_resident(ctx, g, out, create, local);
        self.spill_over_budget(ctx.layout);
    }

    /// `lookup` once a disk tier's rows of the group are resident.
    fn lookup_resident<O: OutElem>(&mut self, ctx: &Ctx, g: &Group, out: SendPtr<O>, create: bool, local: &mut Local) {
        let l = ctx.layout;
        let dim = l.dim;
        let ttl = ctx.ttl_enabled();
        let out_lines = (dim * std::mem::size_of::<O>()).div_ceil(64).min(16);
        let mut missing: Vec<u32> = Vec::new(); // group indices
        let mut found: Vec<u32> = Vec::new(); // (only with TTL/LRU) group index -> slot
        let bookkeeping = ttl || l.has_lru;
        if bookkeeping {
            found.resize(g.len(), EMPTY);
        }
        self.pipeline(
            l,
            g,
            |k| {
                // Output rows are written in shard order (scattered): prefetch them.
                let d = out.0.wrapping_add(g.pos[k] as usize * dim) as *const u8;
                for line in 0..out_lines {
                    prefetch(d.wrapping_add(line * 64));
                }
            },
            |sh, k, s| {
                if s == EMPTY {
                    missing.push(k as u32);
                } else if bookkeeping {
                    found[k] = s;
                } else {
                    let pos = g.pos[k] as usize;
                    // SAFETY: pos < n_ids and rows of distinct positions are disjoint.
                    let dst = unsafe { std::slice::from_raw_parts_mut(out.0.add(pos * dim), dim) };
                    O::write_row(sh.w_row(l, s), dst);
                }
            },
        );
        if bookkeeping {
            // Slow path for tables with TTL / LRU bookkeeping (mutates the shard).
            for (k, &s) in found.iter().enumerate() {
                if s == EMPTY {
                    continue;
                }
                if ttl {
                    if !self.is_occupied(l, s) || self.id_at(l, s) != g.id[k] {
                        // removed as expired earlier in this batch
                        missing.push(k as u32);
                        continue;
                    }
                    if self.expired(ctx, s) {
                        self.remove_slot(l, s);
                        local.expired += 1;
                        missing.push(k as u32);
                        continue;
                    }
                }
                self.touch(l, s);
                let pos = g.pos[k] as usize;
                // SAFETY: as above.
                let dst = unsafe { std::slice::from_raw_parts_mut(out.0.add(pos * dim), dim) };
                O::write_row(self.w_row(l, s), dst);
            }
        }
        self.handle_missing(ctx, g, missing, out, create, local);
    }

    /// Admission / insertion for the ids of a lookup group that have no row
    /// (`missing`: group indices). Writes their output rows (zeros if not admitted).
    pub fn handle_missing<O: OutElem>(
        &mut self,
        ctx: &Ctx,
        g: &Group,
        missing: Vec<u32>,
        out: SendPtr<O>,
        create: bool,
        local: &mut Local,
    ) {
        let l = ctx.layout;
        let dim = l.dim;
        if missing.is_empty() {
            return;
        }
        let zero_row = |pos: usize| {
            // SAFETY: as above.
            let dst = unsafe { std::slice::from_raw_parts_mut(out.0.add(pos * dim), dim) };
            dst.fill(O::default());
        };
        if !create {
            for &k in &missing {
                zero_row(g.pos[k as usize] as usize);
            }
            return;
        }
        // Group the missing positions by id so that every occurrence of an id
        // in this batch gets the same answer. Entries: (id, group index).
        let mut keyed: Vec<(u64, u32)> = missing.iter().map(|&k| (g.id[k as usize], k)).collect();
        keyed.sort_unstable();
        let mut tmp = vec![0f32; dim];
        let mut i = 0;
        while i < keyed.len() {
            let id = keyed[i].0;
            let mut j = i + 1;
            while j < keyed.len() && keyed[j].0 == id {
                j += 1;
            }
            let h = g.hash[keyed[i].1 as usize];
            if let Some(s) = self.find(l, id, h) {
                // inserted concurrently since this batch was scanned
                for &(_, k) in &keyed[i..j] {
                    let p = g.pos[k as usize] as usize;
                    // SAFETY: as above.
                    let dst = unsafe { std::slice::from_raw_parts_mut(out.get().add(p * dim), dim) };
                    O::write_row(self.w_row(l, s), dst);
                }
                i = j;
                continue;
            }
            let admitted = Self::admit(ctx, id, (j - i) as u32);
            let slot = if admitted { self.alloc(ctx, id, h, local) } else { None };
            match slot {
                Some(s) => {
                    local.admitted += 1;
                    self.init_row(ctx, s, id, &mut tmp);
                    for &(_, k) in &keyed[i..j] {
                        let p = g.pos[k as usize] as usize;
                        // SAFETY: as above.
                        let dst = unsafe { std::slice::from_raw_parts_mut(out.0.add(p * dim), dim) };
                        O::write_row(self.w_row(l, s), dst);
                    }
                }
                None => {
                    local.not_admitted += 1;
                    for &(_, k) in &keyed[i..j] {
                        zero_row(g.pos[k as usize] as usize);
                    }
                }
            }
            i = j;
        }
    }
}
