//! The fast path of the stream loader's event decoding (`trillium/data/sources/events.py`): a
//! JSON message read for the fields a job maps, each as the text cell Python's `scalar_text`
//! makes of it.
//!
//! The Python decoder stays the reference, and the judge of every message this path does not
//! take: `decode` answers `None` for anything it is unsure of — a message Python would refuse,
//! and also one Python takes that this parser does not handle the same way (`NaN`, a UTF-8 BOM,
//! UTF-16, an integer beyond i64, a number too large for a float, a lone surrogate, nesting
//! deeper than `json_in::MAX_DEPTH`) — and the caller decodes that one in Python, which says why
//! it is bad or takes it. So what this path accepts must equal what Python makes of it, and what
//! it refuses costs only speed. Refusals are rare: malformed messages are.
//!
//! The JSON itself is `crate::json_in`'s, as Python's `json.loads`, `str(int)` and `repr(float)`
//! make it. Only the members a path reads are built; any other is checked and passed.

use std::borrow::Cow;
use std::mem::ManuallyDrop;

use crate::json_in::{finite, float_text, int_text, Json, Parser};

/// The ASCII unit separator: joins a list value's items (`MULTI_SEP` in events.py).
pub const MULTI_SEP: char = '\x1f';
/// The ASCII record separator: joins an event's field values (`FIELD_SEP` in events.py).
pub const FIELD_SEP: char = '\x1e';

/// Whether Python's `scalar_text` takes a string value as it is.
fn string_taken(s: &str, escaped: bool, max_value_bytes: usize) -> bool {
    // A separator is a control character, which a JSON string holds only escaped.
    s.len() <= max_value_bytes && !(escaped && s.contains([MULTI_SEP, FIELD_SEP]))
}

/// What a field is read as.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// A slot: a scalar, or a list of scalars (nulls dropped) joined with `MULTI_SEP`; null: missing.
    Slot,
    /// A dense value: a finite number (not a boolean); null: missing.
    Dense,
    /// A label read from the event: a scalar; null: missing.
    Label,
}

/// The fields a job maps, by path (a dotted path is split into its parts).
#[derive(Clone, Debug)]
pub struct EventSpec {
    pub fields: Vec<(Vec<String>, Kind)>,
    pub event_time: Vec<String>,
    pub event_key: Option<Vec<String>>,
    pub max_message_bytes: usize,
    pub max_value_bytes: usize,
    /// The top-level names the paths start with: an event's members are matched as they are
    /// read, and one no path reads is only checked.
    roots: Roots,
    /// The root of each path (`fields` by index, then the event time, then the key).
    root_of: Vec<usize>,
}

/// Top-level names, numbered in the order first given: an open-addressed table probed by FNV-1a
/// and compared byte by byte. A few dozen short names, looked up once per member of every event;
/// a general map's hashing and `memcmp` call were a tenth of a decode.
#[derive(Clone, Debug)]
struct Roots {
    names: Vec<Box<[u8]>>,
    /// A power of two of slots, at most half full: 1 + the index of a name, 0 where empty.
    slots: Vec<usize>,
}

impl Roots {
    fn new<'n>(paths: impl Iterator<Item = &'n str>) -> (Self, Vec<usize>) {
        let mut names: Vec<Box<[u8]>> = Vec::new();
        let root_of = paths
            .map(|name| {
                names.iter().position(|n| **n == *name.as_bytes()).unwrap_or_else(|| {
                    names.push(name.as_bytes().into());
                    names.len() - 1
                })
            })
            .collect();
        let mut roots = Self { slots: vec![0; (2 * names.len()).next_power_of_two().max(8)], names: Vec::new() };
        for name in names {
            let mut slot = roots.first_slot(&name);
            while roots.slots[slot] != 0 {
                slot = (slot + 1) & (roots.slots.len() - 1);
            }
            roots.names.push(name);
            roots.slots[slot] = roots.names.len();
        }
        (roots, root_of)
    }

    fn first_slot(&self, name: &[u8]) -> usize {
        let hash =
            name.iter().fold(0xcbf2_9ce4_8422_2325_u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
        hash as usize & (self.slots.len() - 1)
    }

    #[inline]
    fn get(&self, name: &[u8]) -> Option<usize> {
        let mut slot = self.first_slot(name);
        loop {
            let index = self.slots[slot].checked_sub(1)?;
            let known = &self.names[index];
            if known.len() == name.len() && known.iter().zip(name).all(|(a, b)| a == b) {
                return Some(index);
            }
            slot = (slot + 1) & (self.slots.len() - 1);
        }
    }

    fn len(&self) -> usize {
        self.names.len()
    }
}

