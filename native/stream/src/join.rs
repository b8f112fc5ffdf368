//! The stream loader's joiner: impressions and their labels joined by key, in event time.
//! `trillium/data/sources/joiner.py` says what it decides and why; this is its core, generic
//! over the event it carries (a Python object for the loader), so that a few hash-map and
//! heap operations per event cost what they do in Rust, not in Python.

use std::cmp::{Ordering, Reverse};
use std::collections::hash_map::RandomState;
use std::collections::{BinaryHeap, HashMap, VecDeque};
use std::hash::{BuildHasher, BuildHasherDefault, Hash, Hasher};
use std::sync::{Arc, OnceLock};

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// What a joiner counts, in the order of joiner.py's `COUNTS`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Count {
    Impressions,
    Labels,
    Positives,
    Negatives,
    LateLabels,
    Corrections,
    ClosedEarly,
    UnmatchedLabels,
    DuplicateImpressions,
    DuplicateLabels,
}

pub const COUNTS: usize = 10;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Positive,
    Negative,
    Correction,
}

/// An event's key, hashed once as it comes (it is looked up several times an event), under a
/// seed drawn per process: keys come from the stream, so their hashes must not be guessable.
#[derive(Clone, Debug)]
pub struct Key {
    hash: u64,
    text: Arc<str>,
}

impl Key {
    pub fn new(text: &str) -> Self {
        static SEED: OnceLock<u64> = OnceLock::new();
        let seed = *SEED.get_or_init(|| RandomState::new().hash_one(0u64));
        Self { hash: xxh3_64_with_seed(text.as_bytes(), seed), text: text.into() }
    }

    pub fn as_str(&self) -> &str {
        &self.text
    }
}

impl PartialEq for Key {
    fn eq(&self, other: &Self) -> bool {
        self.hash == other.hash && self.text == other.text
    }
}

impl Eq for Key {}

impl Hash for Key {
    fn hash<H: Hasher>(&self, state: &mut H) {
        state.write_u64(self.hash);
    }
}

/// Passes a `Key`'s own hash through.
#[derive(Default)]
pub(crate) struct KeyHasher(u64);

impl Hasher for KeyHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.0 = self.0.rotate_left(8) ^ u64::from(b);
        }
    }

    fn write_u64(&mut self, hash: u64) {
        self.0 = hash;
    }
}

pub(crate) type KeyMap<V> = HashMap<Key, V, BuildHasherDefault<KeyHasher>>;

/// A time, ordered as Python orders floats (event times are finite; a watermark may be ±inf).
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Time(pub(crate) f64);

impl Eq for Time {}

impl PartialOrd for Time {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Time {
    fn cmp(&self, other: &Self) -> Ordering {
        self.0.partial_cmp(&other.0).unwrap_or(Ordering::Equal)
    }
}

/// A key due at a time; of keys due at once, the one that came first is first.
#[derive(Debug)]
pub(crate) struct Due {
    pub(crate) at: Time,
    pub(crate) seq: u64,
    pub(crate) key: Key,
}

impl PartialEq for Due {
    fn eq(&self, other: &Self) -> bool {
        (self.at, self.seq) == (other.at, other.seq)
    }
}

impl Eq for Due {}

impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Due {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.at, self.seq).cmp(&(other.at, other.seq))
    }
}

/// A sample: the impression, its label, and when it became one (event time).
#[derive(Clone, Debug, PartialEq)]
pub struct Sample<E> {
    pub event: E,
    pub positive: bool,
    pub time: f64,
    pub kind: Kind,
}

/// A decided sample waiting for the watermark, ordered by (decision time, order decided).
pub(crate) struct Decision<S> {
    pub(crate) time: Time,
    pub(crate) seq: u64,
    pub(crate) sample: S,
}

impl<S> PartialEq for Decision<S> {
    fn eq(&self, other: &Self) -> bool {
        (self.time, self.seq) == (other.time, other.seq)
    }
}

impl<S> Eq for Decision<S> {}

impl<S> PartialOrd for Decision<S> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl<S> Ord for Decision<S> {
    fn cmp(&self, other: &Self) -> Ordering {
        (self.time, self.seq).cmp(&(other.time, other.seq))
    }
}

