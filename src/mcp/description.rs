//! Assembles the `terminal_execute` description once at startup (docs/decisions.md, "Tool descriptions"): the
//! override replaces the backend's text, the extended text is appended after a blank line.

use crate::config::DescriptionConfig;

pub fn assemble(backend_text: String, config: &DescriptionConfig) -> String {
    match (&config.override_text, &config.extended_text) {
        (Some(text), _) => text.clone(),
        (None, Some(extra)) => format!("{backend_text}\n\n{extra}"),
        (None, None) => backend_text,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn override_and_extended() {
        let mut config = DescriptionConfig::default();
        assert_eq!(assemble("base".into(), &config), "base");
        config.extended_text = Some("more".into());
        assert_eq!(assemble("base".into(), &config), "base\n\nmore");
        config.override_text = Some("only".into());
        assert_eq!(assemble("base".into(), &config), "only");
    }
}
