//! The joiner of a multi-task job: impressions and the labels of several tasks, each from a topic
//! of its own with a window of its own. `trillium/data/sources/task_joiner.py` says what it
//! decides and why; this is its core, generic over the event it carries, as `join` is.

use std::cmp::Reverse;
use std::collections::BinaryHeap;

use crate::join::{Decision, Due, Key, KeyMap, Time};

/// What the join counts of impressions, in the order of task_joiner.py's `COUNTS`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Count {
    Impressions,
    Samples,
    ClosedEarly,
    DroppedEarly,
    DuplicateImpressions,
}

pub const COUNTS: usize = 5;

/// What it counts of each task's labels, in the order of task_joiner.py's `TASK_COUNTS`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaskCount {
    Labels,
    InSample,
    Corrections,
    LateLabels,
    UnmatchedLabels,
    DuplicateLabels,
}

pub const TASK_COUNTS: usize = 6;

/// A sample: the impression, each task's label (None: no label, in a correction of another
/// task), when it became one (event time), and whether it corrects an earlier one.
#[derive(Clone, Debug, PartialEq)]
pub struct TaskSample<E> {
    pub event: E,
    pub labels: Vec<Option<bool>>,
    pub time: f64,
    pub correction: bool,
}

/// An impression the join still needs: for its sample (`emitted` false), or for the later labels
/// of its tasks' longer windows. `labels` holds each task's label time (NaN: none yet).
pub struct Tracked<E> {
    pub event: E,
    pub time: f64,
    pub labels: Vec<f64>,
    pub emitted: bool,
    seq: u64,
}

/// The join of one input partition: impressions, and labels by task (their index in `windows`).
pub struct TaskJoin<E> {
    windows: Vec<f64>,
    first: f64,   // the shortest window: a sample leaves when it closes
    horizon: f64, // how long after its impression any task's label is still taken
    correct: bool,
    max_open: usize,
    tracked: KeyMap<Tracked<E>>,
    ends: BinaryHeap<Reverse<Due>>,     // each pending impression's first window end
    expiries: BinaryHeap<Reverse<Due>>, // each tracked impression's horizon (stale ones skipped)
    held: Vec<KeyMap<(f64, u64)>>,      // per task, labels before their impression: key -> (time, seq)
    held_order: Vec<BinaryHeap<Reverse<Due>>>,
    decided: BinaryHeap<Reverse<Decision<TaskSample<E>>>>,
    arrivals: u64,
    decisions: u64,
    counts: [u64; COUNTS],
    task_counts: Vec<[u64; TASK_COUNTS]>,
}

impl<E: Clone> TaskJoin<E> {
    /// `windows`: each task's, in task order (at least one, each positive); `correct`: a label
    /// after its task's window still corrects, up to a second window.
    pub fn new(windows: Vec<f64>, correct: bool, max_open: usize) -> Self {
        assert!(!windows.is_empty(), "a task join has a task");
        let first = windows.iter().copied().fold(f64::INFINITY, f64::min);
        let longest = windows.iter().copied().fold(0.0, f64::max);
        let tasks = windows.len();
        Self {
            first,
            horizon: if correct { 2.0 * longest } else { longest },
            windows,
            correct,
            max_open,
            tracked: KeyMap::default(),
            ends: BinaryHeap::new(),
            expiries: BinaryHeap::new(),
            held: (0..tasks).map(|_| KeyMap::default()).collect(),
            held_order: (0..tasks).map(|_| BinaryHeap::new()).collect(),
            decided: BinaryHeap::new(),
            arrivals: 0,
            decisions: 0,
            counts: [0; COUNTS],
            task_counts: vec![[0; TASK_COUNTS]; tasks],
        }
    }

    pub fn tasks(&self) -> usize {
        self.windows.len()
    }

    pub fn counts(&self) -> &[u64; COUNTS] {
        &self.counts
    }

    pub fn task_counts(&self) -> &[[u64; TASK_COUNTS]] {
        &self.task_counts
    }

    pub fn tracked_len(&self) -> usize {
        self.tracked.len()
    }

    fn count(&mut self, what: Count) {
        self.counts[what as usize] += 1;
    }

    fn count_task(&mut self, task: usize, what: TaskCount) {
        self.task_counts[task][what as usize] += 1;
    }

    fn arrival(&mut self) -> u64 {
        self.arrivals += 1;
        self.arrivals
    }

