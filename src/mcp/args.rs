//! Raw tool arguments → typed values, with the reference's lenient coercions and exact messages
//! (docs/decisions.md, "Tool arguments"). rmcp's `Parameters<T>` would turn a type error into a JSON-RPC error,
//! which models cannot read, so arguments are decoded here instead.

use serde_json::{Map, Value};

/// A type error or missing required property, reported as a tool error result.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("Invalid arguments for tool {tool}: {property}: {reason}")]
pub struct ArgError {
    pub tool: &'static str,
    pub property: &'static str,
    pub reason: &'static str,
}

/// Reads properties of one call's argument object. `null` counts as absent (docs/decisions.md, "Tool arguments"); unknown
/// properties are ignored.
pub struct Args<'a> {
    tool: &'static str,
    raw: Option<&'a Map<String, Value>>,
}

impl<'a> Args<'a> {
    pub fn new(tool: &'static str, raw: Option<&'a Map<String, Value>>) -> Self {
        Self { tool, raw }
    }

    /// The raw value of `property`, `None` when absent or null (for a shape the typed readers
    /// do not cover, such as `computer_create`'s `egress`).
    pub fn get(&self, property: &str) -> Option<&'a Value> {
        self.raw?.get(property).filter(|v| !v.is_null())
    }

    fn fail(&self, property: &'static str, reason: &'static str) -> ArgError {
        ArgError {
            tool: self.tool,
            property,
            reason,
        }
    }

    pub fn string(&self, property: &'static str) -> Result<Option<String>, ArgError> {
        match self.get(property) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.clone())),
            Some(_) => Err(self.fail(property, "expected a string")),
        }
    }

    pub fn required_string(&self, property: &'static str) -> Result<String, ArgError> {
        self.string(property)?
            .ok_or_else(|| self.fail(property, "missing required field"))
    }

    pub fn string_list(&self, property: &'static str) -> Result<Option<Vec<String>>, ArgError> {
        let Some(value) = self.get(property) else {
            return Ok(None);
        };
        let items = value
            .as_array()
            .ok_or_else(|| self.fail(property, "expected an array of strings"))?;
        items
            .iter()
            .map(|item| item.as_str().map(str::to_owned))
            .collect::<Option<Vec<_>>>()
            .map(Some)
            .ok_or_else(|| self.fail(property, "expected an array of strings"))
    }

    /// Integers, integer-valued floats (`5.0`) and decimal strings (`"5"`); `1.5` is rejected.
    pub fn integer(&self, property: &'static str) -> Result<Option<i64>, ArgError> {
        let Some(value) = self.get(property) else {
            return Ok(None);
        };
        let err = || self.fail(property, "expected an integer");
        match value {
            Value::Number(n) => {
                if let Some(i) = n.as_i64() {
                    Ok(Some(i))
                } else {
                    let f = n.as_f64().ok_or_else(err)?;
                    let integral = f.fract() == 0.0 && f.abs() < 9.0e15;
                    // Truncation is exact here: the value is integral and within i64 range.
                    integral.then_some(f as i64).map(Some).ok_or_else(err)
                }
            }
            Value::String(s) => s.trim().parse::<i64>().map(Some).map_err(|_| err()),
            _ => Err(err()),
        }
    }

    /// Booleans, `true/false/1/0/yes/no/on/off` strings (any case) and the integers 0 and 1.
    pub fn boolean(&self, property: &'static str) -> Result<Option<bool>, ArgError> {
        let Some(value) = self.get(property) else {
            return Ok(None);
        };
        let err = || self.fail(property, "expected a boolean");
        match value {
            Value::Bool(b) => Ok(Some(*b)),
            Value::Number(n) => match n.as_i64() {
                Some(0) => Ok(Some(false)),
                Some(1) => Ok(Some(true)),
                _ => Err(err()),
            },
            Value::String(s) => match s.trim().to_ascii_lowercase().as_str() {
                "true" | "1" | "yes" | "on" => Ok(Some(true)),
                "false" | "0" | "no" | "off" => Ok(Some(false)),
                _ => Err(err()),
            },
            _ => Err(err()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn with(value: Value) -> Map<String, Value> {
        value.as_object().cloned().unwrap_or_default()
    }

    #[test]
    fn integers_are_lenient_but_not_fractional() {
        let raw = with(json!({"a": 5, "b": 5.0, "c": "5", "d": 1.5, "e": null, "f": true}));
        let args = Args::new("terminal_execute", Some(&raw));
        assert_eq!(args.integer("a"), Ok(Some(5)));
        assert_eq!(args.integer("b"), Ok(Some(5)));
        assert_eq!(args.integer("c"), Ok(Some(5)));
        assert_eq!(args.integer("e"), Ok(None));
        assert_eq!(
            args.integer("d").map_err(|e| e.to_string()),
            Err("Invalid arguments for tool terminal_execute: d: expected an integer".to_owned())
        );
        assert!(args.integer("f").is_err());
    }

    #[test]
    fn booleans_accept_reference_spellings() {
        let raw = with(json!({"a": "Yes", "b": 0, "c": "off", "d": 2, "e": "maybe"}));
        let args = Args::new("t", Some(&raw));
        assert_eq!(args.boolean("a"), Ok(Some(true)));
        assert_eq!(args.boolean("b"), Ok(Some(false)));
        assert_eq!(args.boolean("c"), Ok(Some(false)));
        assert!(args.boolean("d").is_err());
        assert!(args.boolean("e").is_err());
    }

    #[test]
    fn string_lists_reject_bare_strings() {
        let raw = with(json!({"a": "echo hi", "b": ["echo", 1], "c": ["echo", "hi"]}));
        let args = Args::new("t", Some(&raw));
        assert!(args.string_list("a").is_err());
        assert!(args.string_list("b").is_err());
        assert_eq!(
            args.string_list("c"),
            Ok(Some(vec!["echo".into(), "hi".into()]))
        );
    }

    #[test]
    fn missing_required_field() {
        let args = Args::new("computer_delete", None);
        assert_eq!(
            args.required_string("computer_id")
                .map_err(|e| e.to_string()),
            Err(
                "Invalid arguments for tool computer_delete: computer_id: missing required field"
                    .to_owned()
            )
        );
    }
}
