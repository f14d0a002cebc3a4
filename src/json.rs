//! Small helpers over miniserde's dynamic `Value`, so payload builders read like the JSON they make.

pub use miniserde::json::{Array, Number, Object, Value};

/// Builds a JSON object from `(key, value)` pairs; `Value::Null` entries are left out, so optional
/// fields vanish instead of appearing as `null`.
pub fn obj<'a>(pairs: impl IntoIterator<Item = (&'a str, Value)>) -> Value {
    let mut o = Object::new();
    for (k, v) in pairs {
        if !matches!(v, Value::Null) {
            o.insert(k.to_string(), v);
        }
    }
    Value::Object(o)
}

pub fn s(v: impl Into<String>) -> Value {
    Value::String(v.into())
}

pub fn opt_s(v: Option<impl Into<String>>) -> Value {
    v.map_or(Value::Null, |v| Value::String(v.into()))
}

pub fn n(v: u64) -> Value {
    Value::Number(Number::U64(v))
}

pub fn b(v: bool) -> Value {
    Value::Bool(v)
}

pub fn arr(items: impl IntoIterator<Item = Value>) -> Value {
    let mut a = Array::new();
    a.extend(items);
    Value::Array(a)
}

pub fn strs<'a>(items: impl IntoIterator<Item = &'a str>) -> Value {
    arr(items.into_iter().map(s))
}

pub fn to_string(v: &Value) -> String {
    miniserde::json::to_string(v)
}

/// Appends `v` to `out` as a JSON string: quoted, with `"`, `\` and the control characters
/// escaped (RFC 8259 section 7), for text written without building a `Value` first.
pub fn push_str(out: &mut String, v: &str) {
    const HEX: &[u8; 16] = b"0123456789abcdef";
    out.push('"');
    let mut start = 0;
    for (i, b) in v.bytes().enumerate() {
        let short = match b {
            b'"' => "\\\"",
            b'\\' => "\\\\",
            b'\n' => "\\n",
            b'\r' => "\\r",
            b'\t' => "\\t",
            0..=0x1f => "",
            _ => continue,
        };
        // `b` is ASCII, so `i` is a character boundary.
        out.push_str(&v[start..i]);
        if short.is_empty() {
            out.push_str("\\u00");
            out.push(HEX[usize::from(b >> 4)] as char);
            out.push(HEX[usize::from(b & 15)] as char);
        } else {
            out.push_str(short);
        }
        start = i + 1;
    }
    out.push_str(&v[start..]);
    out.push('"');
}

/// A JSON object written field by field into one string: for payloads made for every message
/// (a `message.push`), without a `Value` tree to build, sort and drop. Absent optional fields
/// are left out, as `obj` leaves out `Null`.
pub struct ObjWriter(String);

impl Default for ObjWriter {
    fn default() -> ObjWriter {
        ObjWriter::with_capacity(128)
    }
}

impl ObjWriter {
    pub fn with_capacity(bytes: usize) -> ObjWriter {
        let mut out = String::with_capacity(bytes);
        out.push('{');
        ObjWriter(out)
    }

    fn key(&mut self, key: &str) -> &mut String {
        if self.0.len() > 1 {
            self.0.push(',');
        }
        push_str(&mut self.0, key);
        self.0.push(':');
        &mut self.0
    }

    pub fn str(&mut self, key: &str, value: &str) -> &mut ObjWriter {
        push_str(self.key(key), value);
        self
    }

    pub fn opt_str(&mut self, key: &str, value: Option<&str>) -> &mut ObjWriter {
        if let Some(v) = value {
            self.str(key, v);
        }
        self
    }

    pub fn num(&mut self, key: &str, value: u64) -> &mut ObjWriter {
        let out = self.key(key);
        let _ = std::fmt::Write::write_fmt(out, format_args!("{value}"));
        self
    }

    pub fn bool(&mut self, key: &str, value: bool) -> &mut ObjWriter {
        self.key(key).push_str(if value { "true" } else { "false" });
        self
    }

    pub fn obj(&mut self, key: &str, value: ObjWriter) -> &mut ObjWriter {
        self.key(key).push_str(&value.finish());
        self
    }