    // ---- events ------------------------------------------------------------------------------
    pub fn impression(&mut self, key: &str, time: f64, event: E) {
        self.count(Count::Impressions);
        let key = Key::new(key);
        if self.tracked.contains_key(&key) {
            self.count(Count::DuplicateImpressions);
            return;
        }
        self.track(key.clone(), time, event, vec![f64::NAN; self.tasks()], false);
        for task in 0..self.tasks() {
            if let Some((held, _)) = self.held[task].remove(&key) {
                self.label_of_tracked(&key, task, held);
            }
        }
        while self.tracked.len() > self.max_open && self.evict_oldest() {}
    }

    /// A label of `task` for the impression `key`.
    pub fn label(&mut self, task: usize, key: &str, time: f64) {
        self.count_task(task, TaskCount::Labels);
        let key = Key::new(key);
        if self.tracked.contains_key(&key) {
            self.label_of_tracked(&key, task, time);
        } else if self.held[task].contains_key(&key) {
            self.count_task(task, TaskCount::DuplicateLabels);
        } else {
            self.hold(task, key, time);
        }
    }

    /// Emit the samples whose first window ends at or before the watermark, forget the
    /// impressions it has passed the horizon of and the held labels it passed, and hand out the
    /// samples decided at or before it, in the order of their decisions.
    pub fn advance(&mut self, watermark: f64) -> Vec<TaskSample<E>> {
        while self.ends.peek().is_some_and(|Reverse(due)| due.at.0 <= watermark) {
            let Reverse(due) = self.ends.pop().expect("peeked");
            if self.is_tracked_as(&due) && !self.tracked[&due.key].emitted {
                self.emit(&due.key, due.at.0);
            }
        }
        while self.expiries.peek().is_some_and(|Reverse(due)| due.at.0 <= watermark) {
            let Reverse(due) = self.expiries.pop().expect("peeked");
            if self.is_tracked_as(&due) {
                self.tracked.remove(&due.key); // a label this late is held, then counted unmatched
            }
        }
        for task in 0..self.tasks() {
            while self.held_order[task].peek().is_some_and(|Reverse(due)| due.at.0 <= watermark) {
                let Reverse(due) = self.held_order[task].pop().expect("peeked");
                if self.held[task].get(&due.key).is_some_and(|&(_, seq)| seq == due.seq) {
                    self.held[task].remove(&due.key);
                    self.count_task(task, TaskCount::UnmatchedLabels);
                }
            }
        }
        let mut out = Vec::new();
        while self.decided.peek().is_some_and(|Reverse(first)| first.time.0 <= watermark) {
            out.push(self.decided.pop().expect("peeked").0.sample);
        }
        out
    }

    // ---- helpers -----------------------------------------------------------------------------
    fn track(&mut self, key: Key, time: f64, event: E, labels: Vec<f64>, emitted: bool) {
        let seq = self.arrival();
        if !emitted {
            self.ends.push(Reverse(Due { at: Time(time + self.first), seq, key: key.clone() }));
        }
        self.expiries.push(Reverse(Due { at: Time(time + self.horizon), seq, key: key.clone() }));
        self.tracked.insert(key, Tracked { event, time, labels, emitted, seq });
    }

    /// A label before its impression: held until the impression comes or the watermark passes it.
    fn hold(&mut self, task: usize, key: Key, time: f64) {
        let seq = self.arrival();
        self.held_order[task].push(Reverse(Due { at: Time(time), seq, key: key.clone() }));
        self.held[task].insert(key, (time, seq));
    }

    /// Whether a due entry is its impression's (not a stale one: gone, or tracked again since).
    fn is_tracked_as(&self, due: &Due) -> bool {
        self.tracked.get(&due.key).is_some_and(|t| t.seq == due.seq)
    }

    fn decide(&mut self, sample: TaskSample<E>) {
        self.decided.push(Reverse(Decision { time: Time(sample.time), seq: self.decisions, sample }));
        self.decisions += 1;
    }

    fn label_of_tracked(&mut self, key: &Key, task: usize, time: f64) {
        let window = self.windows[task];
        let tracked = &self.tracked[key];
        if !tracked.labels[task].is_nan() {
            self.count_task(task, TaskCount::DuplicateLabels);
            return;
        }
        // A label stamped before its impression is two clocks disagreeing: it is taken at the
        // impression's time (joiner.py says more).
        let (opened, emitted) = (tracked.time, tracked.emitted);
        let time = time.max(opened);
        if time > opened + window {
            self.count_task(task, TaskCount::LateLabels);
            if !(self.correct && time <= opened + 2.0 * window) {
                return;
            }
        }
        self.tracked.get_mut(key).expect("tracked").labels[task] = time;
        if emitted {
            self.correct_task(key, task, time);
        }
    }

