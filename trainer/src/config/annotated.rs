//! A configuration as TOML with every key's doc as a comment (`dppo config`), and
//! `docs/configuration.md`, which is that output for the built-in default.

use super::keys::{lookup, KEYS};
use super::RunConfig;

/// `cfg` as TOML, every key preceded by its doc, allowed values and peer name; optional
/// keys that are unset appear commented out.
pub fn annotated_toml(cfg: &RunConfig) -> String {
    let table = toml::Table::try_from(cfg).expect("a RunConfig serialises to a TOML table");
    let mut out = String::new();
    let mut section = "";
    for doc in KEYS {
        let (parent, name) = doc.key.rsplit_once('.').unwrap_or(("", doc.key));
        if parent != section {
            out.push_str(&format!("\n[{parent}]\n"));
            section = parent;
        }
        out.push_str(&format!(
            "# {}. Allowed: {}.",
            capitalise(doc.doc),
            doc.allowed_text()
        ));
        if let Some(peer) = doc.peer {
            out.push_str(&format!(" As {peer}."));
        }
        out.push('\n');
        match lookup(&table, doc.key) {
            Some(value) => out.push_str(&format!("{name} = {value}\n")),
            None => out.push_str(&format!("# {name} is unset\n")),
        }
    }
    out
}

/// `docs/configuration.md`: the default configuration, annotated.
pub fn reference_markdown() -> String {
    let cfg = RunConfig::default_with(&[]).expect("the built-in default is valid");
    format!(
        "# Configuration\n\n\
         Every key of a `dppo run` configuration, with the built-in default's values. This \
         page is the output of `dppo config` (regenerate it with \
         `cargo run --release -- config --markdown > docs/configuration.md`; a test fails \
         when it is stale). A config file sets only the keys it changes: the others keep these \
         values. Override any key with `--set key=value`; `dppo config --config my.toml \
         --set key=value` prints what a run would use.\n\n\
         ```toml\n{}```\n",
        annotated_toml(&cfg).trim_start()
    )
}

fn capitalise(s: &str) -> String {
    let mut chars = s.chars();
    chars
        .next()
        .map(|c| c.to_uppercase().chain(chars).collect())
        .unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_annotated_toml_parses_back_to_the_same_config() {
        let sets = ["dppo.r_o=0.7".to_string(), "data.eval=held.jsonl".into()];
        let cfg = RunConfig::default_with(&sets).unwrap();
        let text = annotated_toml(&cfg);
        assert!(text.contains("# Upper clip range"), "{text}");
        assert!(text.contains("TRL epsilon_high"), "{text}");
        let again = RunConfig::from_toml(&text, "annotated", &[]).unwrap();
        assert_eq!(again, cfg);
        let unset = annotated_toml(&RunConfig::default_with(&[]).unwrap());
        assert!(unset.contains("# eval is unset"), "{unset}");
    }
}