    /// An array of strings.
    pub fn strs<'a>(&mut self, key: &str, items: impl IntoIterator<Item = &'a str>) -> &mut ObjWriter {
        let out = self.key(key);
        out.push('[');
        for (i, item) in items.into_iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            push_str(out, item);
        }
        out.push(']');
        self
    }

    /// An array of objects; left out when there are none.
    pub fn objs(&mut self, key: &str, items: impl IntoIterator<Item = ObjWriter>) -> &mut ObjWriter {
        let mut items = items.into_iter().peekable();
        if items.peek().is_none() {
            return self;
        }
        let out = self.key(key);
        out.push('[');
        for (i, item) in items.enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(&item.finish());
        }
        out.push(']');
        self
    }

    pub fn finish(mut self) -> String {
        self.0.push('}');
        self.0
    }
}

/// Nesting deeper than this is refused before parsing. No payload imgate reads from outside
/// (webhook bodies, packets, Bot API and Open Platform answers, events) comes near it.
pub const MAX_DEPTH: usize = 64;
/// Values (containers and list items) one document may hold. A parsed value takes 32 bytes
/// whatever its text takes, so `[0,0,…]` would cost 16 times its size; with this cap a document
/// of any shape costs at most about 6 MiB besides its own strings. A getUpdates answer of 100
/// large Telegram messages stays well below it.
pub const MAX_VALUES: usize = 100_000;

/// Checks the shape of outside JSON in one pass, without allocating: nesting and value count.
/// miniserde is non-recursive (no stack overflow), but it allocates for every level and value.
pub fn check_shape(text: &[u8]) -> Result<(), String> {
    let (mut depth, mut values) = (0usize, 0usize);
    let (mut in_string, mut escaped) = (false, false);
    for &b in text {
        if in_string {
            match b {
                _ if escaped => escaped = false,
                b'\\' => escaped = true,
                b'"' => in_string = false,
                _ => {}
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'[' | b'{' => {
                depth += 1;
                values += 1;
                if depth > MAX_DEPTH {
                    return Err(format!("JSON nested deeper than {MAX_DEPTH} levels"));
                }
            }
            b']' | b'}' => depth = depth.saturating_sub(1),
            b',' => values += 1,
            _ => {}
        }
        if values > MAX_VALUES {
            return Err(format!("JSON with more than {MAX_VALUES} values"));
        }
    }
    Ok(())
}

/// Inputs larger than this are never parsed on the executor thread (debug builds assert it).
pub const INLINE_PARSE: usize = 16 * 1024;

/// Parses outside bytes: their shape is checked first (`check_shape`), then miniserde parses.
/// The `Err` says which, readably, for a 400's `detail` or an `invalid_packet`.
pub fn parse(text: &str) -> Result<Value, String> {
    debug_assert!(
        text.len() <= INLINE_PARSE || !crate::runtime::on_executor(),
        "{} bytes of JSON parsed on the executor thread",
        text.len()
    );
    check_shape(text.as_bytes())?;
    miniserde::json::from_str::<Value>(text).map_err(|_| NOT_JSON.to_string())
}

/// `parse`'s answer to text that is not JSON at all.
pub const NOT_JSON: &str = "body is not valid JSON";

pub fn as_object(v: &Value) -> Option<&Object> {
    match v {
        Value::Object(o) => Some(o),
        _ => None,
    }
}

pub fn get<'a>(o: &'a Object, key: &str) -> Option<&'a Value> {
    o.get(key).filter(|v| !matches!(v, Value::Null))
}

pub fn get_str<'a>(o: &'a Object, key: &str) -> Option<&'a str> {
    match o.get(key) {
        Some(Value::String(s)) => Some(s),
        _ => None,
    }
}

pub fn get_u64(o: &Object, key: &str) -> Option<u64> {
    match o.get(key) {
        Some(Value::Number(Number::U64(n))) => Some(*n),
        Some(Value::Number(Number::I64(n))) if *n >= 0 => Some(*n as u64),
        Some(Value::Number(Number::F64(f))) if *f >= 0.0 && f.fract() == 0.0 && *f < 1e19 => Some(*f as u64),
        _ => None,
    }
}

/// A whole number that fits an `i64` (negative codes, chat IDs).
pub fn get_i64(o: &Object, key: &str) -> Option<i64> {
    match o.get(key) {
        Some(Value::Number(Number::I64(n))) => Some(*n),
        Some(Value::Number(Number::U64(n))) => i64::try_from(*n).ok(),
        _ => None,
    }
}

