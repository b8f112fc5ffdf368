//! The fast path of the stream loader's event decoding (`trillium/data/sources/events.py`): a
//! JSON message read for the fields a job maps, each as the text cell Python's `scalar_text`
//! makes of it.
//!
//! The Python decoder stays the reference, and the judge of every message this path does not
//! take: `decode` answers `None` for anything it is unsure of — a message Python would refuse,
//! and also one Python takes that this parser does not handle the same way (`NaN`, a UTF-8 BOM,
//! UTF-16, an integer beyond i64, a number too large for a float, a lone surrogate, nesting
//! deeper than `MAX_DEPTH`) — and the caller decodes that one in Python, which says why it is bad
//! or takes it. So what this path accepts must equal what Python makes of it, and what it refuses
//! costs only speed. Refusals are rare: malformed messages are.
//!
//! What it matches in Python: `json.loads` of UTF-8 (strict: no control character in a string;
//! whitespace is space, tab, CR, LF; a duplicate key's last value wins), `str(int)`, `repr(float)`
//! (shortest round-trip digits, exponent outside 1e-4 <= |x| < 1e16).

use std::borrow::Cow;

/// Nesting deeper than this is left to Python.
pub const MAX_DEPTH: usize = 64;
/// The ASCII unit separator: joins a list value's items (`MULTI_SEP` in events.py).
pub const MULTI_SEP: char = '\x1f';
/// The ASCII record separator: joins an event's field values (`FIELD_SEP` in events.py).
pub const FIELD_SEP: char = '\x1e';

/// Where a run of plain string bytes stops: a quote, a backslash, a control character.
const STRING_STOP: [bool; 256] = {
    let mut stop = [false; 256];
    let mut c = 0;
    while c < 0x20 {
        stop[c] = true;
        c += 1;
    }
    stop[b'"' as usize] = true;
    stop[b'\\' as usize] = true;
    stop
};

