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

/// Parses outside bytes; miniserde is non-recursive, so deep nesting cannot overflow the stack.
pub fn parse(text: &str) -> Result<Value, String> {
    miniserde::json::from_str::<Value>(text).map_err(|_| "body is not valid JSON".to_string())
}

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

pub fn get_obj<'a>(o: &'a Object, key: &str) -> Option<&'a Object> {
    o.get(key).and_then(as_object)
}