/// An impression emitted in the last window of event time, for its late labels; the event is
/// kept only to correct it (`late_labels: correct`, and only once).
#[derive(Clone, Debug, PartialEq)]
pub struct Closed<E> {
    pub event: Option<E>,
    pub positive: bool,
    pub end: f64,
}

/// An open impression: its event, event time, and when it came among the others.
struct Open<E> {
    event: E,
    time: f64,
    seq: u64,
}

/// The join of one input partition.
pub struct Join<E> {
    window: f64,
    correct: bool,
    max_open: usize,
    open: KeyMap<Open<E>>,
    ends: BinaryHeap<Reverse<Due>>, // each open impression's window end (stale ones skipped)
    held: KeyMap<(f64, u64)>,       // labels before their impression: key -> (label time, seq)
    held_order: BinaryHeap<Reverse<Due>>,
    closed: KeyMap<Closed<E>>,
    closed_order: VecDeque<Key>, // `closed`'s keys, oldest first (only the oldest ever leaves)
    decided: BinaryHeap<Reverse<Decision<Sample<E>>>>,
    arrivals: u64,
    decisions: u64,
    counts: [u64; COUNTS],
}

impl<E: Clone> Join<E> {
    pub fn new(window: f64, correct: bool, max_open: usize) -> Self {
        Self {
            window,
            correct,
            max_open,
            open: KeyMap::default(),
            ends: BinaryHeap::new(),
            held: KeyMap::default(),
            held_order: BinaryHeap::new(),
            closed: KeyMap::default(),
            closed_order: VecDeque::new(),
            decided: BinaryHeap::new(),
            arrivals: 0,
            decisions: 0,
            counts: [0; COUNTS],
        }
    }

    pub fn counts(&self) -> &[u64; COUNTS] {
        &self.counts
    }

    pub fn open_len(&self) -> usize {
        self.open.len()
    }

    fn count(&mut self, what: Count) {
        self.counts[what as usize] += 1;
    }

    fn arrival(&mut self) -> u64 {
        self.arrivals += 1;
        self.arrivals
    }

    // ---- events ------------------------------------------------------------------------------
    pub fn impression(&mut self, key: &str, time: f64, event: E) {
        self.count(Count::Impressions);
        let key = Key::new(key);
        if self.open.contains_key(&key) || self.closed.contains_key(&key) {
            self.count(Count::DuplicateImpressions);
            return;
        }
        self.open_impression(key.clone(), time, event);
        if let Some((held, _)) = self.held.remove(&key) {
            self.label_of_open(&key, held);
        }
        while self.open.len() > self.max_open && self.close_oldest() {}
    }

    pub fn label(&mut self, key: &str, time: f64) {
        self.count(Count::Labels);
        let key = Key::new(key);
        if self.open.contains_key(&key) {
            self.label_of_open(&key, time);
        } else if let Some(closed) = self.closed.get(&key) {
            if closed.positive {
                self.count(Count::DuplicateLabels);
            } else {
                self.late(&key, time);
            }
        } else if self.held.contains_key(&key) {
            self.count(Count::DuplicateLabels);
        } else {
            self.hold(key, time);
        }
    }

    /// Close the windows that end at or before the watermark, drop the held labels it passed,
    /// and hand out the samples decided at or before it, in the order of their decisions.
    pub fn advance(&mut self, watermark: f64) -> Vec<Sample<E>> {
        while self.ends.peek().is_some_and(|Reverse(due)| due.at.0 <= watermark) {
            let Reverse(due) = self.ends.pop().expect("peeked");
            if self.is_open_as(&due) {
                self.close(&due.key, false, due.at.0);
            }
        }
        while self.closed_order.front().is_some_and(|oldest| self.closed[oldest].end <= watermark - self.window) {
            self.drop_oldest_closed(); // a label this late is counted as unmatched
        }
        while self.held_order.peek().is_some_and(|Reverse(due)| due.at.0 <= watermark) {
            let Reverse(due) = self.held_order.pop().expect("peeked");
            if self.held.get(&due.key).is_some_and(|&(_, seq)| seq == due.seq) {
                self.held.remove(&due.key);
                self.count(Count::UnmatchedLabels);
            }
        }
        let mut out = Vec::new();
        while self.decided.peek().is_some_and(|Reverse(first)| first.time.0 <= watermark) {
            out.push(self.decided.pop().expect("peeked").0.sample);
        }
        out
    }