/// A parsed JSON value; a number is kept as its text (Python decides int or float by its form).
#[derive(Debug)]
enum Json<'a> {
    Null,
    Bool(bool),
    Int(&'a str),
    Float(&'a str),
    Str(Cow<'a, str>),
    Arr(Vec<Json<'a>>),
    Obj(Vec<(Cow<'a, str>, Json<'a>)>),
}

impl<'a> Json<'a> {
    fn get(&self, key: &str) -> Option<&Json<'a>> {
        match self {
            // The last of duplicate keys wins, as in a Python dict built in order.
            Json::Obj(items) => items.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }
}

struct Parser<'a> {
    s: &'a str,
    b: &'a [u8],
    i: usize,
}

impl<'a> Parser<'a> {
    #[inline]
    fn ws(&mut self) {
        if self.b.get(self.i).is_some_and(|&c| c > b' ') {
            return; // most often: no whitespace at all
        }
        let rest = &self.b[self.i..];
        self.i += rest.iter().position(|c| !matches!(c, b' ' | b'\t' | b'\n' | b'\r')).unwrap_or(rest.len());
    }

    /// The length of the run of plain string bytes from here: up to a quote, a backslash or a
    /// control character (which JSON refuses unescaped). The loop a message spends most in.
    fn plain_run(&self) -> usize {
        let rest = &self.b[self.i..];
        rest.iter().position(|&c| STRING_STOP[usize::from(c)]).unwrap_or(rest.len())
    }

    fn eat(&mut self, c: u8) -> Option<()> {
        if self.b.get(self.i) == Some(&c) {
            self.i += 1;
            Some(())
        } else {
            None
        }
    }

    fn lit(&mut self, word: &str) -> Option<()> {
        if self.b[self.i..].starts_with(word.as_bytes()) {
            self.i += word.len();
            Some(())
        } else {
            None
        }
    }

    /// An object from its `{` on: `member` is handed each key and parses the value after it.
    fn object(&mut self, mut member: impl FnMut(&mut Self, Cow<'a, str>) -> Option<()>) -> Option<()> {
        self.eat(b'{')?;
        self.ws();
        if self.eat(b'}').is_some() {
            return Some(());
        }
        loop {
            self.ws();
            let key = self.string()?;
            self.ws();
            self.eat(b':')?;
            member(self, key)?;
            self.ws();
            if self.eat(b',').is_none() {
                return self.eat(b'}');
            }
        }
    }

    /// The value here as a tree (`BUILD`), or only checked and passed: an object or array not
    /// built reads as `Null`, so a member no path reads allocates nothing. Inlined for scalars,
    /// what most members are; containers are `container`'s, out of line.
    #[inline(always)]
    fn value<const BUILD: bool>(&mut self, depth: usize) -> Option<Json<'a>> {
        self.ws();
        match *self.b.get(self.i)? {
            b'"' => self.string().map(Json::Str),
            b'-' | b'0'..=b'9' => self.number(),
            b'n' => self.lit("null").map(|_| Json::Null),
            b't' => self.lit("true").map(|_| Json::Bool(true)),
            b'f' => self.lit("false").map(|_| Json::Bool(false)),
            b'{' | b'[' => self.container::<BUILD>(depth),
            _ => None,
        }
    }

    /// An object or an array, as `value` reads it; out of line, as it recurses.
    #[inline(never)]
    fn container<const BUILD: bool>(&mut self, depth: usize) -> Option<Json<'a>> {
        if depth > MAX_DEPTH {
            return None;
        }
        if self.b[self.i] == b'{' {
            let mut items = Vec::new();
            self.object(|p, key| {
                let v = p.value::<BUILD>(depth + 1)?;
                if BUILD {
                    items.push((key, v));
                }
                Some(())
            })?;
            return Some(if BUILD { Json::Obj(items) } else { Json::Null });
        }
        self.i += 1;
        let mut items = Vec::new();
        self.ws();
        if self.eat(b']').is_none() {
            loop {
                let v = self.value::<BUILD>(depth + 1)?;
                if BUILD {
                    items.push(v);
                }
                self.ws();
                if self.eat(b',').is_none() {
                    self.eat(b']')?;
                    break;
                }
            }
        }
        Some(if BUILD { Json::Arr(items) } else { Json::Null })
    }

    /// `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?`, Python's NUMBER_RE.
    fn number(&mut self) -> Option<Json<'a>> {
        let start = self.i;
        let digits = |p: &mut Self| {
            let from = p.i;
            while p.i < p.b.len() && p.b[p.i].is_ascii_digit() {
                p.i += 1;
            }
            p.i - from
        };
        self.eat(b'-');
        if self.eat(b'0').is_none() && digits(self) == 0 {
            return None;
        }
        let mut float = false;
        if self.b.get(self.i) == Some(&b'.') && self.b.get(self.i + 1).is_some_and(u8::is_ascii_digit) {
            self.i += 1;
            digits(self);
            float = true;
        }
        if matches!(self.b.get(self.i), Some(b'e' | b'E')) {
            let mut j = self.i + 1;
            if matches!(self.b.get(j), Some(b'+' | b'-')) {
                j += 1;
            }
            if self.b.get(j).is_some_and(u8::is_ascii_digit) {
                self.i = j;
                digits(self);
                float = true;
            }
        }
        let text = &self.s[start..self.i];
        Some(if float { Json::Float(text) } else { Json::Int(text) })
    }

    fn hex4(&mut self) -> Option<u32> {
        let h = self.s.get(self.i..self.i + 4)?;
        if !h.bytes().all(|c| c.is_ascii_hexdigit()) {
            return None;
        }
        self.i += 4;
        u32::from_str_radix(h, 16).ok()
    }

    /// A string, borrowed from the message where it has no escape (inlined: a message's most
    /// common token; the rest is `escaped`'s, out of line).
    #[inline]
    fn string(&mut self) -> Option<Cow<'a, str>> {
        self.eat(b'"')?;
        let start = self.i;
        self.i += self.plain_run();
        if self.eat(b'"').is_some() {
            return Some(Cow::Borrowed(&self.s[start..self.i - 1]));
        }
        self.escaped(start)
    }

    /// The rest of a string from `start` on, where its plain run stopped at other than its end.
    #[cold]
    #[inline(never)]
    fn escaped(&mut self, start: usize) -> Option<Cow<'a, str>> {
        let mut out = String::from(&self.s[start..self.i]);
        loop {
            let c = *self.b.get(self.i)?;
            match c {
                b'"' => {
                    self.i += 1;
                    return Some(Cow::Owned(out));
                }
                b'\\' => {
                    let e = *self.b.get(self.i + 1)?;
                    self.i += 2;
                    match e {
                        b'"' => out.push('"'),
                        b'\\' => out.push('\\'),
                        b'/' => out.push('/'),
                        b'b' => out.push('\x08'),
                        b'f' => out.push('\x0c'),
                        b'n' => out.push('\n'),
                        b'r' => out.push('\r'),
                        b't' => out.push('\t'),
                        b'u' => {
                            let u = self.hex4()?;
                            let code = if (0xD800..0xDC00).contains(&u) {
                                // A surrogate pair, or a lone surrogate (left to Python).
                                if !self.b[self.i..].starts_with(b"\\u") {
                                    return None;
                                }
                                self.i += 2;
                                let lo = self.hex4()?;
                                if !(0xDC00..0xE000).contains(&lo) {
                                    return None;
                                }
                                0x10000 + ((u - 0xD800) << 10) + (lo - 0xDC00)
                            } else {
                                u
                            };
                            out.push(char::from_u32(code)?); // None for a lone low surrogate
                        }
                        _ => return None,
                    }
                }
                c if c < 0x20 => return None,
                _ => {
                    // Copy up to the next quote or backslash (whole UTF-8 sequences).
                    let from = self.i;
                    self.i += self.plain_run();
                    out.push_str(&self.s[from..self.i]);
                }
            }
        }
    }
}

