//! The hand-written JSON reader (`json_in`, as `events::EventSpec::decode` uses it) against
//! simd-json and sonic-rs, on the online example's impression events, Python-free:
//!
//! `cargo run --release -p trillium-stream --example json_bench [-- MESSAGES REPETITIONS]`
//!
//! The messages are the ones `trillium replay` sends for `examples/online/job.yaml` (written by
//! `json_out::write_rows` in that event's layout: `request_id`, `ts`, C1..C26 as 8 hex digits or
//! null, I1..I13 as counts or null; datagen's missing rates). Each implementation reads every
//! message for the job's 39 fields, its event time and its key, and makes the decoder's output of
//! it (the fields' texts joined by `FIELD_SEP`, as Python's `scalar_text` writes them); the
//! libraries parse to their DOM and look each path up, their numbers written back as Python does.
//! The three outputs are checked equal first. Then, warm, the median over the repetitions of
//! ns/message and MB/s.
//!
//! The decision rule, fixed before measuring: keep the hand-written reader if it is at least
//! 1.25x as fast as the faster library on this workload, or if the libraries do not give what
//! Python's `json.loads` gives on the edge cases the decoder relies on (the last of duplicate
//! keys, a number's text, a lone surrogate, a raw control character in a string: answering
//! differently, rather than refusing so that Python decides, is wrong). Otherwise a library would
//! do, and it is reported.

use std::fmt::Write as _;
use std::hint::black_box;
use std::time::Instant;

use simd_json::prelude::*;
use sonic_rs::{JsonContainerTrait, JsonValueTrait};
use trillium_stream::events::{EventSpec, Kind, FIELD_SEP, MULTI_SEP};
use trillium_stream::json_out::{write_rows, Column, Piece};

const MAX_VALUE_BYTES: usize = 1 << 16;

