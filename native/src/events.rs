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

use crate::json_in::{finite, float_text, int_text, Json, Parser};

/// The ASCII unit separator: joins a list value's items (`MULTI_SEP` in events.py).
pub const MULTI_SEP: char = '\x1f';
/// The ASCII record separator: joins an event's field values (`FIELD_SEP` in events.py).
pub const FIELD_SEP: char = '\x1e';

/// Python's `scalar_text`, or None where it would refuse the value (or this path is unsure).
fn scalar_text<'a>(v: &Json<'a>, max_value_bytes: usize) -> Option<Cow<'a, str>> {
    match v {
        Json::Bool(b) => Some(Cow::Borrowed(if *b { "true" } else { "false" })),
        Json::Int(t) => int_text(t),
        Json::Float(t) => float_text(t),
        // A separator is a control character, which a JSON string holds only escaped: only a
        // string with an escape (owned) can hold one.
        Json::Str(s) => (s.len() <= max_value_bytes
            && !matches!(s, Cow::Owned(o) if o.contains([MULTI_SEP, FIELD_SEP])))
        .then(|| s.clone()),
        _ => None,
    }
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

fn at<'j, 'a>(event: &'j Json<'a>, path: &[String]) -> Option<&'j Json<'a>> {
    path.iter().try_fold(event, |node, part| node.get(part))
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

    /// Each root's value in the message (the last of duplicate members wins, as in a Python
    /// dict), or None: not a JSON object this parser is sure of.
    fn roots_in<'a>(&self, raw: &'a [u8]) -> Option<Vec<Option<Json<'a>>>> {
        let mut p = Parser::of(std::str::from_utf8(raw).ok()?);
        let mut found: Vec<Option<Json<'a>>> = (0..self.roots.len()).map(|_| None).collect();
        p.ws();
        p.object(|p, name| {
            match self.roots.get(name.as_bytes()) {
                Some(root) => found[root] = Some(p.value::<true>(1)?),
                None => drop(p.value::<false>(1)?),
            }
            Some(())
        })?;
        p.at_end().then_some(found)
    }

    /// The event in `raw`, with every field (`with_fields`) or its time and key only; None:
    /// let the reference decoder decide.
    pub fn decode<'a>(&self, raw: &'a [u8], with_fields: bool) -> Option<Decoded<'a>> {
        if raw.len() > self.max_message_bytes {
            return None;
        }
        let roots = self.roots_in(raw)?;
        let paths = self.fields.iter().map(|(p, _)| p).chain([&self.event_time]).chain(&self.event_key);
        let found: Vec<Option<&Json<'a>>> = paths
            .zip(&self.root_of)
            .map(|(path, &root)| roots[root].as_ref().and_then(|v| at(v, &path[1..])))
            .collect();
        let n = self.fields.len();
        let time = match found[n]? {
            Json::Int(t) => t.parse::<i64>().ok()? as f64,
            Json::Float(t) => finite(t)?,
            _ => return None,
        };
        let key = match &self.event_key {
            Some(_) => Some(scalar_text(found[n + 1]?, self.max_value_bytes)?),
            None => None,
        };
        let mut values = String::new();
        if with_fields {
            values.reserve(raw.len());
            for (i, ((_, kind), value)) in self.fields.iter().zip(&found).enumerate() {
                if i > 0 {
                    values.push(FIELD_SEP);
                }
                match (kind, (*value)?) {
                    (_, Json::Null) => {}
                    (Kind::Slot, Json::Arr(items)) => {
                        for (j, item) in items.iter().filter(|i| !matches!(i, Json::Null)).enumerate() {
                            if j > 0 {
                                values.push(MULTI_SEP);
                            }
                            values.push_str(&scalar_text(item, self.max_value_bytes)?);
                        }
                    }
                    (Kind::Dense, Json::Int(t)) => values.push_str(&int_text(t)?),
                    (Kind::Dense, Json::Float(t)) => values.push_str(&float_text(t)?),
                    (Kind::Dense, _) => return None,
                    (Kind::Slot | Kind::Label, v) => values.push_str(&scalar_text(v, self.max_value_bytes)?),
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
            assert!(spec.roots_in(message(good).as_bytes()).is_some(), "{name}");
            for value in bad {
                assert!(spec.roots_in(message(value).as_bytes()).is_none(), "{name}: {value}");
            }
        }
        for bad in [&b"[1]"[..], b"{} x", b"{\"t\": 1,}", b"\"t\""] {
            assert!(spec.roots_in(bad).is_none(), "{}", String::from_utf8_lossy(bad));
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
    fn a_value_with_a_separator_is_left_to_the_reference() {
        let spec = EventSpec::new(vec![(vec!["a".into()], Kind::Slot)], vec!["t".into()], None, 1 << 20, 1 << 16);
        assert!(spec.decode(br#"{"t": 1, "a": "x"}"#, true).is_some());
        for sep in ["\\u001e", "\\u001f"] {
            let raw = format!(r#"{{"t": 1, "a": "x{sep}y"}}"#);
            assert!(spec.decode(raw.as_bytes(), true).is_none(), "{raw}");
        }
    }
}
