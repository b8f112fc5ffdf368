//! Eviction and TTL: which row leaves a full shard that needs a slot (exact LRU while the
//! shard is small, else the oldest of a random sample; rows past their TTL first), whether
//! a row is past its TTL, and the eager sweep of `expire`. Rows leave a shard only through
//! `Shard::remove_slot`.

use crate::elem::Elem;

use super::{Ctx, Local, Shard};

/// Rows per shard above which eviction samples instead of scanning.
pub const EXACT_LRU_MAX_ROWS: usize = 64;
/// Number of candidates sampled per eviction.
pub const EVICTION_SAMPLES: usize = 16;

impl<W: Elem> Shard<W> {
    /// Is the row in `slot` past its TTL?
    #[inline(always)]
    pub(super) fn expired(&self, ctx: &Ctx, slot: u32) -> bool {
        let (c, o) = ctx.layout.loc(slot);
        let ch = &self.chunks[c];
        if let Some(ttl) = ctx.cfg.ttl_seconds {
            let age = ctx.now_secs.wrapping_sub(ch.utime[o]) as i32;
            if age as i64 > ttl as i64 {
                return true;
            }
        }
        if let Some(ttl) = ctx.cfg.ttl_updates {
            let age = ctx.batch_now.wrapping_sub(ch.utick[o]) as i32;
            if age as i64 >= ttl as i64 {
                return true;
            }
        }
        false
    }

    /// Evict one row by (approximate) LRU; expired rows are preferred.
    pub(super) fn evict_one(&mut self, ctx: &Ctx, local: &mut Local) -> bool {
        if self.rows == 0 {
            return false;
        }
        let l = ctx.layout;
        let ttl = ctx.ttl_enabled();
        let mut best: Option<(u32, u32)> = None; // (age, slot)
        let mut consider = |sh: &Self, s: u32| -> bool {
            if ttl && sh.expired(ctx, s) {
                best = Some((u32::MAX, s));
                return true;
            }
            let (c, o) = l.loc(s);
            let age = if l.has_lru { sh.tick.wrapping_sub(sh.chunks[c].lru[o]) } else { 0 };
            match best {
                Some((a, _)) if a >= age => {}
                _ => best = Some((age, s)),
            }
            false
        };
        if self.rows <= EXACT_LRU_MAX_ROWS {
            'scan: for (c, ch) in self.chunks.iter().enumerate() {
                for o in 0..ch.len() {
                    if ch.occupied(o) {
                        let s = ((c << l.chunk_shift) | o) as u32;
                        if consider(self, s) {
                            break 'scan;
                        }
                    }
                }
            }
        } else {
            let mut found = 0;
            let mut tries = 0;
            while found < EVICTION_SAMPLES && tries < EVICTION_SAMPLES * 8 {
                tries += 1;
                let s = (self.next_rand() % self.high as u64) as u32;
                if !self.is_occupied(l, s) {
                    continue;
                }
                found += 1;
                if consider(self, s) {
                    break;
                }
            }
        }
        match best {
            Some((age, s)) => {
                self.remove_slot(l, s);
                if age == u32::MAX && ttl {
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
    }
}
