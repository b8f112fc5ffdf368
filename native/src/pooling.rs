//! The embedding worker's per-batch work (issue 11), for a batch of B samples and the job's
//! feature slots (each reading one key of the batch's `KeyedIds` and looking up one table):
//!
//! * `Layout::plan`: dedup each table's IDs (slots sharing a table share rows), route the
//!   unique IDs to PS shards with `shard_of`, and keep where each ID occurrence goes.
//! * `Plan::pool`: the looked-up rows (per table, in plan order) -> one `[B, width]` array
//!   holding the pooled slots side by side (sum or mean over each sample's IDs), plus one
//!   `[B, max_len, dim]` array and a `[B, max_len]` mask per sequence slot.
//! * `Plan::scatter`: the gradients of that same layout -> one summed gradient per unique
//!   ID and table, in plan order.
//!
//! Plan order: a table's unique IDs are grouped by owning shard (shard 0's first; within a
//! shard, in order of first appearance), so each shard's IDs, looked-up rows and gradients
//! are contiguous ranges `offsets[s]..offsets[s + 1]`: a request or message per shard needs
//! no gather. Sums run in ID-occurrence order from zero, in float32, as `index_add_` did.

use crate::config::{Result, StoreError};
use crate::hash::shard_of;

/// How a slot turns a sample's rows into the model's input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pooling {
    Sum,
    Mean,
    /// The rows in order, padded with zeros to `max_len`.
    Sequence {
        max_len: usize,
    },
}

#[derive(Clone, Debug)]
pub struct Slot {
    pub name: String,
    pub table: usize,
    pub dim: usize,
    pub pooling: Pooling,
    /// First column in the pooled output, or index among the sequence slots.
    pub out: usize,
}

/// The job's slots over its tables and PS shards; built once per job.
#[derive(Debug)]
pub struct Layout {
    /// (name, dim) of each table some slot reads, in order of first use.
    pub tables: Vec<(String, usize)>,
    pub slots: Vec<Slot>,
    pub num_shards: u32,
    /// Columns of the pooled output: the dims of the pooled slots, added up.
    pub width: usize,
}

/// Where one batch's IDs go; see the module documentation.
#[derive(Debug)]
pub struct Plan {
    pub batch: usize,
    /// Per table: the unique IDs, grouped by owning shard.
    pub ids: Vec<Vec<u64>>,
    /// Per table: shard `s` owns `ids[offsets[s]..offsets[s + 1]]`.
    pub offsets: Vec<Vec<usize>>,
    /// Per slot: sample `i`'s occurrences are `inverse[starts[i]..starts[i + 1]]` (u32, like
    /// `inverse`: a plan waits in memory until its gradients come back).
    pub starts: Vec<Vec<u32>>,
    /// Per ID occurrence, slot after slot: the index of its ID in its table's `ids`.
    pub inverse: Vec<u32>,
}

impl Layout {
    /// `slots`: (name, table, pooling) in the model's order; `dim_of`: a table's dim by name.
    pub fn new(
        slots: &[(String, String, Pooling)],
        dim_of: impl Fn(&str) -> Option<usize>,
        num_shards: u32,
    ) -> Result<Layout> {
        if num_shards == 0 {
            return Err(StoreError::Value("num_shards must be >= 1".into()));
        }
        let mut tables: Vec<(String, usize)> = Vec::new();
        let (mut width, mut num_sequences) = (0, 0);
        let mut out = Vec::with_capacity(slots.len());
        for (name, table, pooling) in slots {
            if out.iter().any(|s: &Slot| &s.name == name) {
                return Err(StoreError::Value(format!("slot {name:?} is given twice")));
            }
            let t = match tables.iter().position(|(n, _)| n == table) {
                Some(t) => t,
                None => {
                    let dim = dim_of(table)
                        .ok_or_else(|| StoreError::Key(format!("slot {name:?} reads unknown table {table:?}")))?;
                    if dim == 0 {
                        return Err(StoreError::Value(format!("table {table:?} has dim 0")));
                    }
                    tables.push((table.clone(), dim));
                    tables.len() - 1
                }
            };
            let dim = tables[t].1;
            let at = match pooling {
                Pooling::Sequence { max_len: 0 } => {
                    return Err(StoreError::Value(format!("slot {name:?}: max_len must be >= 1")))
                }
                Pooling::Sequence { .. } => {
                    num_sequences += 1;
                    num_sequences - 1
                }
                Pooling::Sum | Pooling::Mean => {
                    width += dim;
                    width - dim
                }
            };
            out.push(Slot { name: name.clone(), table: t, dim, pooling: *pooling, out: at });
        }
        Ok(Layout { tables, slots: out, num_shards, width })
    }

