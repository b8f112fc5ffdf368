//! The IDs a forget removed (`ForgetMask`, trillium/job/record.py), masked in the training
//! batches written before it. A later attempt that recovers from an older checkpoint replays those
//! batches under the same batch_ids: in them a forgotten ID is asked of no PS shard (a training
//! lookup would create its row again), reads as zeros (as an unknown ID does in evaluation), and
//! sends no gradient. In a batch after the mask's `through_batch` the same ID is new data, trained
//! as any new ID. Evaluation lookups are not masked: they create no rows, and their batch_ids
//! count the eval topic's batches, not the training batches a mask's `through_batch` counts.

use std::collections::HashMap;

/// A forget's mask: its `through_batch`, and per table the IDs it names.
pub type Mask = (i64, Vec<(String, Vec<u64>)>);

/// A job's masks, per table: each forgotten ID with the newest batch it is masked in (the
/// largest `through_batch` of the masks that name it): ID x is masked in batch b iff that is >= b.
#[derive(Default)]
pub struct Forgotten {
    /// No later batch is masked.
    through: i64,
    tables: HashMap<String, HashMap<u64, i64>>,
}

impl Forgotten {
    /// From the masks as (through_batch, per table its IDs), in any order.
    pub fn new(masks: &[Mask]) -> Self {
        let mut tables: HashMap<String, HashMap<u64, i64>> = HashMap::new();
        for (through, named) in masks {
            for (table, ids) in named {
                let newest = tables.entry(table.clone()).or_default();
                for &id in ids {
                    let at = newest.entry(id).or_insert(*through);
                    *at = (*at).max(*through);
                }
            }
        }
        tables.retain(|_, ids| !ids.is_empty());
        let through = masks.iter().map(|(t, _)| *t).max().unwrap_or(-1);
        Self { through, tables }
    }

    /// Whether any ID is masked in batch `batch_id`.
    pub fn masks_any(&self, batch_id: i64) -> bool {
        batch_id <= self.through && !self.tables.is_empty()
    }

    /// Whether `id` of `table` is masked in batch `batch_id`.
    pub fn masked(&self, table: &str, id: u64, batch_id: i64) -> bool {
        self.tables.get(table).and_then(|ids| ids.get(&id)).is_some_and(|&through| through >= batch_id)
    }
}

#[cfg(test)]
mod tests {
    use std::collections::HashSet;

    use super::*;

    /// The IDs of `table` masked in `batch_id`: those of every mask through it or later.
    fn oracle(masks: &[Mask], table: &str, batch_id: i64) -> HashSet<u64> {
        masks
            .iter()
            .filter(|(through, _)| *through >= batch_id)
            .flat_map(|(_, named)| named.iter().filter(|(t, _)| t == table).flat_map(|(_, ids)| ids.iter().copied()))
            .collect()
    }

    #[test]
    fn an_id_is_masked_through_the_newest_batch_of_a_mask_naming_it() {
        let mut rng = crate::hash::SplitMix64::new(11);
        for _ in 0..40 {
            let masks: Vec<Mask> = (0..1 + rng.next() % 4)
                .map(|_| {
                    let mut named = Vec::new();
                    for table in ["a", "b", "c"] {
                        if rng.next() % 10 < 7 {
                            let n = rng.next() % 30;
                            named.push((table.to_string(), (0..n).map(|_| rng.next() % 60).collect()));
                        }
                    }
                    ((rng.next() % 40) as i64, named)
                })
                .collect();
            let forgotten = Forgotten::new(&masks);
            for table in ["a", "b", "c", "z"] {
                for batch_id in -1..45 {
                    let expected = oracle(&masks, table, batch_id);
                    for id in 0..70 {
                        assert_eq!(forgotten.masked(table, id, batch_id), expected.contains(&id), "{table} {batch_id}");
                    }
                    if !expected.is_empty() {
                        assert!(forgotten.masks_any(batch_id));
                    }
                }
            }
        }
        assert!(!Forgotten::new(&[]).masks_any(0));
        let extremes = Forgotten::new(&[(3, vec![("a".into(), vec![1 << 63, u64::MAX])])]);
        assert!(extremes.masked("a", u64::MAX, 3) && !extremes.masked("a", u64::MAX, 4));
    }
}
