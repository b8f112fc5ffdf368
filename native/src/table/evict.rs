//! Eviction and TTL: which row leaves a full shard that needs a slot (exact LRU while the
//! shard is small, else the oldest of a random sample; rows past their TTL first), whether
//! a row is past its TTL, and the eager sweep of `expire`. Rows leave a shard only through
//! `Shard::remove_slot` (resident rows) and `Tier::remove_at` (cold rows, see spill.rs).

use crate::elem::Elem;

use super::{Ctx, Local, Shard};

/// Rows per shard above which eviction samples instead of scanning.
pub const EXACT_LRU_MAX_ROWS: usize = 64;
/// Number of candidates sampled per eviction.
pub const EVICTION_SAMPLES: usize = 16;

impl<W: Elem> Shard<W> {
    /// Is a row with these last-update stamps past its TTL?
    #[inline(always)]
    pub(super) fn expired_stamps(ctx: &Ctx, utime: u32, utick: u32) -> bool {
        if let Some(ttl) = ctx.cfg.ttl_seconds {
            let age = ctx.now_secs.wrapping_sub(utime) as i32;
            if age as i64 > ttl as i64 {
                return true;
            }
        }
        if let Some(ttl) = ctx.cfg.ttl_updates {
            let age = ctx.batch_now.wrapping_sub(utick) as i32;
            if age as i64 >= ttl as i64 {
                return true;
            }
        }
        false
    }

    /// Is the row in `slot` past its TTL?
    #[inline(always)]
    pub(super) fn expired(&self, ctx: &Ctx, slot: u32) -> bool {
        let (c, o) = ctx.layout.loc(slot);
        let ch = &self.chunks[c];
        Self::expired_stamps(ctx, ch.utime.get(o).copied().unwrap_or(0), ch.utick.get(o).copied().unwrap_or(0))
    }

    /// Evict one row by (approximate) LRU; expired rows are preferred. A shard of at most
    /// `EXACT_LRU_MAX_ROWS` rows evicts the oldest expired row, else the oldest row (LRU
    /// ticks are unique, so the choice does not depend on where rows are: cold rows of a
    /// disk tier are candidates like resident ones). A larger one samples
    /// `EVICTION_SAMPLES` rows (resident slots and cold rows alike) and takes the first
    /// expired one, else the oldest.
    pub(super) fn evict_one(&mut self, ctx: &Ctx, local: &mut Local) -> bool {
        let total = self.len();
        if total == 0 {
            return false;
        }
        let l = ctx.layout;
        let ttl = ctx.ttl_enabled();
        let cold = self.cold_rows();
        // (expired, age, victim): victim < high is a slot, else high + a cold row's index.
        let mut best: Option<(bool, u32, usize)> = None;
        let key = |sh: &Self, v: usize| -> (bool, u32) {
            if v < sh.high {
                let s = v as u32;
                let (c, o) = l.loc(s);
                let age = if l.has_lru { sh.tick.wrapping_sub(sh.chunks[c].lru[o]) } else { 0 };
                (ttl && sh.expired(ctx, s), age)
            } else {
                let c = sh.tier.as_ref().expect("tier").at(v - sh.high);
                (ttl && Self::expired_stamps(ctx, c.utime, c.utick), sh.tick.wrapping_sub(c.lru))
            }
        };
        if total <= EXACT_LRU_MAX_ROWS {
            let mut consider = |sh: &Self, v: usize| {
                let (e, a) = key(sh, v);
                match best {
                    Some((be, ba, _)) if (be, ba) >= (e, a) => {}
                    _ => best = Some((e, a, v)),
                }
            };
            for (c, ch) in self.chunks.iter().enumerate() {
                for o in 0..ch.len() {
                    if ch.occupied(o) {
                        consider(self, (c << l.chunk_shift) | o);
                    }
                }
            }
            for i in 0..cold {
                consider(self, self.high + i);
            }
        } else {
            let mut found = 0;
            let mut tries = 0;
            let span = (self.high + cold) as u64;
            while found < EVICTION_SAMPLES && tries < EVICTION_SAMPLES * 8 {
                tries += 1;
                let v = (self.next_rand() % span) as usize;
                if v < self.high && !self.is_occupied(l, v as u32) {
                    continue;
                }
                found += 1;
                let (e, a) = key(self, v);
                if e {
                    best = Some((true, a, v));
                    break;
                }
                match best {
                    Some((_, ba, _)) if ba >= a => {}
                    _ => best = Some((false, a, v)),
                }
            }
        }
        match best {
            Some((expired, _, v)) => {
                if v < self.high {
                    self.remove_slot(l, v as u32);
                } else {
                    self.tier.as_mut().expect("tier").remove_at(v - self.high);
                }
                if expired {
                    local.expired += 1;
                } else {
                    local.evicted += 1;
                }
                true
            }
            None => false,
        }
    }

    pub fn expire(&mut self, ctx: &Ctx, local: &mut Local) {
        let l = ctx.layout;
        let mut victims = Vec::new();
        for (c, ch) in self.chunks.iter().enumerate() {
            for o in 0..ch.len() {
                if ch.occupied(o) {
                    let s = ((c << l.chunk_shift) | o) as u32;
                    if self.expired(ctx, s) {
                        victims.push(s);
                    }
                }
            }
        }
        for s in victims {
            self.remove_slot(l, s);
            local.expired += 1;
        }
        local.expired += self.expire_cold(ctx);
    }
}