    // ---- helpers -----------------------------------------------------------------------------
    fn open_impression(&mut self, key: Key, time: f64, event: E) {
        let seq = self.arrival();
        self.ends.push(Reverse(Due { at: Time(time + self.window), seq, key: key.clone() }));
        self.open.insert(key, Open { event, time, seq });
    }

    fn hold(&mut self, key: Key, time: f64) {
        let seq = self.arrival();
        self.held_order.push(Reverse(Due { at: Time(time), seq, key: key.clone() }));
        self.held.insert(key, (time, seq));
    }

    /// Whether a window end is its impression's (not a stale one: closed by its label, or open
    /// again since).
    fn is_open_as(&self, due: &Due) -> bool {
        self.open.get(&due.key).is_some_and(|open| open.seq == due.seq)
    }

    fn decide(&mut self, sample: Sample<E>) {
        self.decided.push(Reverse(Decision { time: Time(sample.time), seq: self.decisions, sample }));
        self.decisions += 1;
    }

    fn label_of_open(&mut self, key: &Key, time: f64) {
        let opened = self.open[key].time;
        if time <= opened + self.window {
            // A label stamped before its impression is two clocks disagreeing: it is taken at
            // the impression's time (joiner.py says more).
            self.close(key, true, time.max(opened));
        } else {
            self.close(key, false, opened + self.window);
            self.late(key, time);
        }
    }

    fn late(&mut self, key: &Key, time: f64) {
        self.count(Count::LateLabels);
        let closed = self.closed.get_mut(key).expect("a late label's impression is closed");
        if let Some(event) = closed.event.take() {
            closed.positive = true; // corrected once
            self.count(Count::Corrections);
            self.decide(Sample { event, positive: true, time, kind: Kind::Correction });
        }
    }

    fn close(&mut self, key: &Key, positive: bool, time: f64) {
        let (key, open) = self.open.remove_entry(key).expect("closing an open impression");
        self.count(if positive { Count::Positives } else { Count::Negatives });
        let kept = (self.correct && !positive).then(|| open.event.clone());
        self.insert_closed(key, Closed { event: kept, positive, end: open.time + self.window });
        while self.closed.len() > self.max_open {
            self.drop_oldest_closed();
        }
        let kind = if positive { Kind::Positive } else { Kind::Negative };
        self.decide(Sample { event: open.event, positive, time, kind });
    }

    fn insert_closed(&mut self, key: Key, closed: Closed<E>) {
        // A key closed again keeps its place, as a Python dict's does.
        if let Some(entry) = self.closed.get_mut(&key) {
            *entry = closed;
        } else {
            self.closed_order.push_back(key.clone());
            self.closed.insert(key, closed);
        }
    }

    fn drop_oldest_closed(&mut self) {
        if let Some(key) = self.closed_order.pop_front() {
            self.closed.remove(&key);
        }
    }

    fn close_oldest(&mut self) -> bool {
        while let Some(Reverse(due)) = self.ends.pop() {
            if self.is_open_as(&due) {
                let opened = self.open[&due.key].time;
                self.count(Count::ClosedEarly);
                self.close(&due.key, false, opened);
                return true;
            }
        }
        false
    }

    // ---- state -------------------------------------------------------------------------------
    /// The open impressions (key, event, time), in the order their windows end.
    pub fn open_entries(&self) -> Vec<(&str, &E, f64)> {
        let mut open: Vec<_> = self.open.iter().collect();
        open.sort_by_key(|(_, o)| (Time(o.time + self.window), o.seq));
        open.into_iter().map(|(k, o)| (k.as_str(), &o.event, o.time)).collect()
    }

