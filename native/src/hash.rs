//! Stable hash functions.
//!
//! Everything in this module is part of the public contract of Trillium: the
//! results must never change between releases, processes or machines.

use xxhash_rust::xxh3::xxh3_64;

/// Weyl increment of splitmix64 (2^64 / golden ratio).
pub const GOLDEN_GAMMA: u64 = 0x9E37_79B9_7F4A_7C15;

/// The splitmix64 finalizer (Steele, Lea & Flood 2014; constants of Stafford's
/// "Mix13"). A bijection on u64 with full avalanche. `mix64(0) == 0`.
#[inline(always)]
pub fn mix64(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// MurmurHash3 fmix64 finalizer. Used (with a salt) for *internal* placement so
/// that it is statistically independent of [`shard_of`].
#[inline(always)]
pub fn fmix64(mut k: u64) -> u64 {
    k ^= k >> 33;
    k = k.wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    k ^= k >> 33;
    k = k.wrapping_mul(0xC4CE_B9FE_1A85_EC53);
    k ^ (k >> 33)
}

/// THE ownership function of the system: which of `num_shards` parameter-server
/// shards owns `id`. `shard_of(id, n) = splitmix64_mix(id) % n`.
#[inline(always)]
pub fn shard_of(id: u64, num_shards: u32) -> u32 {
    debug_assert!(num_shards > 0);
    (mix64(id) % num_shards as u64) as u32
}

const INTERNAL_SALT: u64 = 0x5851_F42D_4C95_7F2D;
/// Internal placement hash (internal shard, index bucket and tag).
#[inline(always)]
pub fn internal_hash(id: u64) -> u64 {
    fmix64(id ^ INTERNAL_SALT)
}

/// Internal shard of a placement hash, for `n` internal shards (top bits).
#[inline(always)]
pub fn internal_shard(h: u64, n: usize) -> usize {
    (((h >> 32) * n as u64) >> 32) as usize
}

pub const INIT_SALT: u64 = 0x243F_6A88_85A3_08D3;
pub const ADMIT_SALT: u64 = 0x1319_8A2E_0370_7344;
pub const SKETCH_SALT: u64 = 0xA409_3822_299F_31D0;

/// Seed of the per-row initialization stream of `id` in a table with `seed`.
#[inline(always)]
pub fn row_stream_seed(table_seed: u64, id: u64) -> u64 {
    mix64(mix64(table_seed ^ INIT_SALT) ^ id)
}

/// Uniform double in [0, 1) from the top 53 bits.
#[inline(always)]
pub fn unit_f64(r: u64) -> f64 {
    (r >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// A splitmix64 stream: `next()` = mix64(state += GOLDEN_GAMMA).
#[derive(Clone, Debug)]
pub struct SplitMix64 {
    pub state: u64,
}

impl SplitMix64 {
    #[inline(always)]
    pub fn new(seed: u64) -> Self {
        SplitMix64 { state: seed }
    }
    #[inline(always)]
    // An RNG step, not Iterator::next: the stream never ends (an Option would be noise).
    #[allow(clippy::should_implement_trait)]
    pub fn next(&mut self) -> u64 {
        self.state = self.state.wrapping_add(GOLDEN_GAMMA);
        mix64(self.state)
    }
}

/// Deterministic admission draw for probability admission: uniform in [0,1).
#[inline(always)]
pub fn admission_draw(table_seed: u64, id: u64) -> f64 {
    unit_f64(mix64(mix64(table_seed ^ ADMIT_SALT) ^ id))
}

/// Hash a raw feature value: xxh3_64(namespace_utf8 ++ [0x00] ++ value_bytes), seed 0.
#[inline]
pub fn hash_value(namespace: &[u8], value: &[u8]) -> u64 {
    let mut buf = Vec::with_capacity(namespace.len() + 1 + value.len());
    buf.extend_from_slice(namespace);
    buf.push(0);
    buf.extend_from_slice(value);
    xxh3_64(&buf)
}

/// Reusable hasher for many values of one namespace.
pub struct ValueHasher {
    buf: Vec<u8>,
    prefix: usize,
}

impl ValueHasher {
    pub fn new(namespace: &[u8]) -> Self {
        let mut buf = Vec::with_capacity(namespace.len() + 64);
        buf.extend_from_slice(namespace);
        buf.push(0);
        ValueHasher { prefix: buf.len(), buf }
    }
    #[inline]
    pub fn hash_bytes(&mut self, value: &[u8]) -> u64 {
        self.buf.truncate(self.prefix);
        self.buf.extend_from_slice(value);
        xxh3_64(&self.buf)
    }
    /// Hash of the canonical decimal text of an integer, so that
    /// `hash_i128(v) == hash_bytes(str(v))`.
    #[inline]
    pub fn hash_int(&mut self, v: i128) -> u64 {
        let mut tmp = [0u8; 48];
        let s = format_int(v, &mut tmp);
        self.buf.truncate(self.prefix);
        self.buf.extend_from_slice(s);
        xxh3_64(&self.buf)
    }
}

/// Values per rayon task when hashing a long column (shorter columns are hashed inline).
const PAR_CHUNK: usize = 1 << 14;

/// Hash every value of an Arrow-layout string column: value `i` is the bytes
/// `data[offsets[i]..offsets[i + 1]]`, hashed like [`hash_value`] (so equal to
/// `hash_ids` of the same text). `offsets` has one more entry than there are
/// values and need not start at 0 (a sliced column). Checks every offset first:
/// an error names the first one that decreases or points past `data`.
pub fn hash_strings<O: Copy + Into<i64> + Sync>(
    namespace: &[u8],
    data: &[u8],
    offsets: &[O],
) -> Result<Vec<u64>, String> {
    let Some(&first) = offsets.first() else {
        return Err("offsets must have at least one entry (values + 1)".into());
    };
    let mut prev: i64 = first.into();
    if prev < 0 || prev as u64 > data.len() as u64 {
        return Err(format!("offsets[0] = {prev} is outside the {} data bytes", data.len()));
    }
    for (i, &o) in offsets.iter().enumerate().skip(1) {
        let o: i64 = o.into();
        if o < prev || o as u64 > data.len() as u64 {
            return Err(format!(
                "offsets[{i}] = {o} is below offsets[{}] = {prev} or past the {} data bytes",
                i - 1,
                data.len()
            ));
        }
        prev = o;
    }
    // Checked above: every range is within `data` and non-decreasing.
    let one = |h: &mut ValueHasher, w: &[O]| h.hash_bytes(&data[w[0].into() as usize..w[1].into() as usize]);
    let n = offsets.len() - 1;
    let mut out = vec![0u64; n];
    if n < 4 * PAR_CHUNK {
        let mut h = ValueHasher::new(namespace);
        for (o, w) in out.iter_mut().zip(offsets.windows(2)) {
            *o = one(&mut h, w);
        }
    } else {
        use rayon::prelude::*;
        out.par_chunks_mut(PAR_CHUNK).enumerate().for_each(|(c, chunk)| {
            let mut h = ValueHasher::new(namespace);
            let start = c * PAR_CHUNK;
            for (o, w) in chunk.iter_mut().zip(offsets[start..].windows(2)) {
                *o = one(&mut h, w);
            }
        });
    }
    Ok(out)
}

/// Canonical decimal representation (like Python's `str(int)`).
#[inline]
pub fn format_int(v: i128, tmp: &mut [u8; 48]) -> &[u8] {
    let neg = v < 0;
    let mut u: u128 = v.unsigned_abs();
    let mut i = tmp.len();
    loop {
        i -= 1;
        tmp[i] = b'0' + (u % 10) as u8;
        u /= 10;
        if u == 0 {
            break;
        }
    }
    if neg {
        i -= 1;
        tmp[i] = b'-';
    }
    &tmp[i..]
}

/// Kafka's murmur2 (`org.apache.kafka.common.utils.Utils.murmur2`): the hash of a record's key
/// that Kafka's default partitioner (Java's, librdkafka's `murmur2_random`, aiokafka's) places it
/// by, as `(murmur2(key) & 0x7fffffff) % partitions`.
pub fn kafka_murmur2(data: &[u8]) -> u32 {
    const M: u32 = 0x5bd1_e995;
    let mut h: u32 = 0x9747_b28c ^ data.len() as u32;
    let mut words = data.chunks_exact(4);
    for w in &mut words {
        let mut k = u32::from_le_bytes([w[0], w[1], w[2], w[3]]).wrapping_mul(M);
        k ^= k >> 24;
        h = h.wrapping_mul(M) ^ k.wrapping_mul(M);
    }
    let tail = words.remainder();
    if !tail.is_empty() {
        for (i, &b) in tail.iter().enumerate() {
            h ^= u32::from(b) << (8 * i);
        }
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^ (h >> 15)
}

/// The partition of `partitions` Kafka's default partitioner gives a record keyed `key`.
pub fn kafka_partition(key: &[u8], partitions: u32) -> u32 {
    (kafka_murmur2(key) & 0x7fff_ffff) % partitions
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mix64_known_values() {
        // Reference values of the splitmix64 generator seeded with 0:
        // next() = mix64(0 + k*gamma), first output 0xE220A8397B1DCDAF.
        let mut s = SplitMix64::new(0);
        assert_eq!(s.next(), 0xE220_A839_7B1D_CDAF);
        assert_eq!(s.next(), 0x6E78_9E6A_A1B9_65F4);
        assert_eq!(s.next(), 0x06C4_5D18_8009_454F);
        assert_eq!(mix64(0), 0);
    }

    #[test]
    fn shard_of_stable() {
        // Frozen values: changing them breaks every deployed cluster.
        let got: Vec<u32> = (0u64..8).map(|i| shard_of(i, 7)).collect();
        let expect: Vec<u32> = (0u64..8).map(|i| (mix64(i) % 7) as u32).collect();
        assert_eq!(got, expect);
        assert_eq!(shard_of(0, 3), 0);
        assert_eq!(shard_of(1, 1_000_003), (mix64(1) % 1_000_003) as u32);
        assert_eq!(mix64(1), 0x5692_161D_100B_05E5);
    }

    #[test]
    fn xxh3_stable() {
        // xxh3_64 of the empty input with seed 0 is a published constant.
        assert_eq!(xxh3_64(b""), 0x2D06_8005_38D3_94C2);
        let mut h = ValueHasher::new(b"user");
        assert_eq!(h.hash_bytes(b"42"), hash_value(b"user", b"42"));
        assert_eq!(h.hash_int(42), hash_value(b"user", b"42"));
        assert_eq!(h.hash_int(-7), hash_value(b"user", b"-7"));
        assert_ne!(hash_value(b"a", b"bc"), hash_value(b"ab", b"c"));
    }

    #[test]
    fn hash_strings_matches_hash_value() {
        let data = b"alice42bob";
        let got = hash_strings(b"user", data, &[0i32, 5, 7, 7, 10]).unwrap();
        let expect: Vec<u64> = [&b"alice"[..], b"42", b"", b"bob"].iter().map(|v| hash_value(b"user", v)).collect();
        assert_eq!(got, expect);
        // A sliced column (offsets not starting at 0), 64-bit offsets.
        assert_eq!(hash_strings(b"user", data, &[5i64, 7]).unwrap(), vec![hash_value(b"user", b"42")]);
        assert_eq!(hash_strings(b"user", data, &[3i32]).unwrap(), Vec::<u64>::new());
        // Long enough for the parallel path: same values as the inline one.
        let long: Vec<u8> = (0..300_000u32).flat_map(|i| (i % 1000).to_string().into_bytes()).collect();
        let mut offsets = vec![0i64];
        for i in 0..300_000u32 {
            offsets.push(offsets.last().unwrap() + (i % 1000).to_string().len() as i64);
        }
        let hashed = hash_strings(b"c", &long, &offsets).unwrap();
        assert_eq!(hashed.len(), 300_000);
        assert!(hashed.iter().enumerate().all(|(i, &h)| h == hash_value(b"c", (i % 1000).to_string().as_bytes())));
    }

    #[test]
    fn hash_strings_rejects_bad_offsets() {
        assert!(hash_strings::<i32>(b"n", b"abc", &[]).unwrap_err().contains("at least one"));
        assert!(hash_strings(b"n", b"abc", &[0i32, 2, 1]).unwrap_err().contains("offsets[2] = 1"));
        assert!(hash_strings(b"n", b"abc", &[0i32, 4]).unwrap_err().contains("past the 3 data bytes"));
        assert!(hash_strings(b"n", b"abc", &[-1i64, 2]).unwrap_err().contains("offsets[0] = -1"));
    }

    #[test]
    fn format_int_extremes() {
        let mut t = [0u8; 48];
        assert_eq!(format_int(0, &mut t), b"0");
        assert_eq!(format_int(i64::MIN as i128, &mut t), b"-9223372036854775808");
        assert_eq!(format_int(u64::MAX as i128, &mut t), b"18446744073709551615");
    }

    #[test]
    fn kafka_murmur2_matches_the_java_clients_values() {
        // org.apache.kafka.common.utils.UtilsTest#testMurmur2
        for (key, want) in [
            (&b"21"[..], -973932308i32),
            (b"foobar", -790332482),
            (b"a-little-bit-long-string", -985981536),
            (b"a-little-bit-longer-string", -1486304829),
            (b"lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8", -58897971),
            (&[b'a', b'b', b'c'][..], 479470107),
        ] {
            assert_eq!(kafka_murmur2(key) as i32, want, "{:?}", std::str::from_utf8(key));
        }
    }
}