    /// Plan a batch given as `KeyedIds` arrays: `values` key-major, `lengths[k * B + i]`
    /// IDs of sample `i` under key `keys[k]`.
    pub fn plan(&self, keys: &[String], values: &[u64], lengths: &[i32]) -> Result<Plan> {
        let batch = match keys.len() {
            0 => return Err(StoreError::Value("keys must name at least one feature slot".into())),
            k if !lengths.len().is_multiple_of(k) => {
                return Err(StoreError::Value(format!(
                    "len(lengths)={} is not a multiple of the {k} keys",
                    lengths.len()
                )))
            }
            k => lengths.len() / k,
        };
        if let Some(j) = lengths.iter().position(|&l| l < 0) {
            return Err(StoreError::Value(format!("lengths[{j}] is negative ({})", lengths[j])));
        }
        // Where each key's values begin.
        let mut key_base = Vec::with_capacity(keys.len() + 1);
        key_base.push(0usize);
        for chunk in lengths.chunks_exact(batch.max(1)).take(keys.len()) {
            let n: usize = chunk.iter().map(|&l| l as usize).sum();
            key_base.push(key_base[key_base.len() - 1] + n);
        }
        key_base.resize(keys.len() + 1, 0); // an empty batch: no chunks
        if values.len() > u32::MAX as usize {
            return Err(StoreError::Value(format!("a batch holds at most 2**32 - 1 IDs, got {}", values.len())));
        }
        if key_base[keys.len()] != values.len() {
            return Err(StoreError::Value(format!(
                "lengths sum to {} but there are {} values",
                key_base[keys.len()],
                values.len()
            )));
        }
        // Each slot's occurrences, slot after slot, as CSR offsets into `inverse`.
        let mut key_of = Vec::with_capacity(self.slots.len());
        let mut starts = Vec::with_capacity(self.slots.len());
        let mut base = 0;
        for s in &self.slots {
            let k = keys
                .iter()
                .position(|k| *k == s.name)
                .ok_or_else(|| StoreError::Key(format!("the batch has no slot {:?}; its keys are {keys:?}", s.name)))?;
            let lens = &lengths[k * batch..(k + 1) * batch];
            if let Pooling::Sequence { max_len } = s.pooling {
                if let Some(i) = lens.iter().position(|&l| l as usize > max_len) {
                    return Err(StoreError::Value(format!(
                        "slot {:?}: sample {i} has {} IDs, more than max_len={max_len}",
                        s.name, lens[i]
                    )));
                }
            }
            let mut st = Vec::with_capacity(batch + 1);
            st.push(base);
            for &l in lens {
                base += l as u32;
                st.push(base);
            }
            key_of.push(k);
            starts.push(st);
        }
        let mut inverse = vec![0u32; base as usize];
        let mut ids = Vec::with_capacity(self.tables.len());
        let mut offsets = Vec::with_capacity(self.tables.len());
        let n = self.num_shards as usize;
        let members: Vec<Vec<usize>> = (0..self.tables.len())
            .map(|t| (0..self.slots.len()).filter(|&s| self.slots[s].table == t).collect())
            .collect();
        let occurrences: Vec<usize> =
            members.iter().map(|m| m.iter().map(|&s| (starts[s][batch] - starts[s][0]) as usize).sum()).collect();
        let bits_of = |occ: usize| (2 * occ).max(16).next_power_of_two().trailing_zeros();
        // Open addressing over each table's unique IDs (load <= 1/2). A bucket holds the ID, its
        // index among the unique IDs and the generation (table + 1) that wrote it: buckets of
        // other tables read as empty, so one allocation serves every table without clearing.
        let mut index: Vec<(u64, u32, u32)> =
            vec![(0, 0, 0); 1 << bits_of(occurrences.iter().copied().max().unwrap_or(0))];
        for t in 0..self.tables.len() {
            let (members, gen, bits) = (&members[t], t as u32 + 1, bits_of(occurrences[t]));
            let mask = (1usize << bits) - 1;
            let occurrences = occurrences[t];
            let mut uniq: Vec<u64> = Vec::with_capacity(occurrences);
            let mut owner: Vec<u32> = Vec::with_capacity(occurrences);
            let mut off = vec![0usize; n + 1];
            for &s in members {
                let vals = &values[key_base[key_of[s]]..key_base[key_of[s] + 1]];
                for (o, &id) in inverse[starts[s][0] as usize..starts[s][batch] as usize].iter_mut().zip(vals) {
                    // Fibonacci hashing: the top bits of one multiply.
                    let mut h = (id.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> (64 - bits)) as usize;
                    *o = loop {
                        let (key, u, g) = index[h];
                        if g != gen {
                            let u = uniq.len() as u32;
                            index[h] = (id, u, gen);
                            uniq.push(id);
                            let sh = shard_of(id, self.num_shards);
                            owner.push(sh);
                            off[sh as usize + 1] += 1;
                            break u;
                        }
                        if key == id {
                            break u;
                        }
                        h = (h + 1) & mask;
                    };
                }
            }
            for s in 0..n {
                off[s + 1] += off[s];
            }
            // Group the unique IDs by owning shard (a stable counting sort).
            if n > 1 {
                let mut fill = off.clone();
                let mut new_pos = vec![0u32; uniq.len()];
                let mut sorted = vec![0u64; uniq.len()];
                for (u, &o) in owner.iter().enumerate() {
                    let f = &mut fill[o as usize];
                    new_pos[u] = *f as u32;
                    sorted[*f] = uniq[u];
                    *f += 1;
                }
                for &s in members {
                    for x in &mut inverse[starts[s][0] as usize..starts[s][batch] as usize] {
                        *x = new_pos[*x as usize];
                    }
                }
                uniq = sorted;
            }
            ids.push(uniq);
            offsets.push(off);
        }
        Ok(Plan { batch, ids, offsets, starts, inverse })
    }
}

