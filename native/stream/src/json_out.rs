//! JSON text of events, as `trillium replay` sends them: an event's fixed layout (literal text
//! with a column's value at each field) filled in row by row, strings quoted and escaped as JSON
//! requires, numbers in their shortest round-trip form, missing cells as `null`.

use std::io::Write;

/// A part of an event's text: literal JSON, or the value of a column.
pub enum Piece {
    Literal(Vec<u8>),
    Field(usize),
}

/// A column's values, a row each.
pub enum Column<'a> {
    /// Text, written as JSON strings: `None` (and "" with `empty_is_null`) as `null`.
    Text { cells: Vec<Option<&'a [u8]>>, empty_is_null: bool },
    /// Numbers: `null` where `missing`; NaN and the infinities as Python's `json.dumps` writes them.
    Number { values: &'a [f64], missing: &'a [bool] },
}

impl Column<'_> {
    fn rows(&self) -> usize {
        match self {
            Column::Text { cells, .. } => cells.len(),
            Column::Number { values, .. } => values.len(),
        }
    }

    fn write(&self, row: usize, out: &mut Vec<u8>) {
        match self {
            Column::Text { cells, empty_is_null } => match cells[row] {
                Some(text) if !(*empty_is_null && text.is_empty()) => write_string(text, out),
                _ => out.extend_from_slice(b"null"),
            },
            Column::Number { values, missing } => {
                if missing[row] {
                    out.extend_from_slice(b"null")
                } else {
                    write_number(values[row], out)
                }
            }
        }
    }
}

/// Every row's text, one after another in one buffer, and where each ends. The template's
/// fields must name columns that exist, and the columns must have the same number of rows.
pub fn write_rows(template: &[Piece], columns: &[Column<'_>]) -> Result<(Vec<u8>, Vec<usize>), String> {
    let rows = columns.first().map_or(0, Column::rows);
    if let Some(c) = columns.iter().position(|c| c.rows() != rows) {
        return Err(format!("column {c} has {} rows, column 0 has {rows}", columns[c].rows()));
    }
    if let Some(&Piece::Field(f)) = template.iter().find(|p| matches!(p, Piece::Field(f) if *f >= columns.len())) {
        return Err(format!("the template names column {f} of {}", columns.len()));
    }
    let (mut out, mut ends) = (Vec::new(), Vec::with_capacity(rows));
    for row in 0..rows {
        for piece in template {
            match piece {
                Piece::Literal(text) => out.extend_from_slice(text),
                Piece::Field(f) => columns[*f].write(row, &mut out),
            }
        }
        ends.push(out.len());
    }
    Ok((out, ends))
}

/// A JSON string: `"` and `\` escaped, control characters as `\n`-style or `\u00XX` escapes, all
/// else (UTF-8 included) as it is.
pub fn write_string(text: &[u8], out: &mut Vec<u8>) {
    out.push(b'"');
    let mut plain = 0; // the start of the run of bytes not yet written that need no escape
    for (i, &b) in text.iter().enumerate() {
        let escape: &[u8] = match b {
            b'"' => b"\\\"",
            b'\\' => b"\\\\",
            b'\n' => b"\\n",
            b'\r' => b"\\r",
            b'\t' => b"\\t",
            0x08 => b"\\b",
            0x0c => b"\\f",
            0..=0x1f => b"",
            _ => continue,
        };
        out.extend_from_slice(&text[plain..i]);
        if escape.is_empty() {
            write!(out, "\\u{b:04x}").expect("writing to a Vec");
        } else {
            out.extend_from_slice(escape);
        }
        plain = i + 1;
    }
    out.extend_from_slice(&text[plain..]);
    out.push(b'"');
}

/// A JSON number in its shortest form that reads back as the same f64, with an exponent where
/// Python's repr has one.
pub fn write_number(v: f64, out: &mut Vec<u8>) {
    if v.is_nan() {
        out.extend_from_slice(b"NaN");
    } else if v.is_infinite() {
        out.extend_from_slice(if v > 0.0 { b"Infinity" } else { b"-Infinity" });
    } else if v == 0.0 || (1e-4..1e16).contains(&v.abs()) {
        write!(out, "{v}").expect("writing to a Vec");
    } else {
        // Beyond, Python's repr turns to an exponent too: 1e300 in 301 digits would read back
        // in Python as an int, not the float it was.
        write!(out, "{v:e}").expect("writing to a Vec");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn string(text: &str) -> String {
        let mut out = Vec::new();
        write_string(text.as_bytes(), &mut out);
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn strings_escape_what_json_needs_and_keep_the_rest() {
        assert_eq!(string("plain"), r#""plain""#);
        assert_eq!(string("a\"b\\c"), r#""a\"b\\c""#);
        assert_eq!(string("\n\r\t\u{8}\u{c}\u{1}\u{1f}"), r#""\n\r\t\b\f\u0001\u001f""#);
        assert_eq!(string("été ✓"), "\"été ✓\"");
        assert_eq!(string(""), r#""""#);
    }

    #[test]
    fn numbers_are_shortest_and_read_back() {
        for v in [0.0, -0.0, 1.0, 0.1, 1.5e-7, 1700000000.123456, 12345678901234567890.0, f64::MIN_POSITIVE, f64::MAX] {
            let mut out = Vec::new();
            write_number(v, &mut out);
            assert_eq!(std::str::from_utf8(&out).unwrap().parse::<f64>().unwrap().to_bits(), v.to_bits());
        }
        let mut out = Vec::new();
        for v in [1e300, 5e-324, 1e16, 1e-5, 123.5] {
            write_number(v, &mut out);
            out.push(b' ');
        }
        assert_eq!(out, b"1e300 5e-324 1e16 1e-5 123.5 ");
        out.clear();
        write_number(f64::NAN, &mut out);
        write_number(f64::NEG_INFINITY, &mut out);
        assert_eq!(out, b"NaN-Infinity");
    }

    #[test]
    fn rows_fill_the_template() {
        let template = [
            Piece::Literal(b"{\"k\":".to_vec()),
            Piece::Field(0),
            Piece::Literal(b",\"v\":".to_vec()),
            Piece::Field(1),
            Piece::Literal(b"}".to_vec()),
        ];
        let columns = [
            Column::Text { cells: vec![Some(b"a".as_slice()), None, Some(b"")], empty_is_null: true },
            Column::Number { values: &[1.0, 2.5, 0.0], missing: &[false, false, true] },
        ];
        let (text, ends) = write_rows(&template, &columns).unwrap();
        assert_eq!(std::str::from_utf8(&text).unwrap(), r#"{"k":"a","v":1}{"k":null,"v":2.5}{"k":null,"v":null}"#);
        assert_eq!(ends, [15, 33, 52]);
        let short =
            [Column::Number { values: &[1.0], missing: &[false] }, Column::Number { values: &[], missing: &[] }];
        assert!(write_rows(&template, &short).unwrap_err().contains("column 1 has 0 rows"));
        assert!(write_rows(&template, &columns[..1]).unwrap_err().contains("names column 1 of 1"));
    }
}
