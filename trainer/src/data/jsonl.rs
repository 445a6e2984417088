//! Prompt files: JSONL, and the rows of any other format read as JSON values. Each field is a
//! dotted path into the row (`reward_model.ground_truth`), so verl's schema reads as it is:
//! `data.question_field = "prompt"` (a list of chat messages) and `data.answer_field =
//! "reward_model.ground_truth"`. A question may be a string or a list of `{role, content}`
//! messages; an answer a string or a number (any JSON for an external reward).

use std::path::Path;

use dppo_model::ChatMessage;
use dppo_rewards::parse_gold;
use serde_json::Value;

use super::{stable_prompt_id, DataError, Fields, Problem};

/// Roles a chat prompt may use.
const ROLES: [&str; 3] = ["system", "user", "assistant"];

/// Reads a JSONL file; every line must be an object with both fields, and with
/// `fields.verify` an answer the verifier can parse.
pub fn load_jsonl(path: &Path, fields: &Fields) -> Result<Vec<Problem>, DataError> {
    let text = std::fs::read_to_string(path).map_err(|source| DataError::Io {
        path: path.display().to_string(),
        source,
    })?;
    let rows = text
        .lines()
        .enumerate()
        .filter(|(_, line)| !line.trim().is_empty())
        .map(|(i, line)| {
            let row = serde_json::from_str(line).map_err(|e| format!("not valid JSON: {e}"));
            (i, row)
        });
    problems_of_rows(path, rows, fields)
}

/// The problems of `rows` (0-based line or row number, the row or why it cannot be read)
/// of the file at `path`; every malformed row is named in the error.
pub(super) fn problems_of_rows(
    path: &Path,
    rows: impl Iterator<Item = (usize, Result<Value, String>)>,
    fields: &Fields,
) -> Result<Vec<Problem>, DataError> {
    let file_name = path.file_stem().map_or_else(
        || path.display().to_string(),
        |s| s.to_string_lossy().into_owned(),
    );
    let mut problems = Vec::new();
    let mut malformed = Vec::new();
    for (i, row) in rows {
        match row.and_then(|row| problem(&row, fields, &file_name, i)) {
            Ok(p) => problems.push(p),
            Err(reason) => malformed.push((i + 1, reason)),
        }
    }
    if !malformed.is_empty() {
        return Err(DataError::Rows {
            path: path.display().to_string(),
            accepted: problems.len(),
            malformed,
        });
    }
    tracing::info!("{}: {} rows", path.display(), problems.len());
    Ok(problems)
}

/// The problem of the row at (0-based) line `line` of the file named `file_name`.
fn problem(row: &Value, fields: &Fields, file_name: &str, line: usize) -> Result<Problem, String> {
    let field = at(row, &fields.question);
    // A chat that ends with the assistant's turn (a `messages` dataset) is prompted without
    // it; that turn is the demonstration.
    let (question, messages, demo) = match field {
        Some(Value::Array(items)) => {
            let mut messages =
                chat(items).map_err(|e| format!("field {:?}: {e}", fields.question))?;
            let demo = match messages.last() {
                Some(m) if m.role == "assistant" => messages.pop().map(|m| m.content),
                _ => None,
            };
            let last_user = messages.iter().rev().find(|m| m.role == "user");
            let question = last_user
                .map(|m| m.content.clone())
                .ok_or_else(|| format!("field {:?} has no user message", fields.question))?;
            (question, Some(messages), demo)
        }
        other => (scalar(other, &fields.question)?, None, None),
    };
    let label =
        at(row, &fields.answer).ok_or_else(|| format!("missing field {:?}", fields.answer))?;
    // The verifier needs a math answer; an external reward takes the label as it is.
    let text = scalar(Some(label), &fields.answer);
    let answer = match (&text, fields.verify) {
        (Ok(raw), true) => Some(parse_gold(raw).map_err(|e| e.to_string())?),
        (Err(reason), true) => return Err(reason.clone()),
        (Ok(raw), false) => parse_gold(raw).ok(),
        (Err(_), false) => None,
    };
    let data_source = match row.get("data_source") {
        Some(Value::String(s)) => s.clone(),
        None => file_name.to_string(),
        Some(other) => return Err(format!("field \"data_source\" is not a string: {other}")),
    };
    // The id hashes the prompt as the model is asked it (without a trailing answer).
    let prompt = match &messages {
        Some(messages) => Value::Array(
            messages
                .iter()
                .map(|m| serde_json::json!({"role": m.role, "content": m.content}))
                .collect(),
        ),
        None => Value::String(question.clone()),
    };
    Ok(Problem {
        prompt_id: stable_prompt_id(&data_source, &prompt),
        legacy_id: line as u64,
        file: 0,
        data_source,
        question,
        messages,
        label: label.clone(),
        answer,
        extra_info: row.get("extra_info").cloned().unwrap_or(Value::Null),
        solution: text.ok().filter(|raw| raw.contains("####")).or(demo),
    })
}