impl Plan {
    #[inline(always)]
    fn occurrences(&self, s: usize, i: usize) -> &[u32] {
        &self.inverse[self.starts[s][i] as usize..self.starts[s][i + 1] as usize]
    }

    /// Pool the rows (per table, `[ids[t].len(), dim]` in plan order) into `pooled`
    /// (`[B, width]`, every element written) and `seqs` (per sequence slot, `[B, max_len,
    /// dim]` values and `[B, max_len]` mask, both zero-filled by the caller). Slot by slot:
    /// a table's rows stay in cache while its slot's samples are pooled.
    pub fn pool(&self, layout: &Layout, rows: &[&[f32]], pooled: &mut [f32], seqs: &mut [(&mut [f32], &mut [bool])]) {
        let width = layout.width;
        for (s, slot) in layout.slots.iter().enumerate() {
            let (dim, table) = (slot.dim, rows[slot.table]);
            for i in 0..self.batch {
                let occ = self.occurrences(s, i);
                match slot.pooling {
                    Pooling::Sum | Pooling::Mean => {
                        let out = &mut pooled[i * width + slot.out..i * width + slot.out + dim];
                        out.fill(0.0);
                        for &u in occ {
                            for (a, x) in out.iter_mut().zip(&table[u as usize * dim..(u as usize + 1) * dim]) {
                                *a += *x;
                            }
                        }
                        if slot.pooling == Pooling::Mean && occ.len() > 1 {
                            let n = occ.len() as f32;
                            for a in out.iter_mut() {
                                *a /= n;
                            }
                        }
                    }
                    Pooling::Sequence { max_len } => {
                        let (values, mask) = &mut seqs[slot.out];
                        for (p, &u) in occ.iter().enumerate() {
                            let at = (i * max_len + p) * dim;
                            values[at..at + dim].copy_from_slice(&table[u as usize * dim..(u as usize + 1) * dim]);
                            mask[i * max_len + p] = true;
                        }
                    }
                }
            }
        }
    }