/// Python's `repr(x)` of a finite float.
pub fn py_float_repr(x: f64) -> String {
    let e = format!("{x:e}"); // shortest round-trip digits: "-1.25e-5"
    let (mantissa, exp) = e.split_once('e').expect("{:e} has an exponent");
    let exp: i32 = exp.parse().expect("{:e} exponent");
    let (sign, mantissa) = mantissa.strip_prefix('-').map_or(("", mantissa), |m| ("-", m));
    let digits = even_on_tie(x.abs(), mantissa.chars().filter(|c| *c != '.').collect(), exp);
    let n = digits.len() as i32;
    let decpt = exp + 1; // the value is 0.<digits> * 10**decpt
    if decpt <= -4 || decpt > 16 {
        let rest = if n > 1 { format!(".{}", &digits[1..]) } else { String::new() };
        let esign = if exp < 0 { '-' } else { '+' };
        format!("{sign}{}{rest}e{esign}{:02}", &digits[..1], exp.abs())
    } else if decpt <= 0 {
        format!("{sign}0.{}{digits}", "0".repeat(-decpt as usize))
    } else if decpt >= n {
        format!("{sign}{digits}{}.0", "0".repeat((decpt - n) as usize))
    } else {
        format!("{sign}{}.{}", &digits[..decpt as usize], &digits[decpt as usize..])
    }
}

/// The shortest digits of `x` (> 0, `digits` x 10**(exp + 1 - len)) as Python's repr picks them
/// where two candidates of that length round-trip and `x` lies exactly halfway between them: the
/// even one (David Gay's dtoa rounds half to even; Rust's shortest rounds the tie up). Only a
/// value whose last digit is odd, and whose neighbour there is `x` too, is looked at closer.
fn even_on_tie(x: f64, digits: String, exp: i32) -> String {
    let n = digits.len();
    let last = digits.as_bytes()[n - 1] - b'0';
    if last % 2 == 0 {
        return digits;
    }
    let as_float = |d: &str| format!("{}.{}e{exp}", &d[..1], &d[1..]).parse::<f64>().ok();
    for other in [last.checked_sub(1), (last < 9).then_some(last + 1)].into_iter().flatten() {
        let candidate = format!("{}{}", &digits[..n - 1], other);
        if candidate.starts_with('0') || as_float(&candidate) != Some(x) {
            continue;
        }
        // Halfway: x's exact decimal expansion is the lower candidate, a 5, then zeros. A double's
        // expansion ends within 767 significant digits, so 800 give it exactly.
        let exact = format!("{x:.800e}");
        let (m, e) = exact.split_once('e').expect("{:e} has an exponent");
        let expansion: String = m.chars().filter(|c| *c != '.').collect();
        let lower = if other < last { &candidate } else { &digits };
        let (head, tail) = expansion.split_at(n);
        if e.parse::<i32>().ok() == Some(exp)
            && head == lower
            && tail.starts_with('5')
            && tail[1..].bytes().all(|c| c == b'0')
        {
            return candidate;
        }
    }
    digits
}