    /// A correction: the impression again, with `task`'s label positive and no other.
    fn correct_task(&mut self, key: &Key, task: usize, time: f64) {
        self.count_task(task, TaskCount::Corrections);
        let mut labels = vec![None; self.tasks()];
        labels[task] = Some(true);
        let event = self.tracked[key].event.clone();
        self.decide(TaskSample { event, labels, time, correction: true });
    }

    /// The impression's sample at `time`, with each task's label known by its first window's
    /// end; a label known now but later than that end is a correction of its task.
    fn emit(&mut self, key: &Key, time: f64) {
        self.count(Count::Samples);
        let tracked = self.tracked.get_mut(key).expect("emitting a tracked impression");
        tracked.emitted = true;
        let end = tracked.time + self.first;
        let times = tracked.labels.clone();
        let event = tracked.event.clone();
        let labels = times.iter().map(|&t| Some(!t.is_nan() && t <= end)).collect::<Vec<_>>();
        for (task, &positive) in labels.iter().enumerate() {
            if positive == Some(true) {
                self.count_task(task, TaskCount::InSample);
            }
        }
        self.decide(TaskSample { event, labels, time, correction: false });
        for (task, &label) in times.iter().enumerate() {
            if label > end {
                self.correct_task(key, task, label);
            }
        }
    }

    /// Over the cap: forget the impression of the earliest horizon; emit it first, with the
    /// labels known now, if it was not (its later labels are counted unmatched).
    fn evict_oldest(&mut self) -> bool {
        while let Some(Reverse(due)) = self.expiries.pop() {
            if self.is_tracked_as(&due) {
                let (emitted, opened) = (self.tracked[&due.key].emitted, self.tracked[&due.key].time);
                if emitted {
                    self.count(Count::DroppedEarly);
                } else {
                    self.count(Count::ClosedEarly);
                    self.emit(&due.key, opened);
                }
                self.tracked.remove(&due.key);
                return true;
            }
        }
        false
    }

    // ---- state -------------------------------------------------------------------------------
    /// The tracked impressions (key, entry), in the order their horizons end.
    pub fn tracked_entries(&self) -> Vec<(&str, &Tracked<E>)> {
        let mut tracked: Vec<_> = self.tracked.iter().collect();
        tracked.sort_by_key(|(_, t)| (Time(t.time), t.seq));
        tracked.into_iter().map(|(k, t)| (k.as_str(), t)).collect()
    }

    /// Each task's held labels (key, time), in the order they are due.
    pub fn held_entries(&self, task: usize) -> Vec<(&str, f64)> {
        let mut held: Vec<_> = self.held[task].iter().collect();
        held.sort_by_key(|(_, &(time, seq))| (Time(time), seq));
        held.into_iter().map(|(k, &(time, _))| (k.as_str(), time)).collect()
    }

    /// The samples decided and not handed out yet, in the order they will be.
    pub fn decided_entries(&self) -> Vec<&TaskSample<E>> {
        let mut decided: Vec<_> = self.decided.iter().map(|Reverse(d)| d).collect();
        decided.sort();
        decided.into_iter().map(|d| &d.sample).collect()
    }

    /// A tracked impression of a checkpointed state, in `tracked_entries`' order (nothing counted).
    pub fn restore_tracked(&mut self, key: &str, time: f64, event: E, labels: Vec<f64>, emitted: bool) {
        assert_eq!(labels.len(), self.tasks(), "a label time per task");
        self.track(Key::new(key), time, event, labels, emitted);
    }

    pub fn restore_held(&mut self, task: usize, key: &str, time: f64) {
        self.hold(task, Key::new(key), time);
    }

    pub fn restore_decided(&mut self, sample: TaskSample<E>) {
        self.decide(sample);
    }