    /// Add every occurrence's gradient to its ID's row of `out` (per table, `[ids[t].len(),
    /// dim]`, zero-filled by the caller), slot after slot, from one `SlotGrad` per slot. A
    /// mean slot's gradient is divided by the sample's number of IDs first.
    pub fn scatter(&self, layout: &Layout, grads: &[SlotGrad], out: &mut [&mut [f32]]) {
        let mut g: Vec<f32> = Vec::new();
        for (s, slot) in layout.slots.iter().enumerate() {
            let (dim, table, sg) = (slot.dim, &mut out[slot.table], &grads[s]);
            for i in 0..self.batch {
                let occ = self.occurrences(s, i);
                let row = |p: usize| &sg.data[i * sg.stride + sg.offset + p * dim..][..dim];
                let mean = slot.pooling == Pooling::Mean && occ.len() > 1;
                let pooled = if mean {
                    let n = occ.len() as f32;
                    g.clear();
                    g.extend(row(0).iter().map(|x| *x / n));
                    &g[..]
                } else {
                    row(0)
                };
                for (p, &u) in occ.iter().enumerate() {
                    let grad = if let Pooling::Sequence { .. } = slot.pooling { row(p) } else { pooled };
                    for (a, x) in table[u as usize * dim..(u as usize + 1) * dim].iter_mut().zip(grad) {
                        *a += *x;
                    }
                }
            }
        }
    }
}

