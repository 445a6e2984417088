//! The configs shipped in `configs/` parse and validate.

use dppo_trainer::config::RunConfig;

#[test]
fn shipped_configs_are_valid() {
    let dir = crate::util::repo_root().join("configs");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let text = std::fs::read_to_string(&path).unwrap();
            RunConfig::from_toml(&text, &path.display().to_string(), &[])
                .unwrap_or_else(|e| panic!("{e}"));
            seen += 1;
        }
    }
    assert!(seen >= 2);
}