/// Whether Python's `repr(float(text))` is `text` itself, with no parse: plain notation
/// (`-?digits.digits`), at most 15 significant digits (so that they are the shortest that round
/// trip: no two such decimals are the same double), no trailing zero but in `.0`, and within the
/// range repr writes without an exponent (1e-4 <= |x| < 1e16). What JSON writers of Python,
/// Java and JavaScript write for most values.
fn written_as_repr(text: &str) -> bool {
    let unsigned = text.strip_prefix('-').unwrap_or(text);
    let Some(dot) = unsigned.bytes().position(|c| c == b'.') else { return false };
    let (int, frac) = (&unsigned[..dot], &unsigned[dot + 1..]);
    let digits = |t: &str| !t.is_empty() && t.bytes().all(|c| c.is_ascii_digit());
    if !digits(int) || !digits(frac) || (int.len() > 1 && int.starts_with('0')) {
        return false;
    }
    if frac.len() > 1 && frac.ends_with('0') {
        return false;
    }
    let significant = if int == "0" {
        let zeros = frac.len() - frac.trim_start_matches('0').len();
        if frac == "0" {
            return true; // 0.0
        }
        if zeros > 3 {
            return false; // below 1e-4: repr writes an exponent
        }
        frac.len() - zeros
    } else {
        int.len() + if frac == "0" { 0 } else { frac.len() }
    };
    significant <= 15
}

/// Python's `repr(float(text))` of a JSON number's text, or None if it is not finite.
fn float_text(text: &str) -> Option<Cow<'_, str>> {
    if written_as_repr(text) {
        return Some(Cow::Borrowed(text));
    }
    finite(text).map(|x| Cow::Owned(py_float_repr(x)))
}

/// A finite float from its JSON text (Rust's parse rounds correctly, as Python's float() does).
fn finite(text: &str) -> Option<f64> {
    text.parse::<f64>().ok().filter(|x| x.is_finite())
}

/// `str(int(text))`, for integers within i64 (a larger one is left to Python). JSON has no
/// leading zeros, so that is the text itself, but for "-0".
fn int_text(text: &str) -> Option<Cow<'_, str>> {
    let i = text.parse::<i64>().ok()?;
    Some(if text == "-0" { Cow::Owned(i.to_string()) } else { Cow::Borrowed(text) })
}

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
        let s = std::str::from_utf8(raw).ok()?;
        let mut p = Parser { s, b: s.as_bytes(), i: 0 };
        let mut found: Vec<Option<Json<'a>>> = (0..self.roots.len()).map(|_| None).collect();
        p.ws();
        p.object(|p, name| {
            match self.roots.get(name.as_bytes()) {
                Some(root) => found[root] = Some(p.value::<true>(1)?),
                None => drop(p.value::<false>(1)?),
            }
            Some(())
        })?;
        p.ws();
        (p.i == p.b.len()).then_some(found)
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
    fn float_repr_matches_python() {
        let cases = [
            (1.0, "1.0"),
            (-0.0, "-0.0"),
            (0.0, "0.0"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (123.456, "123.456"),
            (1.7e9, "1700000000.0"),
            (1e100, "1e+100"),
            (-2.5e300, "-2.5e+300"),
            (0.1, "0.1"),
            (1234567890123456.7, "1234567890123456.8"),
            // Exactly halfway between two shortest candidates: Python takes the even one.
            (2f64.powi(46) + 0.625, "70368744177664.62"),
            (-(2f64.powi(46) + 0.625), "-70368744177664.62"),
            (2f64.powi(46) + 0.875, "70368744177664.88"),
            (5e-324, "5e-324"),
            (f64::MAX, "1.7976931348623157e+308"),
        ];
        for (x, want) in cases {
            assert_eq!(py_float_repr(x), want, "{x:e}");
        }
    }

    #[test]
    fn a_float_written_as_repr_is_taken_as_written() {
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        let (mut taken, mut tried) = (0, 0);
        for _ in 0..20_000 {
            let r = next();
            let x = f64::from_bits(r) % 1e18; // any bits, then magnitudes around repr's switch points too
            let y = (r % 10_000_000) as f64 / 10f64.powi((r >> 40) as i32 % 12);
            for v in [x, y, -y] {
                if !v.is_finite() {
                    continue;
                }
                let digits = (next() % 19) as usize;
                for text in [py_float_repr(v), format!("{v}"), format!("{v:.1}"), format!("{v:.digits$}")] {
                    tried += 1;
                    if written_as_repr(&text) {
                        taken += 1;
                        assert_eq!(py_float_repr(text.parse().unwrap()), text);
                    }
                }
            }
        }
        assert!(taken > tried / 4, "{taken} of {tried}");
        for (text, taken) in [("1.5", true), ("2.50", false), ("0.0001", true), ("0.00001", false), ("1e3", false)] {
            assert_eq!(written_as_repr(text), taken, "{text}");
        }
        for text in ["1234567890123456.0", "0.30000000000000004", "-0.0", "10.0", "1.0e+2", "007.5"] {
            assert_eq!(float_text(text).map(Cow::into_owned), finite(text).map(py_float_repr), "{text}");
        }
    }

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