/// The gradient of one slot's output, `[B, ...]` rows inside `data`: sample `i`'s gradient
/// (position `p`'s, for a sequence slot) is `data[i * stride + offset + p * dim..][..dim]`.
/// So a pooled slot's gradient may be its columns of the whole `[B, width]` array (stride
/// `width`, offset its first column) or an array of its own (stride `dim`).
pub struct SlotGrad<'a> {
    pub data: &'a [f32],
    pub stride: usize,
    pub offset: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    fn layout(num_shards: u32) -> Layout {
        let slots = [
            ("a".to_string(), "t".to_string(), Pooling::Sum),
            ("b".to_string(), "t".to_string(), Pooling::Mean),
            ("q".to_string(), "u".to_string(), Pooling::Sequence { max_len: 2 }),
        ];
        Layout::new(&slots, |t| [("t", 2), ("u", 1)].iter().find(|x| x.0 == t).map(|x| x.1), num_shards).unwrap()
    }

    #[test]
    fn plan_dedups_per_table_and_groups_by_shard() {
        let l = layout(3);
        assert_eq!((l.width, l.slots[1].out, l.slots[2].out), (4, 2, 0));
        let keys: Vec<String> = ["q", "b", "a"].iter().map(|s| s.to_string()).collect();
        // B = 2. q: [7] | [8, 7]; b: [] | [1, 2]; a: [1, 1] | [3]
        let values = [7u64, 8, 7, 1, 2, 1, 1, 3];
        let lengths = [1i32, 2, 0, 2, 2, 1];
        let p = l.plan(&keys, &values, &lengths).unwrap();
        assert_eq!(p.batch, 2);
        let mut t = p.ids[0].clone();
        t.sort();
        assert_eq!(t, [1, 2, 3]);
        for (ids, off) in p.ids.iter().zip(&p.offsets) {
            for s in 0..3 {
                assert!(ids[off[s]..off[s + 1]].iter().all(|&id| shard_of(id, 3) == s as u32));
            }
        }
        // Every occurrence points at its own ID.
        let occ = |s: usize, i: usize| -> Vec<u64> {
            p.occurrences(s, i).iter().map(|&u| p.ids[l.slots[s].table][u as usize]).collect()
        };
        assert_eq!((occ(0, 0), occ(0, 1), occ(1, 0), occ(1, 1)), (vec![1, 1], vec![3], vec![], vec![1, 2]));
        assert_eq!((occ(2, 0), occ(2, 1)), (vec![7], vec![8, 7]));

        let rows: Vec<Vec<f32>> = p
            .ids
            .iter()
            .zip(&l.tables)
            .map(|(ids, (_, dim))| {
                ids.iter().flat_map(|&id| (0..*dim).map(move |k| (id * 10 + k as u64) as f32)).collect()
            })
            .collect();
        let rows: Vec<&[f32]> = rows.iter().map(|r| r.as_slice()).collect();
        let mut pooled = vec![f32::NAN; 2 * 4];
        let (mut values, mut mask) = (vec![0f32; 4], vec![false; 4]);
        p.pool(&l, &rows, &mut pooled, &mut [(&mut values, &mut mask)]);
        assert_eq!(pooled, [20., 22., 0., 0., 30., 31., 15., 16.]);
        assert_eq!((values, mask), (vec![70., 0., 80., 70.], vec![true, false, true, true]));

        let mut sums: Vec<Vec<f32>> =
            p.ids.iter().zip(&l.tables).map(|(ids, (_, d))| vec![0f32; ids.len() * d]).collect();
        let mut out: Vec<&mut [f32]> = sums.iter_mut().map(|g| g.as_mut_slice()).collect();
        // a and b as columns of one [B, width] array; q's positions as [B, max_len, 1].
        let pooled_grad = [1f32, 1., 8., 8., 1., 1., 4., 4.];
        let grads = [
            SlotGrad { data: &pooled_grad, stride: 4, offset: 0 },
            SlotGrad { data: &pooled_grad, stride: 4, offset: 2 },
            SlotGrad { data: &[1., 9., 2., 3.], stride: 2, offset: 0 },
        ];
        p.scatter(&l, &grads, &mut out);
        let of = |t: usize, id: u64| -> Vec<f32> {
            let u = p.ids[t].iter().position(|&x| x == id).unwrap();
            let d = l.tables[t].1;
            sums[t][u * d..(u + 1) * d].to_vec()
        };
        // id 1: twice in a's sample 0, once in b's sample 1 (4 / 2); id 3: a's sample 1
        assert_eq!((of(0, 1), of(0, 2), of(0, 3)), (vec![4., 4.], vec![2., 2.], vec![1., 1.]));
        // q: sample 0 [7] gets 1 (9 is padding), sample 1 [8, 7] gets 2, 3
        assert_eq!((of(1, 7), of(1, 8)), (vec![4.], vec![2.]));
    }

    #[test]
    fn plan_errors_name_the_problem() {
        let l = layout(1);
        let keys: Vec<String> = ["a", "b", "q"].iter().map(|s| s.to_string()).collect();
        let err = |r: Result<Plan>| r.unwrap_err().to_string();
        assert!(err(l.plan(&keys[..2], &[1, 2], &[1, 1])).contains("no slot \"q\""));
        assert!(err(l.plan(&keys, &[1, 2, 3, 4, 5], &[1, 1, 3])).contains("more than max_len=2"));
        assert!(err(l.plan(&keys, &[1, 2], &[1, 1, 1])).contains("lengths sum to 3 but there are 2 values"));
        assert!(err(l.plan(&keys, &[1], &[1, -1, 1])).contains("negative"));
        assert!(err(l.plan(&keys, &[], &[0, 0])).contains("not a multiple"));
        let empty = l.plan(&keys, &[], &[]).unwrap();
        assert_eq!((empty.batch, empty.ids.iter().map(Vec::len).sum::<usize>()), (0, 0));
        let bad = [("a".to_string(), "x".to_string(), Pooling::Sum)];
        assert!(matches!(Layout::new(&bad, |_| None, 1), Err(StoreError::Key(_))));
    }
}
