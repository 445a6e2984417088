//! The configs shipped in `configs/` parse and validate against the key table.

use dppo_trainer::config::RunConfig;
use dppo_trainer::config::{annotated, keys};

/// Every key of every shipped config is in the key table with an allowed value:
/// `from_file` rejects anything else, naming the file and line.
#[test]
fn shipped_configs_are_valid() {
    let dir = crate::util::repo_root().join("configs");
    let mut seen = 0;
    for entry in std::fs::read_dir(&dir).unwrap() {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            RunConfig::from_file(&path, &[]).unwrap_or_else(|e| panic!("{e}"));
            seen += 1;
        }
    }
    assert!(seen >= 2);
}

/// The README's table of the keys most runs touch names only keys of the key table.
#[test]
fn the_readme_names_only_real_keys() {
    let readme = std::fs::read_to_string(crate::util::repo_root().join("README.md")).unwrap();
    let section = readme
        .split("## Configuration")
        .nth(1)
        .and_then(|s| s.split("\n## ").next())
        .expect("README has a Configuration section");
    let mut seen = 0;
    for row in section.lines().filter(|l| l.starts_with("| `")) {
        let keys = row.split('|').nth(1).unwrap();
        for key in keys.split('`').skip(1).step_by(2) {
            assert!(keys::find(key).is_some(), "README: no key {key}");
            seen += 1;
        }
    }
    assert!(seen > 20, "{seen} keys found in the README's table");
}

/// `docs/configuration.md` is `dppo config --markdown`: the reference cannot go stale.
#[test]
fn the_configuration_reference_is_the_output_of_dppo_config() {
    let path = crate::util::repo_root().join("docs/configuration.md");
    let committed = std::fs::read_to_string(&path).unwrap();
    let generated = annotated::reference_markdown();
    let first_diff = committed
        .lines()
        .zip(generated.lines())
        .position(|(a, b)| a != b);
    assert!(
        committed == generated,
        "{} is stale (first difference at line {}): run \
         `cargo run --release -- config --markdown > docs/configuration.md`",
        path.display(),
        first_diff.map_or(
            committed.lines().count().min(generated.lines().count()),
            |i| i
        ) + 1
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
    let (code, printed, stderr) = crate::util::run_dppo(&["config"]);
    assert_eq!(code, Some(0), "{stderr}");
    let annotated = annotated::annotated_toml(&RunConfig::default_with(&[]).unwrap());
    assert_eq!(printed, annotated.trim_start());
    let (code, printed, stderr) =
        crate::util::run_dppo(&["config", "--config", mine, "--set", "dppo.r_o=0.7"]);
    assert_eq!(code, Some(0), "{stderr}");
    let cfg = RunConfig::from_toml(&printed, "dppo config", &[]).unwrap();
    assert_eq!((cfg.steps, cfg.dppo.r_o), (7, 0.7));
    assert!(printed.contains("# Samples per prompt (G)."), "{printed}");
    // A design that is only approximately unbiased says so first, and still parses.
    let (code, printed, stderr) =
        crate::util::run_dppo(&["config", "--set", "actor.loss_agg=token-mean"]);
    assert_eq!(code, Some(0), "{stderr}");
    assert!(
        printed.starts_with("# Note: actor.loss_agg = \"token-mean\" with prompt pruning"),
        "{printed}"
    );
    RunConfig::from_toml(&printed, "dppo config", &[]).unwrap();
    let (code, _, err) =
        crate::util::run_dppo(&["config", "--config", mine, "--set", "dppo.r_o=2"]);
    assert_eq!(code, Some(2), "{err}");
    assert!(
        err.contains(
            "--set dppo.r_o=2: invalid value for dppo.r_o: got 2, allowed: float in [0, 1)"
        ),
        "{err}"
    );
}