pub fn get_obj<'a>(o: &'a Object, key: &str) -> Option<&'a Object> {
    o.get(key).and_then(as_object)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deep_nesting_is_refused_before_parsing_and_the_limit_itself_parses() {
        let ok = format!("{}{}", "[".repeat(MAX_DEPTH), "]".repeat(MAX_DEPTH));
        assert!(parse(&ok).is_ok());
        let deep = format!("{}{}", "[".repeat(MAX_DEPTH + 1), "]".repeat(MAX_DEPTH + 1));
        assert_eq!(parse(&deep).unwrap_err(), "JSON nested deeper than 64 levels");
        let bomb = "[".repeat(1 << 20);
        assert!(parse(&bomb).unwrap_err().contains("nested deeper"));
        let objects = r#"{"a":"#.repeat(MAX_DEPTH + 1);
        assert!(check_shape(objects.as_bytes()).is_err());
    }

    #[test]
    fn brackets_and_commas_inside_strings_do_not_count() {
        let text = format!(r#"{{"text":"{}","q":"\"[,{{"}}"#, "[,{".repeat(200_000));
        assert!(parse(&text).is_ok(), "a string full of brackets is one value");
    }

    #[test]
    fn too_many_values_are_refused_and_the_cap_itself_parses() {
        let at_cap = format!("[{}]", vec!["0"; MAX_VALUES - 1].join(","));
        assert!(parse(&at_cap).is_ok());
        let over = format!("[{}]", vec!["0"; MAX_VALUES + 1].join(","));
        assert_eq!(parse(&over).unwrap_err(), "JSON with more than 100000 values");
    }

    #[test]
    fn the_shape_check_survives_thousands_of_malformed_inputs() {
        let seeds: [&[u8]; 2] = [br#"{"a":[1,{"b":"c\"]"}],"d":null}"#, b"[[[[\"\\"];
        for input in crate::testutil::mutations(&seeds, 5000, 3) {
            let _ = check_shape(&input);
            let _ = parse(&String::from_utf8_lossy(&input));
        }
    }

    #[test]
    fn written_strings_parse_back_to_what_was_written() {
        let cases = [
            "",
            "plain",
            "quote \" backslash \\ slash /",
            "lines\r\n\ttab \u{0} \u{1f} \u{7f}",
            "caf\u{e9} \u{1f600} \u{2028}",
        ];
        for case in cases {
            let mut out = String::from("[");
            push_str(&mut out, case);
            out.push(']');
            let back = parse(&out).unwrap();
            let Value::Array(items) = back else { panic!("{out}") };
            assert!(matches!(&items[..], [Value::String(v)] if v == case), "{out}");
        }
        let mut out = String::new();
        push_str(&mut out, "\u{1}");
        assert_eq!(out, "\"\\u0001\"");
    }

    #[test]
    fn a_written_object_parses_back_with_every_field_and_without_the_absent_ones() {
        let mut inner = ObjWriter::default();
        inner.bool("yes", true).bool("no", false);
        let mut w = ObjWriter::with_capacity(8);
        w.str("text", "a \"quoted\"\nline")
            .opt_str("absent", None)
            .opt_str("present", Some("p"))
            .num("n", u64::MAX)
            .strs("list", ["x", "y\\"])
            .strs("none", [])
            .objs("files", [ObjWriter::default(), ObjWriter::default()])
            .objs("no_files", [])
            .obj("inner", inner);
        let text = w.finish();
        let Value::Object(o) = parse(&text).unwrap() else {
            panic!("{text}")
        };
        assert_eq!(get_str(&o, "text"), Some("a \"quoted\"\nline"));
        assert!(o.get("absent").is_none() && o.get("no_files").is_none(), "{text}");
        assert_eq!(get_str(&o, "present"), Some("p"));
        assert_eq!(get_u64(&o, "n"), Some(u64::MAX));
        assert_eq!(to_string(&o["list"]), r#"["x","y\\"]"#);
        assert_eq!(to_string(&o["none"]), "[]");
        assert_eq!(to_string(&o["files"]), "[{},{}]");
        assert_eq!(to_string(&o["inner"]), r#"{"no":false,"yes":true}"#);
        assert_eq!(ObjWriter::default().finish(), "{}");
    }
}
