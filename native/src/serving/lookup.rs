//! A request's lookup, on the calling thread: one ID at a time.

use super::Part;
use crate::elem::Elem;
use crate::hash::shard_of;
use crate::mem::Pod;

/// Look `ids` up in a table's `parts` (one per training shard of `shards`) into `out`
/// (`ids.len() * dim` f32); an ID not present reads as zeros. Returns the misses.
pub(super) fn lookup_ids<W: Elem + Pod>(
    parts: &[Part<W>],
    shards: u32,
    ids: &[u64],
    out: &mut [f32],
    dim: usize,
) -> u64 {
    let mut misses = 0;
    for (&id, dst) in ids.iter().zip(out.chunks_exact_mut(dim)) {
        let p = if shards == 1 { 0 } else { shard_of(id, shards) as usize };
        match parts[p].get(id) {
            Some(row) => W::load_row(row, dst),
            None => {
                dst.fill(0.0);
                misses += 1;
            }
        }
    }
    misses
}