/// The value at dotted `path` in `row`.
fn at<'a>(row: &'a Value, path: &str) -> Option<&'a Value> {
    path.split('.').try_fold(row, |v, key| v.get(key))
}

/// A string or a number at `name`, as text.
fn scalar(value: Option<&Value>, name: &str) -> Result<String, String> {
    match value {
        Some(Value::String(s)) => Ok(s.clone()),
        Some(v @ Value::Number(_)) => Ok(v.to_string()),
        Some(other) => Err(format!("field {name:?} is not a string: {other}")),
        None => Err(format!("missing field {name:?}")),
    }
}

/// Chat messages from a JSON list of `{role, content}` objects.
fn chat(items: &[Value]) -> Result<Vec<ChatMessage>, String> {
    if items.is_empty() {
        return Err("an empty list of messages".into());
    }
    items
        .iter()
        .enumerate()
        .map(|(k, item)| {
            let text = |key: &str| match item.get(key) {
                Some(Value::String(s)) => Ok(s.as_str()),
                _ => Err(format!("message {k} has no string {key:?}")),
            };
            let role = text("role")?;
            if !ROLES.contains(&role) {
                return Err(format!(
                    "message {k} has role {role:?}, not one of {ROLES:?}"
                ));
            }
            Ok(ChatMessage::new(role, text("content")?))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use dppo_rewards::{verify, ExtractMode};

    fn fields(question: &str, answer: &str) -> Fields {
        Fields {
            question: question.into(),
            answer: answer.into(),
            verify: true,
        }
    }

    fn write(dir: &tempfile::TempDir, name: &str, content: &str) -> std::path::PathBuf {
        let path = dir.path().join(name);
        std::fs::write(&path, content).unwrap();
        path
    }

    #[test]
    fn broken_lines_name_file_and_line() {
        let dir = tempfile::tempdir().unwrap();
        let plain = fields("question", "answer");
        let verl = fields("prompt", "reward_model.ground_truth");
        let cases = [
            ("{\"question\": \"q\", \"answer\": \"#### 4\"}\n{oops\n", &plain, "bad.jsonl:2: not valid JSON"),
            ("{\"question\": \"q\"}\n", &plain, "ok.jsonl:1: missing field \"answer\""),
            ("{\"question\": \"q\", \"answer\": \"\"}\n", &plain, "ok.jsonl:1: unparseable gold answer"),
            ("{\"prompt\": [], \"reward_model\": {\"ground_truth\": \"4\"}}\n", &verl, "ok.jsonl:1: field \"prompt\": an empty list"),
            ("{\"prompt\": [{\"role\": \"robot\", \"content\": \"x\"}], \"reward_model\": {\"ground_truth\": \"4\"}}\n", &verl, "message 0 has role \"robot\""),
            ("{\"prompt\": [{\"role\": \"system\", \"content\": \"x\"}], \"reward_model\": {\"ground_truth\": \"4\"}}\n", &verl, "has no user message"),
            ("{\"prompt\": [{\"role\": \"user\", \"content\": \"x\"}], \"reward_model\": {}}\n", &verl, "missing field \"reward_model.ground_truth\""),
        ];
        for (i, (content, fields, want)) in cases.iter().enumerate() {
            let path = write(&dir, if i == 0 { "bad.jsonl" } else { "ok.jsonl" }, content);
            let err = load_jsonl(&path, fields).unwrap_err().to_string();
            assert!(err.contains(want), "{err} lacks {want}");
        }
        let path = write(
            &dir,
            "good.jsonl",
            "{\"question\": \"2+2?\", \"answer\": \"So 4.\\n#### 4\"}\n\n",
        );
        let problems = load_jsonl(&path, &plain).unwrap();
        assert_eq!(problems.len(), 1);
        assert!(problems[0].messages.is_none());
        let verdict = verify(
            "\\boxed{4}",
            false,
            problems[0].answer.as_ref().unwrap(),
            ExtractMode::Strict,
        );
        assert!(verdict.is_correct);
    }

    /// verl's schema: chat messages in `prompt`, the answer nested in `reward_model`.
    #[test]
    fn verl_rows_read_as_they_are() {
        let dir = tempfile::tempdir().unwrap();
        let row = serde_json::json!({
            "data_source": "openai/gsm8k",
            "prompt": [
                {"role": "system", "content": "Think step by step."},
                {"role": "user", "content": "What is 6*7?"}
            ],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": 42},
            "extra_info": {"index": 0}
        });
        let path = write(&dir, "verl.jsonl", &format!("{row}\n"));
        let problems = load_jsonl(&path, &fields("prompt", "reward_model.ground_truth")).unwrap();
        let p = &problems[0];
        assert_eq!(p.question, "What is 6*7?");
        let messages = p.messages.as_ref().unwrap();
        assert_eq!(messages.len(), 2);
        assert_eq!(
            (messages[0].role.as_str(), messages[0].content.as_str()),
            ("system", "Think step by step.")
        );
        assert!(
            verify(
                "\\boxed{42}",
                false,
                p.answer.as_ref().unwrap(),
                ExtractMode::Strict
            )
            .is_correct
        );
        assert_eq!(
            (p.data_source.as_str(), &p.label),
            ("openai/gsm8k", &serde_json::json!(42))
        );
        assert_eq!(p.extra_info, serde_json::json!({"index": 0}));
        // For an external reward any label passes through as it is, parsed or not.
        let row = serde_json::json!({
            "prompt": [{"role": "user", "content": "Write f."}],
            "reward_model": {"ground_truth": {"tests": ["assert f(1) == 2"]}}
        });
        let path = write(&dir, "code.jsonl", &format!("{row}\n"));
        let mut external = fields("prompt", "reward_model.ground_truth");
        let err = load_jsonl(&path, &external).unwrap_err().to_string();
        assert!(
            err.contains("code.jsonl:1: field \"reward_model.ground_truth\" is not a string"),
            "{err}"
        );
        external.verify = false;
        let p = &load_jsonl(&path, &external).unwrap()[0];
        assert_eq!((p.answer.as_ref(), p.data_source.as_str()), (None, "code"));
        assert_eq!(p.label, serde_json::json!({"tests": ["assert f(1) == 2"]}));
    }

    /// A `messages` chat that ends with the answer is prompted without it (the answer is
    /// the demonstration); a prompt's id depends on its data source and text only; every
    /// malformed row is named, with the count accepted.
    #[test]
    fn chats_ids_and_malformed_rows() {
        let dir = tempfile::tempdir().unwrap();
        let chat = |q: &str, source: &str| {
            serde_json::json!({
                "data_source": source,
                "messages": [
                    {"role": "user", "content": q},
                    {"role": "assistant", "content": "It is 4.\n#### 4"}
                ],
                "answer": "4"
            })
            .to_string()
        };
        let first = write(
            &dir,
            "a.jsonl",
            &format!("{}\n{}\n", chat("2+2?", "x"), chat("1+3?", "x")),
        );
        let second = write(
            &dir,
            "b.jsonl",
            &format!("\n{}\n{}\n", chat("1+3?", "x"), chat("1+3?", "y")),
        );
        let fields = fields("messages", "answer");
        let a = load_jsonl(&first, &fields).unwrap();
        let b = load_jsonl(&second, &fields).unwrap();
        let messages = a[0].messages.as_ref().unwrap();
        assert_eq!(
            messages.len(),
            1,
            "the assistant's answer is not in the prompt"
        );
        assert_eq!(a[0].solution.as_deref(), Some("It is 4.\n#### 4"));
        assert_eq!(
            a[1].prompt_id, b[0].prompt_id,
            "same source and prompt, other file and line"
        );
        assert_ne!(
            (a[0].prompt_id, a[1].legacy_id),
            (a[1].prompt_id, b[0].legacy_id)
        );
        assert_ne!(b[0].prompt_id, b[1].prompt_id, "another data source");
        let bad = write(
            &dir,
            "bad.jsonl",
            &format!("{}\n{{oops\n{{\"messages\": \"q\"}}\n", chat("2+2?", "x")),
        );
        let err = load_jsonl(&bad, &fields).unwrap_err().to_string();
        let want = "bad.jsonl:2: not valid JSON";
        assert!(
            err.contains(want) && err.contains("bad.jsonl:3: missing field \"answer\""),
            "{err}"
        );
        assert!(err.ends_with("(2 malformed rows, 1 accepted)"), "{err}");
    }

    #[test]
    fn the_real_gsm8k_train_file_loads() {
        let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/gsm8k/train.jsonl");
        let problems = load_jsonl(&path, &fields("question", "answer")).unwrap();
        assert_eq!(problems.len(), 7473);
    }
}