/// splitmix64: a seeded stream, so that every run measures the same messages.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// `n` impression events in the layout `trillium replay` writes for the online example.
fn messages(n: usize) -> Vec<Vec<u8>> {
    let mut rng = Rng(7);
    let cat_missing = [0.0, 0.0, 0.0, 0.05, 0.2, 0.4];
    let dense_missing = [0.0, 0.0, 0.05, 0.2, 0.45];
    let keys: Vec<Vec<u8>> = (0..n).map(|i| format!("r0-{i}").into_bytes()).collect();
    let times: Vec<f64> = (0..n).map(|i| 1_764_441_357.0 + i as f64 / 3000.0).collect();
    let mut cats: Vec<Vec<Option<Vec<u8>>>> = Vec::new();
    for slot in 0..26 {
        let cells = (0..n)
            .map(|_| {
                // Log-uniform over a million IDs: a power law, as datagen's Zipf vocabularies.
                let id = (1e6f64.powf(rng.unit()) as u64).wrapping_mul(0x9E37_79B9) ^ slot;
                (rng.unit() >= cat_missing[slot as usize % 6]).then(|| format!("{:08x}", id as u32).into_bytes())
            })
            .collect();
        cats.push(cells);
    }
    let mut dense: Vec<(Vec<f64>, Vec<bool>)> = Vec::new();
    for j in 0..13 {
        let (mean, sigma) = (3.0 * rng.unit(), 0.5 + rng.unit());
        let values = (0..n)
            .map(|_| {
                let normal = (-2.0 * (1.0 - rng.unit()).ln()).sqrt() * (std::f64::consts::TAU * rng.unit()).cos();
                (mean + sigma * normal).exp().floor()
            })
            .collect();
        dense.push((values, (0..n).map(|_| rng.unit() < dense_missing[j % 5]).collect()));
    }
    let no_time_missing = vec![false; n];
    let mut columns = vec![
        Column::Text { cells: keys.iter().map(|k| Some(&k[..])).collect(), empty_is_null: false },
        Column::Number { values: &times, missing: &no_time_missing },
    ];
    let mut template = vec![Piece::Literal(br#"{"request_id":"#.to_vec()), Piece::Field(0)];
    template.extend([Piece::Literal(br#","ts":"#.to_vec()), Piece::Field(1)]);
    for (i, cells) in cats.iter().enumerate() {
        columns.push(Column::Text { cells: cells.iter().map(|c| c.as_deref()).collect(), empty_is_null: true });
        template.extend([Piece::Literal(format!(r#","C{}":"#, i + 1).into_bytes()), Piece::Field(columns.len() - 1)]);
    }
    for (j, (values, missing)) in dense.iter().enumerate() {
        columns.push(Column::Number { values, missing });
        template.extend([Piece::Literal(format!(r#","I{}":"#, j + 1).into_bytes()), Piece::Field(columns.len() - 1)]);
    }
    template.push(Piece::Literal(b"}".to_vec()));
    let (text, ends) = write_rows(&template, &columns).expect("rows");
    let mut start = 0;
    ends.iter()
        .map(|&end| {
            let message = text[start..end].to_vec();
            start = end;
            message
        })
        .collect()
}

/// The online example's fields, as the stream loader gives them to the decoder.
fn online_spec() -> EventSpec {
    let slots = (1..=26).map(|i| (vec![format!("C{i}")], Kind::Slot));
    let dense = (1..=13).map(|i| (vec![format!("I{i}")], Kind::Dense));
    EventSpec::new(
        slots.chain(dense).collect(),
        vec!["ts".into()],
        Some(vec!["request_id".into()]),
        1 << 20,
        MAX_VALUE_BYTES,
    )
}

/// A JSON value as the libraries give it, for the decoder's texts.
enum Scalar<'x> {
    Null,
    Bool(bool),
    Int(i64),
    Uint(u64),
    Float(f64),
    Str(&'x str),
    List,
    Object,
}

/// What the decoder needs of a library's DOM.
trait Node: Sized {
    fn member(&self, key: &str) -> Option<&Self>;
    fn scalar(&self) -> Scalar<'_>;
    fn items(&self) -> Vec<&Self>;
}

impl Node for simd_json::BorrowedValue<'_> {
    fn member(&self, key: &str) -> Option<&Self> {
        self.get(key)
    }

    fn scalar(&self) -> Scalar<'_> {
        use simd_json::{BorrowedValue as V, StaticNode as S};
        match self {
            V::Static(S::Null) => Scalar::Null,
            V::Static(S::Bool(b)) => Scalar::Bool(*b),
            V::Static(S::I64(i)) => Scalar::Int(*i),
            V::Static(S::U64(u)) => Scalar::Uint(*u),
            V::Static(S::F64(f)) => Scalar::Float(*f),
            V::String(s) => Scalar::Str(s),
            V::Array(_) => Scalar::List,
            V::Object(_) => Scalar::Object,
        }
    }

    fn items(&self) -> Vec<&Self> {
        self.as_array().map(|a| a.iter().collect()).unwrap_or_default()
    }
}

impl Node for sonic_rs::Value {
    fn member(&self, key: &str) -> Option<&Self> {
        self.as_object()?.get(&key)
    }

    fn scalar(&self) -> Scalar<'_> {
        if let Some(s) = self.as_str() {
            Scalar::Str(s)
        } else if let Some(i) = self.as_i64() {
            Scalar::Int(i)
        } else if let Some(u) = self.as_u64() {
            Scalar::Uint(u)
        } else if let Some(f) = self.as_f64() {
            Scalar::Float(f)
        } else if let Some(b) = self.as_bool() {
            Scalar::Bool(b)
        } else if self.is_array() {
            Scalar::List
        } else if self.is_object() {
            Scalar::Object
        } else {
            Scalar::Null
        }
    }

    fn items(&self) -> Vec<&Self> {
        self.as_array().map(|a| a.iter().collect()).unwrap_or_default()
    }
}

/// Python's `repr` of a float (the thresholds of its exponent; Rust's `{:?}` has the same).
fn float_repr(f: f64, out: &mut String) -> Option<()> {
    f.is_finite().then(|| write!(out, "{f:?}").expect("to a String"))
}

/// `scalar_text` of a value onto `out`, or None where the decoder refuses it.
fn push_text(v: Scalar<'_>, out: &mut String) -> Option<()> {
    match v {
        Scalar::Bool(b) => out.push_str(if b { "true" } else { "false" }),
        Scalar::Int(i) => write!(out, "{i}").expect("to a String"),
        Scalar::Uint(u) => write!(out, "{u}").expect("to a String"),
        Scalar::Float(f) => float_repr(f, out)?,
        Scalar::Str(s) if s.len() <= MAX_VALUE_BYTES && !s.contains([MULTI_SEP, FIELD_SEP]) => out.push_str(s),
        Scalar::Str(_) | Scalar::Null | Scalar::List | Scalar::Object => return None,
    }
    Some(())
}

/// The decoder's reading of a library's DOM: (event time, key, the fields' texts), or None.
fn read_dom<N: Node>(root: &N, spec: &EventSpec) -> Option<(f64, String, String)> {
    let at = |path: &[String]| path.iter().try_fold(root, |node, part| node.member(part));
    let time = match at(&spec.event_time)?.scalar() {
        Scalar::Int(i) => i as f64,
        Scalar::Uint(u) => u as f64,
        Scalar::Float(f) if f.is_finite() => f,
        _ => return None,
    };
    let mut key = String::new();
    if let Some(path) = &spec.event_key {
        push_text(at(path)?.scalar(), &mut key)?;
    }
    let mut values = String::with_capacity(512);
    for (i, (path, kind)) in spec.fields.iter().enumerate() {
        if i > 0 {
            values.push(FIELD_SEP);
        }
        let node = at(path)?;
        match (kind, node.scalar()) {
            (_, Scalar::Null) => {}
            (Kind::Dense, Scalar::Str(_) | Scalar::Bool(_) | Scalar::List | Scalar::Object) => return None,
            (Kind::Slot, Scalar::List) => {
                let items = node.items();
                for (j, item) in items.iter().filter(|i| !matches!(i.scalar(), Scalar::Null)).enumerate() {
                    if j > 0 {
                        values.push(MULTI_SEP);
                    }
                    push_text(item.scalar(), &mut values)?;
                }
            }
            (_, v) => push_text(v, &mut values)?,
        }
    }
    Some((time, key, values))
}

/// The three readers, each the decoder's answer for a message.
struct Readers {
    spec: EventSpec,
    copy: Vec<u8>,
    buffers: simd_json::Buffers,
}

impl Readers {
    fn ours(&self, raw: &[u8]) -> Option<(f64, String, String)> {
        let d = self.spec.decode(raw, true)?;
        Some((d.time, d.key.unwrap_or_default().into_owned(), d.values))
    }

    fn simd(&mut self, raw: &[u8]) -> Option<(f64, String, String)> {
        self.copy.clear(); // simd-json parses in place: a copy of the message
        self.copy.extend_from_slice(raw);
        let dom = simd_json::to_borrowed_value_with_buffers(&mut self.copy, &mut self.buffers).ok()?;
        read_dom(&dom, &self.spec)
    }

    fn sonic(&self, raw: &[u8]) -> Option<(f64, String, String)> {
        let dom: sonic_rs::Value = sonic_rs::from_slice(raw).ok()?;
        read_dom(&dom, &self.spec)
    }
}

/// The median seconds of one pass over `messages`, over `reps` passes after a warm one.
fn time_it(reps: usize, messages: &[Vec<u8>], mut read: impl FnMut(&[u8]) -> usize) -> f64 {
    let mut pass = || {
        let t = Instant::now();
        let mut sum = 0usize;
        for m in messages {
            sum = sum.wrapping_add(read(black_box(m)));
        }
        black_box(sum);
        t.elapsed().as_secs_f64()
    };
    pass();
    let mut times: Vec<f64> = (0..reps).map(|_| pass()).collect();
    times.sort_by(f64::total_cmp);
    times[reps / 2]
}

/// Edge cases of the decoder's semantics: a message, and Python's answer for its field `a`
/// (`json.loads` then `scalar_text`), or None where Python refuses it (a dead letter).
fn edge_cases() -> Vec<(&'static str, String, Option<&'static str>)> {
    let m = |a: &str| format!(r#"{{"t": 1, "k": "x", "a": {a}}}"#);
    vec![
        ("duplicate key: the last wins", r#"{"t": 1, "k": "x", "a": "first", "a": "last"}"#.into(), Some("last")),
        ("number text: 2.50 -> 2.5", m("2.50"), Some("2.5")),
        ("number text: 1E+2 -> 100.0", m("1E+2"), Some("100.0")),
        ("number text: -0 -> 0", m("-0"), Some("0")),
        ("an int beyond 64 bits", m("123456789012345678901"), Some("123456789012345678901")),
        ("a lone surrogate (no UTF-8 text to hash)", m(r#""x\ud800""#), None),
        ("a raw control character in a string", m("\"x\ty\""), None),
        ("NaN (not finite)", m("NaN"), None),
    ]
}

fn check_edges(readers: &mut Readers) {
    let spec = EventSpec::new(
        vec![(vec!["a".into()], Kind::Slot)],
        vec!["t".into()],
        Some(vec!["k".into()]),
        1 << 20,
        MAX_VALUE_BYTES,
    );
    let saved = std::mem::replace(&mut readers.spec, spec);
    println!("\nsemantics (a reader's answer must be Python's, or a refusal so that Python decides):");
    for (case, message, python) in edge_cases() {
        let raw = message.as_bytes();
        let answers =
            [("hand-written", readers.ours(raw)), ("simd-json", readers.simd(raw)), ("sonic-rs", readers.sonic(raw))];
        let shown: Vec<String> = answers
            .iter()
            .map(|(name, answer)| {
                let verdict = match (answer, python) {
                    (None, Some(_)) => "refuses: Python decides (ok)".to_owned(),
                    (None, None) => "refuses, as Python (ok)".to_owned(),
                    (Some((_, _, v)), Some(p)) if v == p => format!("{v:?} (ok)"),
                    (Some((_, _, v)), _) => format!("{v:?} (WRONG)"),
                };
                format!("{name}: {verdict}")
            })
            .collect();
        println!("  {case}; Python: {python:?}\n    {}", shown.join("; "));
    }
    readers.spec = saved;
}

fn main() {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<usize>().expect("MESSAGES REPETITIONS"));
    let (n, reps) = (args.next().unwrap_or(100_000), args.next().unwrap_or(9));
    let messages = messages(n);
    let bytes: usize = messages.iter().map(Vec::len).sum();
    let mut readers = Readers { spec: online_spec(), copy: Vec::new(), buffers: simd_json::Buffers::new(1024) };
    for m in &messages {
        let ours = readers.ours(m).expect("the hand-written reader takes every message");
        assert_eq!(readers.simd(m).as_ref(), Some(&ours), "simd-json: {}", String::from_utf8_lossy(m));
        assert_eq!(readers.sonic(m).as_ref(), Some(&ours), "sonic-rs: {}", String::from_utf8_lossy(m));
    }
    println!(
        "{n} messages, {:.0} bytes each on average, the same output from all three; median of {reps} passes",
        bytes as f64 / n as f64
    );
    println!("e.g. {}", String::from_utf8_lossy(&messages[0]));
    let spec = &readers.spec;
    let results = [
        (
            "hand-written (events::EventSpec::decode)",
            time_it(reps, &messages, |m| spec.decode(m, true).map_or(0, |d| d.values.len())),
        ),
        ("simd-json 0.19 (borrowed DOM)", {
            let (mut copy, mut buffers) = (Vec::new(), simd_json::Buffers::new(1024));
            time_it(reps, &messages, |m| {
                copy.clear();
                copy.extend_from_slice(m);
                let dom = simd_json::to_borrowed_value_with_buffers(&mut copy, &mut buffers).ok();
                dom.and_then(|d| read_dom(&d, spec)).map_or(0, |(_, _, v)| v.len())
            })
        }),
        (
            "sonic-rs 0.5 (Value DOM)",
            time_it(reps, &messages, |m| {
                let dom: Option<sonic_rs::Value> = sonic_rs::from_slice(m).ok();
                dom.and_then(|d| read_dom(&d, spec)).map_or(0, |(_, _, v)| v.len())
            }),
        ),
    ];
    let ours = results[0].1;
    println!("\n| reader | ns/message | MB/s | hand-written's speed over it |\n|---|---|---|---|");
    for (name, secs) in &results {
        println!("| {name} | {:.0} | {:.0} | {:.2}x |", secs * 1e9 / n as f64, bytes as f64 / secs / 1e6, secs / ours);
    }
    check_edges(&mut readers);
}
