//! Models named by Hugging Face id (`Org/Name`), found in a hub cache that the test builds
//! from the fixtures, the way `huggingface-cli download` lays it out; never the network.

use std::path::Path;
use std::process::Command;

use serde_json::Value;

/// The cache variables the binary reads; every run clears them and sets only its own.
const CACHE_VARS: [&str; 3] = ["HF_HUB_CACHE", "HF_HOME", "HOME"];

/// Runs `dppo generate` greedily for 6 tokens with only `env` among `CACHE_VARS`; returns
/// the token ids on success, the stderr on failure.
fn generate(model: &str, extra: &[&str], env: &[(&str, &Path)]) -> Result<Value, String> {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dppo"));
    cmd.args(["generate", "--model", model, "--prompt", "ab", "--json"])
        .args(["--max-tokens", "6", "--temperature", "0"])
        .args(extra)
        .env("RUST_LOG", "warn");
    for var in CACHE_VARS {
        cmd.env_remove(var);
    }
    for (var, value) in env {
        cmd.env(var, value);
    }
    let out = cmd.output().expect("run dppo");
    if out.status.success() {
        let line: Value = serde_json::from_slice(&out.stdout).unwrap();
        Ok(line["token_ids"].clone())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// Stores fixture `fixture` as commit `commit` of `repo_id` in `cache`: the files under
/// `blobs/`, linked (copied where links are not available) from `snapshots/<commit>/`.
fn add_snapshot(cache: &Path, repo_id: &str, commit: &str, fixture: &str) {
    let repo = cache.join(format!("models--{}", repo_id.replace('/', "--")));
    let snapshot = repo.join("snapshots").join(commit);
    std::fs::create_dir_all(&snapshot).unwrap();
    std::fs::create_dir_all(repo.join("blobs")).unwrap();
    for entry in std::fs::read_dir(crate::util::fixture(fixture)).unwrap() {
        let src = entry.unwrap().path();
        let name = src.file_name().unwrap();
        let blob = repo
            .join("blobs")
            .join(format!("{commit}-{}", name.to_string_lossy()));
        std::fs::copy(&src, &blob).unwrap();
        #[cfg(unix)]
        std::os::unix::fs::symlink(&blob, snapshot.join(name)).unwrap();
        #[cfg(not(unix))]
        std::fs::copy(&blob, snapshot.join(name)).unwrap();
    }
}

/// Points `refs/<name>` of `repo_id` at `commit`.
fn add_ref(cache: &Path, repo_id: &str, name: &str, commit: &str) {
    let refs = cache
        .join(format!("models--{}", repo_id.replace('/', "--")))
        .join("refs");
    std::fs::create_dir_all(&refs).unwrap();
    std::fs::write(refs.join(name), commit).unwrap();
}

#[test]
fn hub_ids_resolve_in_the_local_cache_at_main_or_a_chosen_revision() {
    let (main, v2) = ("1111aaaa", "2222bbbb");
    let home = tempfile::tempdir().unwrap();
    let cache = home.path().join("hub");
    add_snapshot(&cache, "Org/Tiny", main, "hf/qwen3");
    add_snapshot(&cache, "Org/Tiny", v2, "hf/qwen2");
    add_ref(&cache, "Org/Tiny", "main", main);
    add_ref(&cache, "Org/Tiny", "v2", v2);
    let qwen3 = generate(crate::util::fixture("hf/qwen3").to_str().unwrap(), &[], &[]).unwrap();
    let qwen2 = generate(crate::util::fixture("hf/qwen2").to_str().unwrap(), &[], &[]).unwrap();
    assert_ne!(
        qwen3, qwen2,
        "the two fixtures must tell the revisions apart"
    );

    let hub_cache = [("HF_HUB_CACHE", cache.as_path())];
    assert_eq!(generate("Org/Tiny", &[], &hub_cache), Ok(qwen3.clone()));
    assert_eq!(
        generate("Org/Tiny", &["--revision", "v2"], &hub_cache),
        Ok(qwen2.clone())
    );
    assert_eq!(
        generate("Org/Tiny", &["--revision", v2], &hub_cache),
        Ok(qwen2),
        "a commit hash names its snapshot"
    );
    // Without HF_HUB_CACHE: $HF_HOME/hub, then $HOME/.cache/huggingface/hub.
    let hf_home = [("HF_HOME", home.path())];
    assert_eq!(generate("Org/Tiny", &[], &hf_home), Ok(qwen3.clone()));
    let user = tempfile::tempdir().unwrap();
    let user_cache = user.path().join(".cache/huggingface/hub");
    add_snapshot(&user_cache, "Org/Tiny", main, "hf/qwen3");
    add_ref(&user_cache, "Org/Tiny", "main", main);
    assert_eq!(
        generate("Org/Tiny", &[], &[("HOME", user.path())]),
        Ok(qwen3)
    );
}

#[test]
fn a_model_missing_from_the_cache_gives_the_download_command() {
    let cache = tempfile::tempdir().unwrap();
    add_snapshot(cache.path(), "Org/Tiny", "1111aaaa", "hf/qwen3");
    add_ref(cache.path(), "Org/Tiny", "main", "1111aaaa");
    let env = [("HF_HUB_CACHE", cache.path())];
    let cases = [
        ("Org/Missing", None, "huggingface-cli download Org/Missing`"),
        (
            "Org/Tiny",
            Some("v9"),
            "huggingface-cli download Org/Tiny --revision v9`",
        ),
    ];
    for (model, revision, want) in cases {
        let extra: Vec<&str> = revision.map(|r| vec!["--revision", r]).unwrap_or_default();
        let err = generate(model, &extra, &env).unwrap_err();
        assert!(
            err.contains(want) && err.contains("not in the Hugging Face cache"),
            "{model} {revision:?}: {err}"
        );
        assert!(err.contains(&cache.path().display().to_string()), "{err}");
    }
    let err = generate("builtin:tiny", &["--revision", "v2"], &env).unwrap_err();
    assert!(err.contains("applies only to a Hugging Face id"), "{err}");
}

#[test]
fn dppo_run_resolves_the_config_model_in_the_cache() {
    let cache = tempfile::tempdir().unwrap();
    let out = tempfile::tempdir().unwrap();
    let run = |revision: &[&str]| {
        let output = Command::new(env!("CARGO_BIN_EXE_dppo"))
            .args(["run", "--set", "model=Org/Missing", "--out"])
            .arg(out.path())
            .args(revision)
            .env("HF_HUB_CACHE", cache.path())
            .env("RUST_LOG", "warn")
            .output()
            .expect("run dppo");
        assert!(!output.status.success());
        String::from_utf8_lossy(&output.stderr).into_owned()
    };
    let err = run(&[]);
    assert!(
        err.contains("huggingface-cli download Org/Missing`"),
        "{err}"
    );
    let err = run(&["--revision", "v2"]);
    assert!(
        err.contains("huggingface-cli download Org/Missing --revision v2`"),
        "{err}"
    );
}
