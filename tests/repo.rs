//! The repository is self-contained: nothing in it refers to a folder beside the checkout.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// Directories that are build outputs, caches, run outputs or git's own, not the product.
const SKIPPED_DIRS: [&str; 4] = ["target", ".git", ".cache", "runs"];

/// Every file under `dir`, skipping `SKIPPED_DIRS` at any depth.
fn files_under(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display())) {
        let entry = entry.unwrap();
        let path = entry.path();
        let file_type = entry.file_type().unwrap();
        if file_type.is_dir() {
            let name = entry.file_name();
            if !SKIPPED_DIRS.iter().any(|s| name == *s) {
                files_under(&path, out);
            }
        } else if file_type.is_file() {
            out.push(path);
        }
    }
}

/// No file of the tree (code, configs, tests, scripts, docs, data) mentions the sibling
/// folder that our development machines have and a fresh clone does not.
#[test]
fn no_file_refers_to_a_folder_beside_the_repository() {
    // Built so that this file does not contain the needle itself.
    let needle = concat!("..", "/shared").as_bytes();
    let root = crate::util::repo_root();
    let mut files = Vec::new();
    files_under(&root, &mut files);
    assert!(
        files.iter().any(|p| p.ends_with("data/gsm8k/train.jsonl")),
        "the walk missed data/: {} files",
        files.len()
    );
    let offenders: Vec<String> = files
        .iter()
        .filter(|path| {
            let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            bytes.windows(needle.len()).any(|w| w == needle)
        })
        .map(|path| path.strip_prefix(&root).unwrap().display().to_string())
        .collect();
    assert!(
        offenders.is_empty(),
        "these files refer to {}, which a fresh clone lacks: {}",
        String::from_utf8_lossy(needle),
        offenders.join(", ")
    );
}

/// Within each crate (a directory holding `lib.rs` or `main.rs`), no two files import each
/// other: dependencies between files point one way. A file's module and its own submodules
/// are one unit (a parent re-exports its children, a child uses its parent's helpers), so
/// ancestor and descendant do not count as a pair.
#[test]
fn no_two_files_of_a_crate_import_each_other() {
    let root = crate::util::repo_root();
    let mut files = Vec::new();
    files_under(&root, &mut files);
    let crate_roots: Vec<&Path> = files
        .iter()
        .filter(|p| p.ends_with("lib.rs") || p.ends_with("main.rs"))
        .filter_map(|p| p.parent())
        .collect();
    assert!(crate_roots.len() >= 7, "crate roots found: {crate_roots:?}");
    let (mut num_edges, mut circles) = (0, Vec::new());
    for crate_root in crate_roots {
        let edges = file_imports(crate_root, &files);
        num_edges += edges.len();
        for (a, b) in &edges {
            if a < b && edges.contains(&(b.clone(), a.clone())) {
                let name = |p: &PathBuf| p.strip_prefix(&root).unwrap().display().to_string();
                circles.push(format!("{} <-> {}", name(a), name(b)));
            }
        }
    }
    assert!(
        num_edges > 100,
        "only {num_edges} imports between files found"
    );
    assert!(
        circles.is_empty(),
        "these files import each other (move what both need to the file that owns it): {}",
        circles.join(", ")
    );
}

/// The module path of `file` in the crate rooted at `crate_root` (`a/b.rs`, `a/b/mod.rs`:
/// `["a", "b"]`; the root file: `[]`).
fn module_path(crate_root: &Path, file: &Path) -> Vec<String> {
    let rel = file.strip_prefix(crate_root).unwrap();
    let mut path: Vec<String> = rel
        .iter()
        .map(|c| c.to_string_lossy().into_owned())
        .collect();
    let last = path.pop().unwrap();
    let is_root = path.is_empty() && (last == "lib.rs" || last == "main.rs");
    if last != "mod.rs" && !is_root {
        path.push(last.trim_end_matches(".rs").to_string());
    }
    path
}