    pub fn restore_counts(&mut self, counts: [u64; COUNTS], task_counts: &[[u64; TASK_COUNTS]]) {
        for (mine, theirs) in self.counts.iter_mut().zip(counts) {
            *mine += theirs;
        }
        for (mine, theirs) in self.task_counts.iter_mut().zip(task_counts) {
            for (m, t) in mine.iter_mut().zip(theirs) {
                *m += t;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    type Out = (&'static str, Vec<Option<bool>>, f64, bool);

    fn outcome(samples: Vec<TaskSample<&'static str>>) -> Vec<Out> {
        samples.into_iter().map(|s| (s.event, s.labels, s.time, s.correction)).collect()
    }

    const YES: Option<bool> = Some(true);
    const NO: Option<bool> = Some(false);

    #[test]
    fn a_sample_leaves_at_the_first_window_and_a_later_label_corrects_its_task_alone() {
        // Task 0: clicks within 10 s; task 1: conversions within 100 s.
        let mut join = TaskJoin::new(vec![10.0, 100.0], false, 1000);
        join.impression("a", 0.0, "a");
        join.impression("b", 1.0, "b");
        join.label(0, "a", 4.0);
        join.label(1, "a", 6.0); // in a's first window: in its sample
        join.label(0, "b", 2.0);
        assert!(join.advance(9.9).is_empty(), "a positive waits for its first window to close");
        assert_eq!(
            outcome(join.advance(11.0)),
            [("a", vec![YES, YES], 10.0, false), ("b", vec![YES, NO], 11.0, false)]
        );
        join.label(1, "b", 50.0);
        join.label(1, "b", 60.0); // a duplicate
        assert_eq!(outcome(join.advance(50.0)), [("b", vec![None, YES], 50.0, true)]);
        join.impression("c", 30.0, "c");
        join.label(0, "c", 45.0); // after c's click window: late
        join.label(1, "c", 140.0); // after c's conversion window: late, only counted
        join.label(0, "b", 20.0); // b's second click: a duplicate
        assert_eq!(outcome(join.advance(1000.0)), [("c", vec![NO, NO], 40.0, false)]);
        assert_eq!(join.tracked_len(), 0);
        let (click, conversion) = (join.task_counts()[0], join.task_counts()[1]);
        assert_eq!(click[TaskCount::InSample as usize], 2);
        assert_eq!(click[TaskCount::LateLabels as usize], 1);
        assert_eq!(conversion[TaskCount::Corrections as usize], 1);
        assert_eq!(click[TaskCount::DuplicateLabels as usize], 1);
        assert_eq!(conversion[TaskCount::DuplicateLabels as usize], 1);
        assert_eq!(conversion[TaskCount::LateLabels as usize], 1);
    }

    #[test]
    fn a_label_known_before_the_sample_but_after_its_first_window_is_a_correction_at_its_time() {
        let mut join = TaskJoin::new(vec![10.0, 100.0], false, 1000);
        join.label(1, "a", 40.0); // before its impression came: held
        join.impression("a", 0.0, "a");
        assert_eq!(outcome(join.advance(45.0)), [("a", vec![NO, NO], 10.0, false), ("a", vec![None, YES], 40.0, true)]);
    }

    #[test]
    fn the_cap_forgets_emitted_impressions_first_then_emits_the_oldest_early() {
        let mut join = TaskJoin::new(vec![10.0, 100.0], false, 2);
        join.impression("a", 0.0, "a");
        assert_eq!(outcome(join.advance(10.0)), [("a", vec![NO, NO], 10.0, false)]);
        join.impression("b", 20.0, "b");
        join.impression("c", 21.0, "c"); // over the cap: a (emitted) is forgotten
        assert_eq!(join.counts()[Count::DroppedEarly as usize], 1);
        join.label(0, "b", 22.0);
        join.impression("d", 22.0, "d"); // b, pending, leaves early with what is known
        assert_eq!(join.counts()[Count::ClosedEarly as usize], 1);
        assert_eq!(outcome(join.advance(21.0)), [("b", vec![YES, NO], 20.0, false)]);
        join.label(1, "a", 30.0); // a is forgotten: held, then unmatched
        join.advance(31.0);
        assert_eq!(join.task_counts()[1][TaskCount::UnmatchedLabels as usize], 1);
    }

    #[test]
    fn correcting_late_labels_takes_them_up_to_a_second_window() {
        let mut join = TaskJoin::new(vec![10.0, 100.0], true, 1000);
        join.impression("a", 0.0, "a");
        join.advance(10.0);
        join.label(0, "a", 15.0); // a late click: corrected
        join.label(1, "a", 250.0); // after two conversion windows: only counted
        assert_eq!(outcome(join.advance(300.0)), [("a", vec![YES, None], 15.0, true)]);
        assert_eq!(join.task_counts()[1][TaskCount::LateLabels as usize], 1);
        assert_eq!(join.task_counts()[1][TaskCount::Corrections as usize], 0);
    }
}
