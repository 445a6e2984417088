//! The JSON spoken to external rewards: OpenRLHF's remote reward protocol (`query`,
//! `prompts`, `labels` in; `rewards`, optional `extra_logs` out) plus dppo's per-item
//! `completions`, `data_sources` and `extra_info`. The HTTP and the process forms send the
//! same bodies.

use std::collections::BTreeMap;

use dppo_engine::{Completion, FinishReason};
use dppo_model::TextTokenizer;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::TrainError;

/// One completion to score, with what its prompt's data row says about it.
#[derive(Debug, Clone, PartialEq)]
pub struct RewardItem {
    /// The prompt as the model saw it (chat template applied).
    pub prompt: String,
    pub completion: String,
    /// The row's ground truth as it was in the data (a string, a number or any JSON).
    pub label: Value,
    pub data_source: String,
    pub extra_info: Value,
    /// Completion tokens, and whether the token limit cut it (the overlong penalty).
    pub num_tokens: usize,
    pub is_truncated: bool,
}

impl RewardItem {
    /// The item of completion `c` (decoded with `tokenizer`) of problem `p`'s prompt
    /// (`prompt`: its text as the model saw it, empty when the reward does not read it).
    pub fn of_completion(
        p: &crate::data::Problem,
        prompt: &str,
        c: &Completion,
        tokenizer: &TextTokenizer,
    ) -> Result<Self, TrainError> {
        Ok(Self {
            prompt: prompt.to_string(),
            completion: tokenizer.decode(&c.token_ids, true)?,
            label: p.label.clone(),
            data_source: p.data_source.clone(),
            extra_info: p.extra_info.clone(),
            num_tokens: c.token_ids.len(),
            is_truncated: c.finish_reason == FinishReason::Length,
        })
    }
}

/// A request body.
#[derive(Debug, Serialize)]
pub struct Request<'a> {
    /// Prompt + completion, as OpenRLHF sends it.
    pub query: Vec<String>,
    pub prompts: Vec<&'a str>,
    pub labels: Vec<&'a Value>,
    pub completions: Vec<&'a str>,
    pub data_sources: Vec<&'a str>,
    pub extra_info: Vec<&'a Value>,
}

impl<'a> Request<'a> {
    pub fn new(items: &'a [RewardItem]) -> Self {
        Self {
            query: items
                .iter()
                .map(|i| format!("{}{}", i.prompt, i.completion))
                .collect(),
            prompts: items.iter().map(|i| i.prompt.as_str()).collect(),
            labels: items.iter().map(|i| &i.label).collect(),
            completions: items.iter().map(|i| i.completion.as_str()).collect(),
            data_sources: items.iter().map(|i| i.data_source.as_str()).collect(),
            extra_info: items.iter().map(|i| &i.extra_info).collect(),
        }
    }

    /// The body as one line of JSON (serialising plain strings and values cannot fail).
    pub fn to_line(&self) -> String {
        serde_json::to_string(self).expect("a reward request serialises")
    }
}

/// A checked answer: one finite reward per item, and named per-item values to log.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
pub struct Answer {
    pub rewards: Vec<f64>,
    #[serde(default)]
    pub extra_logs: BTreeMap<String, Vec<f64>>,
}

/// Parses and checks the answer `text` to a request of `num_items` items; the error says
/// what is wrong and, for a bad value, at which item.
pub fn parse_answer(text: &str, num_items: usize) -> Result<Answer, String> {
    let shown: String = text.chars().take(200).collect();
    // Numbers are read as JSON values first so that a null or a string in place of a
    // reward is named as such rather than as a type error deep in serde's message.
    let raw: Value =
        serde_json::from_str(text.trim()).map_err(|e| format!("not JSON ({e}): {shown:?}"))?;
    let rewards = match raw.get("rewards") {
        Some(Value::Array(values)) => values,
        Some(other) => return Err(format!("\"rewards\" is not a list: {other}")),
        None => return Err(format!("no \"rewards\" field: {shown:?}")),
    };
    let numbers = |name: &str, values: &[Value]| -> Result<Vec<f64>, String> {
        if values.len() != num_items {
            return Err(format!(
                "{name} has {} values for {num_items} completions",
                values.len()
            ));
        }
        values
            .iter()
            .enumerate()
            .map(|(k, v)| match v.as_f64() {
                Some(x) if x.is_finite() => Ok(x),
                _ => Err(format!("{name}[{k}] is {v}, not a finite number")),
            })
            .collect()
    };
    let mut answer = Answer {
        rewards: numbers("rewards", rewards)?,
        extra_logs: BTreeMap::new(),
    };
    match raw.get("extra_logs") {
        None | Some(Value::Null) => {}
        Some(Value::Object(logs)) => {
            for (name, values) in logs {
                let Value::Array(values) = values else {
                    return Err(format!("extra_logs.{name} is not a list"));
                };
                let values = numbers(&format!("extra_logs.{name}"), values)?;
                answer.extra_logs.insert(name.clone(), values);
            }
        }
        Some(other) => return Err(format!("\"extra_logs\" is not an object: {other}")),
    }
    Ok(answer)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn item(completion: &str) -> RewardItem {
        RewardItem {
            prompt: "What is 2+2? ".into(),
            completion: completion.into(),
            label: Value::from("4"),
            data_source: "math".into(),
            extra_info: serde_json::json!({"index": 3}),
            num_tokens: 2,
            is_truncated: false,
        }
    }

    #[test]
    fn the_request_carries_openrlhf_fields_and_dppo_lists() {
        let items = [item("4"), item("5")];
        let body: Value = serde_json::from_str(&Request::new(&items).to_line()).unwrap();
        assert_eq!(
            body,
            serde_json::json!({
                "query": ["What is 2+2? 4", "What is 2+2? 5"],
                "prompts": ["What is 2+2? ", "What is 2+2? "],
                "labels": ["4", "4"],
                "completions": ["4", "5"],
                "data_sources": ["math", "math"],
                "extra_info": [{"index": 3}, {"index": 3}],
            })
        );
    }

    #[test]
    fn answers_are_checked_item_by_item() {
        let ok = parse_answer(r#"{"rewards": [1, 0.5], "extra_logs": {"fmt": [1, 0]}}"#, 2);
        assert_eq!(
            ok.unwrap(),
            Answer {
                rewards: vec![1.0, 0.5],
                extra_logs: [("fmt".to_string(), vec![1.0, 0.0])].into(),
            }
        );
        let cases = [
            ("nope", "not JSON"),
            (r#"{"scores": [1, 0]}"#, "no \"rewards\" field"),
            (r#"{"rewards": 1}"#, "\"rewards\" is not a list"),
            (
                r#"{"rewards": [1]}"#,
                "rewards has 1 values for 2 completions",
            ),
            (
                r#"{"rewards": [1, null]}"#,
                "rewards[1] is null, not a finite number",
            ),
            (r#"{"rewards": [1, "1"]}"#, "rewards[1] is \"1\""),
            (
                r#"{"rewards": [1, 0], "extra_logs": {"f": [1]}}"#,
                "extra_logs.f has 1 values",
            ),
            (
                r#"{"rewards": [1, 0], "extra_logs": [1]}"#,
                "\"extra_logs\" is not an object",
            ),
        ];
        for (text, want) in cases {
            let err = parse_answer(text, 2).unwrap_err();
            assert!(err.contains(want), "{text}: {err}");
        }
        // JSON has no NaN: a server writing Python's `NaN` sends text that is not JSON.
        assert!(parse_answer(r#"{"rewards": [NaN, 1]}"#, 2)
            .unwrap_err()
            .contains("not JSON"));
    }
}