/// The imports between the files of one crate: (importer, imported), each once, by the
/// `crate::`, `super::` and `self::` paths of their code and `use` declarations.
fn file_imports(crate_root: &Path, files: &[PathBuf]) -> BTreeSet<(PathBuf, PathBuf)> {
    let modules: BTreeMap<Vec<String>, &PathBuf> = files
        .iter()
        .filter(|p| p.starts_with(crate_root) && p.extension().is_some_and(|e| e == "rs"))
        .map(|p| (module_path(crate_root, p), p))
        .collect();
    let mut edges = BTreeSet::new();
    for (file_module, file) in &modules {
        let source = std::fs::read_to_string(file).unwrap();
        for (here, path) in paths_of(&code_only(&source), file_module) {
            let Some(target) = resolve(&path, &here) else {
                continue;
            };
            // The longest prefix that is a module of a file: the file that defines the item.
            let Some(imported) = (0..=target.len())
                .rev()
                .find_map(|k| modules.get_key_value(&target[..k]))
            else {
                continue;
            };
            let related =
                imported.0.starts_with(file_module) || file_module.starts_with(imported.0);
            if !related {
                edges.insert(((*file).clone(), (*imported.1).clone()));
            }
        }
    }
    edges
}

/// `path` (starting with `crate`, `super` or `self`) as an absolute module path, written in
/// module `here`; `None` for any other path (another crate, a local name).
fn resolve(path: &[String], here: &[String]) -> Option<Vec<String>> {
    let mut base = match path.first()?.as_str() {
        "crate" => Vec::new(),
        "super" | "self" => here.to_vec(),
        _ => return None,
    };
    let mut rest = &path[usize::from(path[0] == "crate")..];
    while let Some((first, tail)) = rest.split_first() {
        match first.as_str() {
            "super" => {
                base.pop();
            }
            "self" => {}
            _ => break,
        }
        rest = tail;
    }
    base.extend(rest.iter().cloned());
    Some(base)
}

/// Every path of `code` that starts with `crate`, `super` or `self`, with the module it is
/// written in (`file_module` or an inline `mod name { .. }` inside it). `use` trees are
/// expanded: `use crate::a::{b, c::d}` gives `crate::a::b` and `crate::a::c::d`.
fn paths_of(code: &str, file_module: &[String]) -> Vec<(Vec<String>, Vec<String>)> {
    let tokens = tokens(code);
    let (mut out, mut inline, mut depth) = (Vec::new(), Vec::<(String, usize)>::new(), 0);
    let here = |inline: &[(String, usize)]| {
        let mut m = file_module.to_vec();
        m.extend(inline.iter().map(|(name, _)| name.clone()));
        m
    };
    let mut i = 0;
    while i < tokens.len() {
        match tokens[i] {
            "{" => depth += 1,
            "}" => {
                depth -= 1;
                inline.retain(|(_, d)| *d <= depth);
            }
            "mod" if tokens.get(i + 2) == Some(&"{") => {
                inline.push((tokens[i + 1].to_string(), depth + 1));
            }
            "use" => {
                let end = i + tokens[i..].iter().position(|t| *t == ";").unwrap();
                let mut paths = Vec::new();
                use_tree(&tokens[i + 1..end], &mut 0, Vec::new(), &mut paths);
                out.extend(paths.into_iter().map(|p| (here(&inline), p)));
                i = end;
            }
            "crate" | "super" | "self" if tokens.get(i + 1) == Some(&"::") => {
                let mut path = vec![tokens[i].to_string()];
                while tokens.get(i + 1) == Some(&"::")
                    && tokens.get(i + 2).is_some_and(|t| is_ident(t))
                {
                    path.push(tokens[i + 2].to_string());
                    i += 2;
                }
                out.push((here(&inline), path));
            }
            _ => {}
        }
        i += 1;
    }
    out
}

