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

/// `docs/configuration.md` is `dppo config --markdown`: the reference cannot go stale.
#[test]
fn the_configuration_reference_is_the_output_of_dppo_config() {
    let path = crate::util::repo_root().join("docs/configuration.md");
    let committed = std::fs::read_to_string(&path).unwrap();
    assert!(
        committed == dppo_trainer::config_keys::reference_markdown(),
        "{} is stale: run `cargo run --release -- config --markdown > docs/configuration.md`",
        path.display()
    );
}

/// `dppo config` prints what a run would use, and rejects what `dppo run` rejects.
#[test]
fn dppo_config_prints_the_effective_config_and_its_errors() {
    let dir = tempfile::tempdir().unwrap();
    let mine = dir.path().join("my.toml");
    let default = RunConfig::default_with(&["steps=7".to_string()]).unwrap();
    std::fs::write(&mine, default.to_toml()).unwrap();
    let mine = mine.to_str().unwrap();
    let (code, printed, stderr) =
        crate::util::run_dppo(&["config", "--config", mine, "--set", "dppo.r_o=0.7"]);
    assert_eq!(code, Some(0), "{stderr}");
    let cfg = RunConfig::from_toml(&printed, "dppo config", &[]).unwrap();
    assert_eq!((cfg.steps, cfg.dppo.r_o), (7, 0.7));
    assert!(printed.contains("# Samples per prompt (G)."), "{printed}");
    let (code, _, err) =
        crate::util::run_dppo(&["config", "--config", mine, "--set", "dppo.r_o=2"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains("invalid value for dppo.r_o: must be in [0, 1), got 2"),
        "{err}"
    );
}