/// One decoded event: its time, key and the text of each field of the spec, in its order and
/// joined by `FIELD_SEP` (a missing value is empty: the event's one text, as events.py keeps it).
#[derive(Clone, Debug, PartialEq)]
pub struct Decoded<'a> {
    pub time: f64,
    pub key: Option<Cow<'a, str>>,
    pub values: String,
}

/// A value a path reads. A number keeps its text as the message has it: a field's text of it is
/// made only where a field takes it (a float not written as repr writes it costs a formatting),
/// and an event time is parsed from it.
#[derive(Clone, Copy, Debug)]
enum Value<'j, 'a> {
    Null,
    /// A string or a boolean, as the message has it.
    Raw(&'a str),
    /// A string with an escape, unescaped.
    Made(&'j str),
    Int(&'a str),
    /// A float's text, and whether repr writes it so.
    Float(&'a str, bool),
    /// An object or an array.
    Tree(&'j Json<'a>),
}

impl<'j, 'a> Value<'j, 'a> {
    /// A value of a tree, or None: a string Python's `scalar_text` refuses.
    fn of(v: &'j Json<'a>, max_value_bytes: usize) -> Option<Self> {
        Some(match v {
            Json::Null => Value::Null,
            Json::Bool(b) => Value::Raw(if *b { "true" } else { "false" }),
            Json::Int(t) => Value::Int(t),
            Json::Float(t, as_repr) => Value::Float(t, *as_repr),
            Json::Str(Cow::Borrowed(s)) => string_taken(s, false, max_value_bytes).then_some(Value::Raw(s))?,
            Json::Str(Cow::Owned(s)) => string_taken(s, true, max_value_bytes).then_some(Value::Made(s))?,
            Json::Arr(_) | Json::Obj(_) => Value::Tree(v),
        })
    }

    /// Python's `scalar_text` of a scalar, or None where it refuses the value (or this path is
    /// unsure of it).
    #[inline(always)]
    fn text(self) -> Option<Cow<'a, str>> {
        match self {
            Value::Raw(s) => Some(Cow::Borrowed(s)),
            Value::Made(s) => Some(Cow::Owned(s.to_owned())),
            Value::Int(t) => int_text(t),
            Value::Float(t, as_repr) => float_text(t, as_repr),
            Value::Null | Value::Tree(_) => None,
        }
    }
}

/// A top-level member a path starts at, as the first pass leaves it: a scalar as its text in the
/// message, so that most members need no tree and nothing to drop.
#[derive(Clone, Copy, Debug)]
enum Member<'a> {
    /// Not in the message.
    Absent,
    Null,
    /// As `Value`'s.
    Raw(&'a str),
    Int(&'a str),
    Float(&'a str, bool),
    /// An object, an array or a string with an escape (`Members::trees`).
    Tree(usize),
}

/// The first pass's members, by root, and the trees they hold.
struct Members<'a> {
    roots: Vec<Member<'a>>,
    trees: Vec<Json<'a>>,
    max_value_bytes: usize,
}

impl<'a> Members<'a> {
    /// A root's value.
    #[inline]
    fn add(&mut self, root: usize, value: Json<'a>) {
        // A scalar owns no memory: not dropping it spares a call to drop glue a member.
        let value = ManuallyDrop::new(value);
        self.roots[root] = match *value {
            Json::Null => Member::Null,
            Json::Bool(b) => Member::Raw(if b { "true" } else { "false" }),
            Json::Int(t) => Member::Int(t),
            Json::Float(t, as_repr) => Member::Float(t, as_repr),
            Json::Str(Cow::Borrowed(s)) => Member::Raw(s),
            Json::Str(Cow::Owned(_)) | Json::Arr(_) | Json::Obj(_) => {
                self.trees.push(ManuallyDrop::into_inner(value));
                Member::Tree(self.trees.len() - 1)
            }
        };
    }

    /// What `path` reads from the member at its root, or None: nothing, or a value refused.
    #[inline(always)]
    fn at<'j>(&'j self, root: usize, path: &[String]) -> Option<Value<'j, 'a>> {
        let member = self.roots[root];
        if path.len() > 1 {
            let Member::Tree(t) = member else { return None };
            let v = path[1..].iter().try_fold(&self.trees[t], |node, part| node.get(part))?;
            return Value::of(v, self.max_value_bytes);
        }
        Some(match member {
            Member::Absent => return None,
            Member::Null => Value::Null,
            Member::Raw(s) => string_taken(s, false, self.max_value_bytes).then_some(Value::Raw(s))?,
            Member::Int(t) => Value::Int(t),
            Member::Float(t, as_repr) => Value::Float(t, as_repr),
            Member::Tree(t) => Value::of(&self.trees[t], self.max_value_bytes)?,
        })
    }
}

impl EventSpec {
    pub fn new(
        fields: Vec<(Vec<String>, Kind)>,
        event_time: Vec<String>,
        event_key: Option<Vec<String>>,
        max_message_bytes: usize,
        max_value_bytes: usize,
    ) -> Self {
        let paths = fields.iter().map(|(p, _)| p).chain([&event_time]).chain(&event_key);
        let (roots, root_of) = Roots::new(paths.map(|path| path[0].as_str()));
        Self { fields, event_time, event_key, max_message_bytes, max_value_bytes, roots, root_of }
    }

    /// Each root's member in the message (the last of duplicate members wins, as in a Python
    /// dict), or None: not a JSON object this parser is sure of.
    fn members_in<'a>(&self, raw: &'a [u8]) -> Option<Members<'a>> {
        let mut p = Parser::of(std::str::from_utf8(raw).ok()?);
        let roots = vec![Member::Absent; self.roots.len()];
        let mut members = Members { roots, trees: vec![], max_value_bytes: self.max_value_bytes };
        p.ws();
        p.object(|p, name| {
            match self.roots.get(name.as_bytes()) {
                Some(root) => members.add(root, p.value::<true>(1)?),
                None => drop(p.value::<false>(1)?),
            }
            Some(())
        })?;
        p.at_end().then_some(members)
    }

    /// The event in `raw`, with every field (`with_fields`) or its time and key only; None:
    /// let the reference decoder decide.
    pub fn decode<'a>(&self, raw: &'a [u8], with_fields: bool) -> Option<Decoded<'a>> {
        if raw.len() > self.max_message_bytes {
            return None;
        }
        let members = self.members_in(raw)?;
        let n = self.fields.len();
        let time = match members.at(self.root_of[n], &self.event_time)? {
            Value::Int(t) => t.parse::<i64>().ok()? as f64,
            Value::Float(t, _) => finite(t)?,
            _ => return None,
        };
        let key = match &self.event_key {
            Some(path) => Some(members.at(self.root_of[n + 1], path)?.text()?),
            None => None,
        };
        let mut values = String::new();
        if with_fields {
            values.reserve(raw.len());
            for (i, ((path, kind), &root)) in self.fields.iter().zip(&self.root_of).enumerate() {
                if i > 0 {
                    values.push(FIELD_SEP);
                }
                match (kind, members.at(root, path)?) {
                    (_, Value::Null) => {}
                    (Kind::Dense, Value::Raw(_) | Value::Made(_) | Value::Tree(_)) => return None,
                    (Kind::Slot, Value::Tree(Json::Arr(items))) => {
                        for (j, item) in items.iter().filter(|i| !matches!(i, Json::Null)).enumerate() {
                            if j > 0 {
                                values.push(MULTI_SEP);
                            }
                            values.push_str(&Value::of(item, self.max_value_bytes)?.text()?);
                        }
                    }
                    (_, Value::Raw(text) | Value::Made(text)) => values.push_str(text),
                    (_, value) => values.push_str(&value.text()?),
                }
            }
        }
        Some(Decoded { time, key, values })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_refuses_what_a_path_reads_and_what_none_does() {
        let spec = EventSpec::new(vec![(vec!["a".into()], Kind::Slot)], vec!["t".into()], None, 1 << 20, 1 << 16);
        let good = r#"[1, 2.5, "x\u00e9\ud83d\ude00", null, true, {"c": [{}, []]}]"#;
        let bad = ["01", "[1,]", r#"{"c": 1,}"#, r#""\ud800""#, "NaN", r#""a	b""#, "[[[", "{\"c\"}"];
        for name in ["a", "unread"] {
            let message = |value: &str| format!(r#" {{"t": 1, "{name}": {value}}} "#);
            assert!(spec.members_in(message(good).as_bytes()).is_some(), "{name}");
            for value in bad {
                assert!(spec.members_in(message(value).as_bytes()).is_none(), "{name}: {value}");
            }
        }
        for bad in [&b"[1]"[..], b"{} x", b"{\"t\": 1,}", b"\"t\""] {
            assert!(spec.members_in(bad).is_none(), "{}", String::from_utf8_lossy(bad));
        }
    }

    #[test]
    fn every_root_is_found_under_its_number_and_no_other_name_is() {
        let names: Vec<String> = (0..300).map(|i| format!("n{}", i * 7919 % 1000)).collect();
        let (roots, root_of) = Roots::new(names.iter().chain(&names).map(String::as_str));
        assert_eq!((roots.len(), root_of.len()), (300, 600));
        for (i, name) in names.iter().enumerate() {
            assert_eq!((roots.get(name.as_bytes()), root_of[i], root_of[300 + i]), (Some(i), i, i));
        }
        for other in ["", "n", "n10000", "x1", "n1 "] {
            assert_eq!(roots.get(other.as_bytes()), None, "{other}");
        }
    }

    #[test]
    fn a_nested_path_and_the_last_of_duplicate_members_are_read() {
        let fields = vec![(vec!["u".into(), "id".into()], Kind::Slot), (vec!["u".into(), "age".into()], Kind::Dense)];
        let spec = EventSpec::new(fields, vec!["t".into()], Some(vec!["k".into()]), 1 << 20, 1 << 16);
        let raw = br#"{"u": {"id": 1}, "k": "a", "x": [2], "t": 5, "u": {"age": 3, "id": "z"}}"#;
        let decoded = spec.decode(raw, true).expect("decoded");
        assert_eq!((decoded.time, decoded.key.as_deref(), decoded.values.as_str()), (5.0, Some("a"), "z\x1e3"));
    }

    #[test]
    fn each_kind_of_top_level_value_reads_as_python_writes_it() {
        let spec = EventSpec::new(
            vec![(vec!["a".into()], Kind::Slot), (vec!["d".into()], Kind::Dense)],
            vec!["t".into()],
            Some(vec!["k".into()]),
            1 << 20,
            8,
        );
        let read = |a: &str, d: &str, t: &str, k: &str| {
            let raw = format!(r#"{{"a": {a}, "d": {d}, "t": {t}, "k": {k}}}"#);
            spec.decode(raw.as_bytes(), true).map(|e| (e.values, e.time, e.key.map(Cow::into_owned)))
        };
        let want = |values: &str, time: f64, key: &str| Some((values.to_owned(), time, Some(key.to_owned())));
        assert_eq!(read("true", "-0", "-0", "false"), want("true\x1e0", 0.0, "false"));
        assert_eq!(read(r#""x\u00e9""#, "2.50", "1e2", "-0"), want("xé\x1e2.5", 100.0, "0"));
        assert_eq!(read("null", "1e-05", "1.5", r#""\/""#), want("\x1e1e-05", 1.5, "/"));
        assert_eq!(read("[1, null, 0.10]", "null", "7", "3"), want("1\x1f0.1\x1e", 7.0, "3"));
        // Refused: a dense string or boolean, a time not a number, a key or value too long.
        for (a, d, t, k) in [
            ("1", r#""1""#, "1", "1"),
            ("1", "true", "1", "1"),
            ("1", "1", r#""1""#, "1"),
            ("1", "1", "true", "1"),
            ("1", "1", "1", r#""123456789""#),
            (r#""123456789""#, "1", "1", "1"),
            ("{}", "1", "1", "1"),
            ("1", "[1]", "1", "1"),
            ("1", "1", "1e400", "1"),
            ("1", "1", "1", "123456789012345678901"),
        ] {
            assert_eq!(read(a, d, t, k), None, "{a} {d} {t} {k}");
        }
    }

    #[test]
    fn a_value_with_a_separator_is_left_to_the_reference() {
        let spec = EventSpec::new(vec![(vec!["a".into()], Kind::Slot)], vec!["t".into()], None, 1 << 20, 1 << 16);
        assert!(spec.decode(br#"{"t": 1, "a": "x"}"#, true).is_some());
        for sep in ["\\u001e", "\\u001f"] {
            let raw = format!(r#"{{"t": 1, "a": "x{sep}y"}}"#);
            assert!(spec.decode(raw.as_bytes(), true).is_none(), "{raw}");
        }
    }
}
