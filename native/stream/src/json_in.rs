//! A strict JSON reader for the event decoder (`crate::events`), the same as Python's
//! `json.loads` of UTF-8 where it answers at all: no control character in a string; whitespace
//! is space, tab, CR, LF; a duplicate key's last value wins (the caller's to keep). It answers
//! None where Python would refuse, and also where Python takes what this reader does not handle
//! the same way (`NaN`, a UTF-8 BOM, a lone surrogate, nesting deeper than `MAX_DEPTH`).
//!
//! Also the texts Python makes of a JSON number: `str(int)` and `repr(float)` (shortest
//! round-trip digits, exponent outside 1e-4 <= |x| < 1e16).

use std::borrow::Cow;

/// Nesting deeper than this is left to Python.
pub const MAX_DEPTH: usize = 64;

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
pub(crate) enum Json<'a> {
    Null,
    Bool(bool),
    Int(&'a str),
    /// A float's text, and whether it is what Python's `repr` writes of it (`written_as_repr`).
    Float(&'a str, bool),
    Str(Cow<'a, str>),
    Arr(Vec<Json<'a>>),
    Obj(Vec<(Cow<'a, str>, Json<'a>)>),
}

impl<'a> Json<'a> {
    /// An object's member (the last of duplicate keys), or None.
    pub(crate) fn get(&self, key: &str) -> Option<&Json<'a>> {
        match self {
            // The last of duplicate keys wins, as in a Python dict built in order.
            Json::Obj(items) => items.iter().rev().find(|(k, _)| k == key).map(|(_, v)| v),
            _ => None,
        }
    }
}

pub(crate) struct Parser<'a> {
    s: &'a str,
    b: &'a [u8],
    i: usize,
}

impl<'a> Parser<'a> {
    pub(crate) fn of(text: &'a str) -> Self {
        Self { s: text, b: text.as_bytes(), i: 0 }
    }

    /// Whether nothing but whitespace is left.
    pub(crate) fn at_end(&mut self) -> bool {
        self.ws();
        self.i == self.b.len()
    }

    #[inline]
    pub(crate) fn ws(&mut self) {
        // Most often no whitespace, or the one space after a `:` or `,` that most writers put.
        match self.b.get(self.i) {
            Some(&c) if c > b' ' => return,
            Some(b' ') if self.b.get(self.i + 1).is_some_and(|&c| c > b' ') => {
                self.i += 1;
                return;
            }
            _ => {}
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
    pub(crate) fn object(&mut self, mut member: impl FnMut(&mut Self, Cow<'a, str>) -> Option<()>) -> Option<()> {
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
    pub(crate) fn value<const BUILD: bool>(&mut self, depth: usize) -> Option<Json<'a>> {
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

    /// `-?(0|[1-9][0-9]*)(\.[0-9]+)?([eE][-+]?[0-9]+)?`, Python's NUMBER_RE. A float's form is
    /// judged as it is scanned (`written_as_repr`).
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
        let int_is_zero = self.eat(b'0').is_some();
        let int_digits = if int_is_zero { 1 } else { digits(self) };
        if int_digits == 0 {
            return None;
        }
        let mut fraction = None;
        if self.b.get(self.i) == Some(&b'.') && self.b.get(self.i + 1).is_some_and(u8::is_ascii_digit) {
            self.i += 1;
            let from = self.i;
            digits(self);
            fraction = Some(&self.b[from..self.i]);
        }
        let mut exponent = false;
        if matches!(self.b.get(self.i), Some(b'e' | b'E')) {
            let mut j = self.i + 1;
            if matches!(self.b.get(j), Some(b'+' | b'-')) {
                j += 1;
            }
            if self.b.get(j).is_some_and(u8::is_ascii_digit) {
                self.i = j;
                digits(self);
                exponent = true;
            }
        }
        let text = &self.s[start..self.i];
        Some(match (fraction, exponent) {
            (None, false) => Json::Int(text),
            (Some(fraction), false) => Json::Float(text, written_as_repr(int_digits, int_is_zero, fraction)),
            (_, true) => Json::Float(text, false),
        })
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

/// Whether Python's `repr(float(text))` is the text itself, for a JSON number written
/// `-?int.fraction` (no exponent; `int` has no leading zero), with no parse: at most 15
/// significant digits (so that they are the shortest that round trip: no two such decimals are
/// the same double), no trailing zero but in `.0`, and within the range repr writes without an
/// exponent (1e-4 <= |x| < 1e16). What JSON writers of Python, Java and JavaScript write for most
/// values.
fn written_as_repr(int_digits: usize, int_is_zero: bool, fraction: &[u8]) -> bool {
    if fraction.len() > 1 && fraction.ends_with(b"0") {
        return false;
    }
    if fraction == b"0" {
        return int_digits <= 15; // 0.0 included
    }
    if int_is_zero {
        let zeros = fraction.iter().take_while(|&&c| c == b'0').count();
        return zeros <= 3 && fraction.len() - zeros <= 15; // below 1e-4 repr writes an exponent
    }
    int_digits + fraction.len() <= 15
}

/// Python's `repr(float(text))` of a JSON float's text (`Json::Float`), or None if it is not finite.
pub(crate) fn float_text(text: &str, as_repr: bool) -> Option<Cow<'_, str>> {
    if as_repr {
        return Some(Cow::Borrowed(text));
    }
    finite(text).map(|x| Cow::Owned(py_float_repr(x)))
}

/// A finite float from its JSON text (Rust's parse rounds correctly, as Python's float() does).
pub(crate) fn finite(text: &str) -> Option<f64> {
    text.parse::<f64>().ok().filter(|x| x.is_finite())
}

/// `str(int(text))`, for integers within i64 (a larger one is left to Python). JSON has no
/// leading zeros, so that is the text itself, but for "-0".
pub(crate) fn int_text(text: &str) -> Option<Cow<'_, str>> {
    let i = text.parse::<i64>().ok()?;
    Some(if text == "-0" { Cow::Owned(i.to_string()) } else { Cow::Borrowed(text) })
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

    /// A whole text read as one JSON number.
    fn number(text: &str) -> Option<Json<'_>> {
        let mut p = Parser::of(text);
        let n = p.number()?;
        p.at_end().then_some(n)
    }

    fn taken_as_written(text: &str) -> bool {
        matches!(number(text), Some(Json::Float(_, true)))
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
                    if taken_as_written(&text) {
                        taken += 1;
                        assert_eq!(py_float_repr(text.parse().unwrap()), text);
                    }
                }
            }
        }
        assert!(taken > tried / 4, "{taken} of {tried}");
        for (text, taken) in [("1.5", true), ("2.50", false), ("0.0001", true), ("0.00001", false), ("1e3", false)] {
            assert_eq!(taken_as_written(text), taken, "{text}");
        }
        for text in ["1234567890123456.0", "0.30000000000000004", "-0.0", "0.0", "0.00012", "10.0", "1.0e+2"] {
            let Some(Json::Float(t, as_repr)) = number(text) else { panic!("{text} is a float") };
            assert_eq!(float_text(t, as_repr).map(Cow::into_owned), finite(text).map(py_float_repr), "{text}");
        }
    }
}
