//! The hand-written JSON reader (`json_in`, as `events::EventSpec::decode` uses it) against
//! simd-json and sonic-rs, on the online example's impression events, Python-free:
//!
//! `cd native/json_bench && cargo run --release [-- MESSAGES REPETITIONS]`
//!
//! The messages are the ones `trillium replay` sends for `examples/online/job.yaml` (written by
//! `json_out::write_rows` in that event's layout: `request_id`, `ts`, C1..C26 as 8 hex digits or
//! null, I1..I13 as counts or null; datagen's missing rates). Each implementation reads every
//! message for the job's 39 fields, its event time and its key, and makes the decoder's output of
//! it (the fields' texts joined by `FIELD_SEP`, as Python's `scalar_text` writes them). The
//! libraries parse to their DOM and either look each path up or walk the top-level members once
//! (as the decoder does, with a table of the names the paths start at); sonic-rs also lazily,
//! with no DOM. Their numbers are written back as Python does. Every reader's output is checked
//! equal to the decoder's first. Then, warm, ns/message and MB/s of each reader's median pass,
//! the readers' passes interleaved (the machine's other work weighs on all alike).
//!
//! The decision rule, fixed before measuring: keep the hand-written reader if it is at least
//! 1.25x as fast as the faster library on this workload, or if the libraries do not give what
//! Python's `json.loads` gives on the edge cases the decoder relies on (the last of duplicate
//! keys, a number's text, a lone surrogate, a raw control character in a string: answering
//! differently, rather than refusing so that Python decides, is wrong). Otherwise a library would
//! do, and it is reported.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::hash::{BuildHasherDefault, Hasher};
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
    /// A string the library would not decode (a lazy value's, checked only when read).
    Bad,
}

/// What the decoder needs of a library's value.
trait Node: Sized {
    fn member(&self, key: &str) -> Option<&Self>;
    /// Each member of an object, in the order the library keeps them.
    fn for_each_member<'n>(&'n self, f: impl FnMut(&str, &'n Self));
    fn scalar(&self) -> Scalar<'_>;
    /// A list's items, or None: not read here (the decoder would refuse the message).
    fn items(&self) -> Option<Vec<&Self>>;
}

impl Node for simd_json::BorrowedValue<'_> {
    fn member(&self, key: &str) -> Option<&Self> {
        self.get(key)
    }

    fn for_each_member<'n>(&'n self, mut f: impl FnMut(&str, &'n Self)) {
        self.as_object().into_iter().flat_map(|o| o.iter()).for_each(|(k, v)| f(k, v));
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

    fn items(&self) -> Option<Vec<&Self>> {
        Some(self.as_array()?.iter().collect())
    }
}

impl Node for sonic_rs::Value {
    fn member(&self, key: &str) -> Option<&Self> {
        self.as_object()?.get(&key)
    }

    fn for_each_member<'n>(&'n self, mut f: impl FnMut(&str, &'n Self)) {
        self.as_object().into_iter().flat_map(|o| o.iter()).for_each(|(k, v)| f(k, v));
    }

    fn scalar(&self) -> Scalar<'_> {
        scalar_of(self)
    }

    fn items(&self) -> Option<Vec<&Self>> {
        Some(self.as_array()?.iter().collect())
    }
}

/// sonic-rs's lazy value: top-level members only (a nested path or a list is refused).
impl Node for sonic_rs::LazyValue<'_> {
    fn member(&self, _: &str) -> Option<&Self> {
        None
    }

    fn for_each_member<'n>(&'n self, _: impl FnMut(&str, &'n Self)) {}

    fn scalar(&self) -> Scalar<'_> {
        scalar_of(self)
    }

    fn items(&self) -> Option<Vec<&Self>> {
        None
    }
}

/// A sonic-rs value (its DOM's or a lazy one) as a `Scalar`.
fn scalar_of<V: JsonValueTrait>(v: &V) -> Scalar<'_> {
    if v.is_str() {
        v.as_str().map_or(Scalar::Bad, Scalar::Str)
    } else if let Some(i) = v.as_i64() {
        Scalar::Int(i)
    } else if let Some(u) = v.as_u64() {
        Scalar::Uint(u)
    } else if let Some(f) = v.as_f64() {
        Scalar::Float(f)
    } else if let Some(b) = v.as_bool() {
        Scalar::Bool(b)
    } else if v.is_array() {
        Scalar::List
    } else if v.is_object() {
        Scalar::Object
    } else {
        Scalar::Null
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
        Scalar::Str(_) | Scalar::Null | Scalar::List | Scalar::Object | Scalar::Bad => return None,
    }
    Some(())
}

