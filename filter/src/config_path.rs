//! Locating the field a serde error is about (unknown fields, wrong types, bad enum values).
//!
//! serde_json's messages name an unknown field but not where it is (`unknown field `load_epz``,
//! also possible under `index` or `peers`), and a wrong type not at all (`invalid type: string
//! "x", expected f64`). This module finds the path by deletion: the JSON is parsed into a
//! `Value`; for an object, a member is the culprit's ancestor when the document deserializes
//! once that member is removed, or fails only because that member is now missing; the search
//! descends into that member, and stops where no child explains the error (that node is the
//! culprit, e.g. a value of the wrong type, or an object missing a required field).
//!
//! Invariants: only called after deserialization failed, never on the request path; the result
//! is a dotted path as `Config::validate` writes them (`policy.load_eps`,
//! `models.m.workers[1].weight`), `<root>` when the document itself is at fault.
//! Cost: one deserialization per member tried, along one root-to-leaf path (a few hundred
//! microseconds for a configuration of a thousand workers), at configuration time only.

use serde::de::DeserializeOwned;
use serde_json::Value;

/// Path of the member of `doc` that makes deserializing `T` fail (see the module docs).
pub fn locate<T: DeserializeOwned>(doc: &Value) -> String {
    let mut path: Vec<Step> = Vec::new();
    while let Some(node) = get(doc, &path) {
        let children: Vec<Step> = match node {
            Value::Object(m) => m.keys().map(|k| Step::Key(k.clone())).collect(),
            Value::Array(a) => (0..a.len()).map(Step::Index).collect(),
            _ => break,
        };
        let mut next = None;
        for child in children {
            let mut trial = doc.clone();
            let mut at = path.clone();
            at.push(child.clone());
            if !remove(&mut trial, &at) {
                continue;
            }
            match serde_json::from_value::<T>(trial) {
                Ok(_) => {
                    next = Some(child);
                    break;
                }
                Err(e) => {
                    if let Step::Key(k) = &child {
                        if e.to_string().starts_with(&format!("missing field `{k}`")) {
                            next = Some(child);
                            break;
                        }
                    }
                }
            }
        }
        match next {
            Some(step) => path.push(step),
            None => break,
        }
    }
    render(&path)
}

#[derive(Clone, Debug)]
enum Step {
    Key(String),
    Index(usize),
}

fn get<'a>(v: &'a Value, path: &[Step]) -> Option<&'a Value> {
    let mut cur = v;
    for s in path {
        cur = match s {
            Step::Key(k) => cur.as_object()?.get(k)?,
            Step::Index(i) => cur.as_array()?.get(*i)?,
        };
    }
    Some(cur)
}

/// Removes the member at `path` (non-empty); false when it is not there.
fn remove(v: &mut Value, path: &[Step]) -> bool {
    let Some((last, parent)) = path.split_last() else {
        return false;
    };
    let mut cur = v;
    for s in parent {
        let next = match s {
            Step::Key(k) => cur.as_object_mut().and_then(|m| m.get_mut(k)),
            Step::Index(i) => cur.as_array_mut().and_then(|a| a.get_mut(*i)),
        };
        match next {
            Some(n) => cur = n,
            None => return false,
        }
    }
    match (last, cur) {
        (Step::Key(k), Value::Object(m)) => m.remove(k).is_some(),
        (Step::Index(i), Value::Array(a)) if *i < a.len() => {
            a.remove(*i);
            true
        }
        _ => false,
    }
}

fn render(path: &[Step]) -> String {
    let mut out = String::new();
    for s in path {
        match s {
            Step::Key(k) => {
                if !out.is_empty() {
                    out.push('.');
                }
                out.push_str(k);
            }
            Step::Index(i) => out.push_str(&format!("[{i}]")),
        }
    }
    if out.is_empty() {
        out.push_str("<root>");
    }
    out
}