    /// The held labels (key, time), in the order they are due.
    pub fn held_entries(&self) -> Vec<(&str, f64)> {
        let mut held: Vec<_> = self.held.iter().collect();
        held.sort_by_key(|(_, &(time, seq))| (Time(time), seq));
        held.into_iter().map(|(k, &(time, _))| (k.as_str(), time)).collect()
    }

    /// The recently closed impressions, oldest first.
    pub fn closed_entries(&self) -> Vec<(&str, &Closed<E>)> {
        self.closed_order.iter().map(|k| (k.as_str(), &self.closed[k])).collect()
    }

    /// The samples decided and not handed out yet, in the order they will be.
    pub fn decided_entries(&self) -> Vec<&Sample<E>> {
        let mut decided: Vec<_> = self.decided.iter().map(|Reverse(d)| d).collect();
        decided.sort();
        decided.into_iter().map(|d| &d.sample).collect()
    }

    pub fn restore_open(&mut self, key: &str, time: f64, event: E) {
        self.open_impression(Key::new(key), time, event);
    }

    pub fn restore_held(&mut self, key: &str, time: f64) {
        self.hold(Key::new(key), time);
    }

    pub fn restore_closed(&mut self, key: &str, closed: Closed<E>) {
        self.insert_closed(Key::new(key), closed);
    }

    pub fn restore_decided(&mut self, sample: Sample<E>) {
        self.decide(sample);
    }

    pub fn restore_counts(&mut self, counts: [u64; COUNTS]) {
        for (mine, theirs) in self.counts.iter_mut().zip(counts) {
            *mine += theirs;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn outcome(samples: Vec<Sample<&'static str>>) -> Vec<(&'static str, Kind, f64)> {
        samples.into_iter().map(|s| (s.event, s.kind, s.time)).collect()
    }

    #[test]
    fn labels_in_the_window_are_positives_and_closed_windows_negatives() {
        let mut join = Join::new(10.0, false, 1000);
        join.impression("a", 100.0, "a");
        join.impression("b", 95.0, "b");
        join.label("a", 104.0);
        join.impression("c", 101.0, "c");
        assert!(join.advance(103.9).is_empty());
        assert_eq!(outcome(join.advance(104.9)), [("a", Kind::Positive, 104.0)]);
        assert_eq!(outcome(join.advance(105.0)), [("b", Kind::Negative, 105.0)]);
        join.label("c", 111.5);
        assert_eq!(outcome(join.advance(112.0)), [("c", Kind::Negative, 111.0)]);
        let c = join.counts();
        assert_eq!((c[Count::Positives as usize], c[Count::LateLabels as usize]), (1, 1));
    }

    #[test]
    fn a_late_label_corrects_a_negative_once_and_the_cap_closes_the_oldest() {
        let mut join = Join::new(10.0, true, 2);
        join.impression("y", 40.0, "y");
        assert_eq!(outcome(join.advance(51.0)), [("y", Kind::Negative, 50.0)]);
        join.label("y", 52.0);
        join.label("y", 53.0);
        assert_eq!(outcome(join.advance(60.0)), [("y", Kind::Correction, 52.0)]);
        assert_eq!(join.counts()[Count::DuplicateLabels as usize], 1);
        for (i, key) in ["k0", "k1", "k2"].into_iter().enumerate() {
            join.impression(key, 70.0 + i as f64, key);
        }
        assert_eq!(join.open_len(), 2);
        assert_eq!(join.counts()[Count::ClosedEarly as usize], 1);
        assert_eq!(outcome(join.advance(70.0)), [("k0", Kind::Negative, 70.0)]);
    }

    #[test]
    fn the_state_lists_each_part_in_a_fixed_order() {
        let mut join = Join::new(10.0, true, 100);
        join.impression("b", 5.0, "b");
        join.impression("a", 5.0, "a");
        join.label("z", 3.0);
        join.label("x", 3.0);
        join.advance(1.0);
        let open: Vec<_> = join.open_entries().into_iter().map(|(k, _, t)| (k, t)).collect();
        assert_eq!(open, [("b", 5.0), ("a", 5.0)]); // ends alike: in the order they came
        assert_eq!(join.held_entries(), [("z", 3.0), ("x", 3.0)]);
    }
}