/// FNV-1a, the hash of the decoder's own table of top-level names.
struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Hasher for Fnv {
    fn write(&mut self, bytes: &[u8]) {
        self.0 = bytes.iter().fold(self.0, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    }

    fn finish(&self) -> u64 {
        self.0
    }
}

/// The spec's paths by top-level name, for the readers that walk an object's members once.
struct Roots {
    number: HashMap<String, usize, BuildHasherDefault<Fnv>>,
    /// The root of each path: the fields, then the event time, then the key.
    root_of: Vec<usize>,
}

impl Roots {
    fn of(spec: &EventSpec) -> Self {
        let paths = spec.fields.iter().map(|(p, _)| p).chain([&spec.event_time]).chain(&spec.event_key);
        let mut number = HashMap::default();
        let root_of = paths
            .map(|p| {
                let n = number.len();
                *number.entry(p[0].clone()).or_insert(n)
            })
            .collect();
        Self { number, root_of }
    }
}

/// The decoder's reading of an event, its paths found by `at` (path number, path): (event
/// time, key, the fields' texts), or None.
fn read_event<'n, N: Node + 'n>(
    spec: &EventSpec,
    at: impl Fn(usize, &[String]) -> Option<&'n N>,
) -> Option<(f64, String, String)> {
    let n = spec.fields.len();
    let time = match at(n, &spec.event_time)?.scalar() {
        Scalar::Int(i) => i as f64,
        Scalar::Uint(u) => u as f64,
        Scalar::Float(f) if f.is_finite() => f,
        _ => return None,
    };
    let mut key = String::new();
    if let Some(path) = &spec.event_key {
        push_text(at(n + 1, path)?.scalar(), &mut key)?;
    }
    let mut values = String::with_capacity(512);
    for (i, (path, kind)) in spec.fields.iter().enumerate() {
        if i > 0 {
            values.push(FIELD_SEP);
        }
        let node = at(i, path)?;
        match (kind, node.scalar()) {
            (_, Scalar::Null) => {}
            (Kind::Dense, Scalar::Str(_) | Scalar::Bool(_) | Scalar::List | Scalar::Object | Scalar::Bad) => {
                return None
            }
            (Kind::Slot, Scalar::List) => {
                let items = node.items()?;
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

/// Each path looked up in the DOM, member by member.
fn read_per_path<N: Node>(root: &N, spec: &EventSpec) -> Option<(f64, String, String)> {
    read_event(spec, |_, path| path.iter().try_fold(root, |node, part| node.member(part)))
}

/// The DOM's top-level members walked once, each to the paths it roots (the last of duplicate
/// names wins), as the hand-written decoder does.
fn read_walked<N: Node>(root: &N, spec: &EventSpec, roots: &Roots) -> Option<(f64, String, String)> {
    let mut found = vec![None; roots.number.len()];
    root.for_each_member(|name, value| {
        if let Some(&r) = roots.number.get(name) {
            found[r] = Some(value);
        }
    });
    read_event(spec, |i, path| path[1..].iter().try_fold(found[roots.root_of[i]]?, |node, part| node.member(part)))
}

/// sonic-rs's lazy object iterator: no DOM; each top-level member a path roots kept as a lazy
/// value (the last of duplicate names wins), the others skipped.
fn read_lazy(raw: &[u8], spec: &EventSpec, roots: &Roots) -> Option<(f64, String, String)> {
    let mut found: Vec<Option<sonic_rs::LazyValue<'_>>> = vec![None; roots.number.len()];
    for member in sonic_rs::to_object_iter(raw) {
        let (name, value) = member.ok()?;
        if let Some(&r) = roots.number.get(&*name) {
            found[r] = Some(value);
        }
    }
    read_event(spec, |i, path| if path.len() > 1 { None } else { found[roots.root_of[i]].as_ref() })
}

/// The readers measured.
#[derive(Clone, Copy)]
enum Reader {
    HandWritten,
    SimdPerPath,
    SimdWalked,
    SonicPerPath,
    SonicWalked,
    SonicLazy,
}

const READERS: [(Reader, &str); 6] = [
    (Reader::HandWritten, "hand-written (`events::EventSpec::decode`)"),
    (Reader::SimdPerPath, "simd-json 0.19, borrowed DOM, a lookup per path"),
    (Reader::SimdWalked, "simd-json 0.19, borrowed DOM, members walked once"),
    (Reader::SonicPerPath, "sonic-rs 0.5, `Value` DOM, a lookup per path"),
    (Reader::SonicWalked, "sonic-rs 0.5, `Value` DOM, members walked once"),
    (Reader::SonicLazy, "sonic-rs 0.5, lazy `to_object_iter`, no DOM"),
];

/// The readers' state, and each one's answer for a message.
struct Readers {
    spec: EventSpec,
    roots: Roots,
    copy: Vec<u8>,
    buffers: simd_json::Buffers,
}

impl Readers {
    fn new(spec: EventSpec) -> Self {
        Self { roots: Roots::of(&spec), spec, copy: Vec::new(), buffers: simd_json::Buffers::new(1024) }
    }

    fn read(&mut self, reader: Reader, raw: &[u8]) -> Option<(f64, String, String)> {
        let spec = &self.spec;
        match reader {
            Reader::HandWritten => {
                let d = spec.decode(raw, true)?;
                Some((d.time, d.key.unwrap_or_default().into_owned(), d.values))
            }
            Reader::SimdPerPath | Reader::SimdWalked => {
                self.copy.clear(); // simd-json parses in place: a copy of the message
                self.copy.extend_from_slice(raw);
                let dom = simd_json::to_borrowed_value_with_buffers(&mut self.copy, &mut self.buffers).ok()?;
                match reader {
                    Reader::SimdPerPath => read_per_path(&dom, spec),
                    _ => read_walked(&dom, spec, &self.roots),
                }
            }
            Reader::SonicPerPath | Reader::SonicWalked => {
                let dom: sonic_rs::Value = sonic_rs::from_slice(raw).ok()?;
                match reader {
                    Reader::SonicPerPath => read_per_path(&dom, spec),
                    _ => read_walked(&dom, spec, &self.roots),
                }
            }
            Reader::SonicLazy => read_lazy(raw, spec, &self.roots),
        }
    }
}

/// The seconds of one pass of `reader` over `messages`.
fn pass(readers: &mut Readers, reader: Reader, messages: &[Vec<u8>]) -> f64 {
    let t = Instant::now();
    let mut sum = 0usize;
    for m in messages {
        sum = sum.wrapping_add(readers.read(reader, black_box(m)).map_or(0, |r| r.2.len()));
    }
    black_box(sum);
    t.elapsed().as_secs_f64()
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
        ("a bad member no path reads", r#"{"t": 1, "k": "x", "a": "ok", "z": [1,]}"#.into(), None),
        ("text after the object", r#"{"t": 1, "k": "x", "a": "ok"} x"#.into(), None),
    ]
}

fn check_edges() {
    let spec = EventSpec::new(
        vec![(vec!["a".into()], Kind::Slot)],
        vec!["t".into()],
        Some(vec!["k".into()]),
        1 << 20,
        MAX_VALUE_BYTES,
    );
    let mut readers = Readers::new(spec);
    println!("\nSemantics: a reader's answer for `a` must be Python's, or a refusal (Python then decides).\n");
    println!("| case | Python | {} |", READERS.map(|(_, name)| name).join(" | "));
    println!("|---|---|{}", "---|".repeat(READERS.len()));
    for (case, message, python) in edge_cases() {
        let raw = message.as_bytes();
        let cells = READERS.map(|(reader, _)| match (readers.read(reader, raw), python) {
            (None, _) => "ok (refuses)".to_owned(),
            (Some((_, _, v)), Some(p)) if v == p => "ok".to_owned(),
            (Some((_, _, v)), _) => format!("WRONG: {v:?}"),
        });
        let python = python.map_or("refuses".to_owned(), |p| format!("{p:?}"));
        println!("| {case} | {python} | {} |", cells.join(" | "));
    }
}

fn main() {
    let mut args = std::env::args().skip(1).map(|a| a.parse::<usize>().expect("MESSAGES REPETITIONS"));
    let (n, reps) = (args.next().unwrap_or(100_000), args.next().unwrap_or(9));
    let messages = messages(n);
    let bytes: usize = messages.iter().map(Vec::len).sum();
    let mut readers = Readers::new(online_spec());
    for m in &messages {
        let ours = readers.read(Reader::HandWritten, m).expect("the hand-written reader takes every message");
        for (reader, name) in &READERS[1..] {
            assert_eq!(readers.read(*reader, m).as_ref(), Some(&ours), "{name}: {}", String::from_utf8_lossy(m));
        }
    }
    println!(
        "{n} messages, {:.0} bytes each on average, the same output from every reader; median of {reps} passes each, interleaved",
        bytes as f64 / n as f64
    );
    println!("e.g. {}", String::from_utf8_lossy(&messages[0]));
    // A warm pass of each, then the readers in turn, pass after pass: the machine's other work
    // weighs on all of them alike. The median pass of each.
    for (reader, _) in READERS {
        pass(&mut readers, reader, &messages);
    }
    let mut passes = READERS.map(|_| Vec::new());
    for _ in 0..reps {
        for ((reader, _), p) in READERS.iter().zip(&mut passes) {
            p.push(pass(&mut readers, *reader, &messages));
        }
    }
    let times = passes.map(|mut p| {
        p.sort_by(f64::total_cmp);
        p[p.len() / 2]
    });
    println!("\n| reader | ns/message | MB/s | hand-written's speed over it |\n|---|---|---|---|");
    for ((_, name), secs) in READERS.iter().zip(times) {
        let ns = secs * 1e9 / n as f64;
        println!("| {name} | {ns:.0} | {:.0} | {:.2}x |", bytes as f64 / secs / 1e6, secs / times[0]);
    }
    check_edges();
}