/// Expands the use tree at `tokens[*i..]` under `prefix` into whole paths.
fn use_tree(tokens: &[&str], i: &mut usize, mut prefix: Vec<String>, out: &mut Vec<Vec<String>>) {
    while let Some(&token) = tokens.get(*i) {
        *i += 1;
        match token {
            "{" => {
                while tokens.get(*i).is_some_and(|t| *t != "}") {
                    use_tree(tokens, i, prefix.clone(), out);
                    if tokens.get(*i) == Some(&",") {
                        *i += 1;
                    }
                }
                *i += 1;
                return;
            }
            "*" => break,
            // `{self, ..}`: the module the braces are in.
            "self" if !prefix.is_empty() => {}
            _ => prefix.push(token.to_string()),
        }
        match tokens.get(*i) {
            Some(&"::") => *i += 1,
            Some(&"as") => {
                *i += 2;
                break;
            }
            _ => break,
        }
    }
    out.push(prefix);
}

fn is_ident(token: &str) -> bool {
    token.chars().all(|c| c.is_alphanumeric() || c == '_')
}

/// The tokens that matter to paths: identifiers, `::`, and single punctuation characters.
fn tokens(code: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let mut rest = code.trim_start();
    while let Some(c) = rest.chars().next() {
        let len = if rest.starts_with("::") {
            2
        } else if c.is_alphanumeric() || c == '_' {
            rest.find(|c: char| !(c.is_alphanumeric() || c == '_'))
                .unwrap_or(rest.len())
        } else {
            c.len_utf8()
        };
        out.push(&rest[..len]);
        rest = rest[len..].trim_start();
    }
    out
}

/// `source` with comments, string literals and character literals blanked out, so that
/// neither a path in a doc comment nor a brace in a string counts.
fn code_only(source: &str) -> String {
    let c: Vec<char> = source.chars().collect();
    let at = |i: usize| c.get(i).copied().unwrap_or('\0');
    let is_ident_char = |ch: char| ch.is_alphanumeric() || ch == '_';
    let mut out = String::with_capacity(source.len());
    let mut i = 0;
    while i < c.len() {
        let before = |k: usize| i.checked_sub(k).map_or('\0', at);
        let raw_hashes = (at(i) == 'r'
            && (!is_ident_char(before(1)) || before(1) == 'b' && !is_ident_char(before(2))))
        .then(|| c[i + 1..].iter().take_while(|&&h| h == '#').count())
        .filter(|&n| at(i + 1 + n) == '"');
        if at(i) == '/' && at(i + 1) == '/' {
            while i < c.len() && c[i] != '\n' {
                i += 1;
            }
        } else if at(i) == '/' && at(i + 1) == '*' {
            let mut depth = 0;
            while i < c.len() {
                if at(i) == '/' && at(i + 1) == '*' {
                    depth += 1;
                    i += 2;
                } else if at(i) == '*' && at(i + 1) == '/' {
                    depth -= 1;
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    i += 1;
                }
            }
            out.push(' ');
        } else if let Some(n) = raw_hashes {
            let close: String = std::iter::once('"')
                .chain(std::iter::repeat_n('#', n))
                .collect();
            let body: String = c[i + 2 + n..].iter().collect();
            i += 2
                + n
                + body
                    .find(&close)
                    .map_or(body.len(), |end| body[..end].chars().count())
                + close.len();
            out.push_str("\"\"");
        } else if at(i) == '"' {
            i += 1;
            while i < c.len() && c[i] != '"' {
                i += if c[i] == '\\' { 2 } else { 1 };
            }
            i += 1;
            out.push_str("\"\"");
        } else if at(i) == '\'' && (at(i + 1) == '\\' || at(i + 2) == '\'') {
            // A character literal ('x', '\n', '\'', '\u{..}'), not a lifetime.
            i += if at(i + 1) == '\\' { 3 } else { 2 };
            while i < c.len() && c[i] != '\'' {
                i += 1;
            }
            i += 1;
            out.push_str("' '");
        } else {
            out.push(c[i]);
            i += 1;
        }
    }
    out
}
