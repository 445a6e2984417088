//! Prompt datasets: JSONL files with configurable fields (GSM8K `#### n`, MATH answers), and
//! the built-in synthetic arithmetic task with disjoint train and held-out splits.

use std::path::Path;

use rand::{rngs::StdRng, Rng, SeedableRng};

use dppo_model::{ChatMessage, TextTokenizer};

use crate::config::DataConfig;
use dppo_rewards::{Answer, ExtractMode};

mod jsonl;
mod order;
mod parquet;

pub use self::parquet::load_parquet;
pub use jsonl::load_jsonl;
pub use order::ProblemOrder;

/// One prompt with its ground truth.
#[derive(Debug, Clone, PartialEq)]
pub struct Problem {
    /// Stable id, what prompt histories are keyed by: for files, a hash of the data source
    /// and the prompt ([`stable_prompt_id`]); for built-in tasks, the index (their problems
    /// are a function of the seed).
    pub prompt_id: u64,
    /// The id checkpoints written before stable ids used (a file row's line number, from
    /// 0): resuming one maps its records to `prompt_id`.
    pub legacy_id: u64,
    /// Which of `data.train`'s files it came from (0 for one file or a built-in task).
    pub file: usize,
    /// Where the row came from (verl's `data_source`; the file's name when the row has
    /// none), sent to external rewards.
    pub data_source: String,
    /// The question; for a chat prompt, its last user message.
    pub question: String,
    /// The whole prompt as chat messages (system, user, ...), when the data gives one
    /// (verl's `prompt`); `None`: the question as one user message.
    pub messages: Option<Vec<ChatMessage>>,
    /// The ground truth as the row holds it (any JSON), sent to external rewards.
    pub label: serde_json::Value,
    /// The ground truth parsed as a math answer, for the verifier; `None` only when an
    /// external reward scores the run and the label is not a math answer.
    pub answer: Option<Answer>,
    /// The row's `extra_info` (verl), sent to external rewards; null when absent.
    pub extra_info: serde_json::Value,
    /// A worked solution, when the source has one (supervised warm-up).
    pub solution: Option<String>,
}

/// A dataset that cannot be used, with the file and line at fault.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    /// Rows that cannot be used: every one, by line (1-based), with what is wrong.
    #[error("{}", rows_message(path, malformed, *accepted))]
    Rows {
        path: String,
        malformed: Vec<(usize, String)>,
        /// Rows that were fine.
        accepted: usize,
    },
    /// A parquet file that cannot be read at all (its rows are checked one by one).
    #[error("{path}: not a readable parquet file: {reason}")]
    Parquet { path: String, reason: String },
    #[error("unknown built-in task {0:?} (available: builtin:arithmetic)")]
    UnknownTask(String),
    #[error("data.eval: a held-out JSONL file is required with a JSONL train set")]
    NoEvalSet,
    /// A supervised warm-up asked of data without worked solutions.
    #[error(
        "warmup.steps = {steps} trains on demonstrations, and {data} has none (no answer \
         field holds a worked solution ending in `#### answer`): set warmup.steps = 0, or \
         add solutions"
    )]
    NoDemonstrations { data: String, steps: u64 },
    /// A file of a run's data that cannot be loaded, named by the key that lists it.
    #[error("{key}: {source}")]
    Key {
        key: &'static str,
        #[source]
        source: Box<DataError>,
    },
}

impl DataError {
    /// This error, named by the config key whose file caused it.
    fn under(self, key: &'static str) -> Self {
        DataError::Key {
            key,
            source: Box::new(self),
        }
    }
}

/// `path:line: reason` for the first malformed rows, then how many there are in all.
fn rows_message(path: &str, malformed: &[(usize, String)], accepted: usize) -> String {
    const SHOWN: usize = 10;
    let mut text: Vec<String> = malformed
        .iter()
        .take(SHOWN)
        .map(|(line, reason)| format!("{path}:{line}: {reason}"))
        .collect();
    if malformed.len() > SHOWN {
        text.push(format!("and {} more", malformed.len() - SHOWN));
    }
    format!(
        "{} ({} malformed rows, {accepted} accepted)",
        text.join("; "),
        malformed.len()
    )
}

/// Which JSON fields hold the question and the answer, and whether every answer must be
/// a math answer the verifier can check.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fields {
    pub question: String,
    pub answer: String,
    /// The built-in verifier scores this data: an unparseable answer is an error.
    pub verify: bool,
}

/// A file prompt's id: FNV-1a (64-bit) of its data source and its prompt as JSON, so that a
/// prompt keeps its id, and its history, across files, orderings and mixtures. Ten lines of
/// our own: std's hasher may change between Rust versions, and these ids live in checkpoints.
pub fn stable_prompt_id(data_source: &str, prompt: &serde_json::Value) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let text = serde_json::to_string(prompt).expect("a JSON value serialises");
    let bytes = data_source.bytes().chain([0xff]).chain(text.bytes());
    bytes.fold(OFFSET, |h, b| (h ^ u64::from(b)).wrapping_mul(PRIME))
}

/// Token ids of a question as the model is prompted: chat-formatted (user turn, generation
/// prompt) when the tokenizer has a chat template, plain text with special tokens otherwise.
pub fn prompt_ids(
    tokenizer: &TextTokenizer,
    question: &str,
) -> Result<Vec<u32>, dppo_model::ModelError> {
    match tokenizer.chat_template() {
        Some(_) => {
            let text =
                tokenizer.apply_chat_template(&[ChatMessage::new("user", question)], true)?;
            tokenizer.encode(&text, false)
        }
        None => tokenizer.encode(question, true),
    }
}

/// [`prompt_ids`] of every problem, in order: tokenized once, at start-up. A chat prompt
/// goes through the chat template whole; without a template its messages' contents are
/// joined by blank lines.
pub fn problem_prompts(
    tokenizer: &TextTokenizer,
    problems: &[Problem],
) -> Result<Vec<Vec<u32>>, dppo_model::ModelError> {
    problems
        .iter()
        .map(|p| match (&p.messages, tokenizer.chat_template()) {
            (None, _) => prompt_ids(tokenizer, &p.question),
            (Some(messages), Some(_)) => {
                let text = tokenizer.apply_chat_template(messages, true)?;
                tokenizer.encode(&text, false)
            }
            (Some(messages), None) => {
                let contents: Vec<&str> = messages.iter().map(|m| m.content.as_str()).collect();
                tokenizer.encode(&contents.join("\n\n"), true)
            }
        })
        .collect()
}

/// A run's training and held-out problems (`[data]`; a built-in task is drawn with `seed`),
/// the held-out ones cut to `num_eval`.
///
/// `verify`: the built-in verifier scores the run, so every answer must parse.
pub fn run_problems(
    data: &DataConfig,
    seed: u64,
    verify: bool,
) -> Result<(Vec<Problem>, Vec<Problem>), DataError> {
    if let Some(task) = data.train.first().strip_prefix("builtin:") {
        return builtin_task(task, data.num_train, data.num_eval, seed);
    }
    let fields = Fields {
        question: data.question_field.clone(),
        answer: data.answer_field.clone(),
        verify,
    };
    let mut train = Vec::new();
    for (file, path) in data.train.paths().into_iter().enumerate() {
        let problems = load_file(Path::new(path), &fields).map_err(|e| e.under("data.train"))?;
        train.extend(problems.into_iter().map(|p| Problem { file, ..p }));
    }
    let source = data.eval.as_deref().ok_or(DataError::NoEvalSet)?;
    let mut eval =
        held_out(source, &fields, data.num_eval, seed).map_err(|e| e.under("data.eval"))?;
    if eval.len() > data.num_eval {
        tracing::info!(
            "{source}: the held-out evaluation takes the first {} of its {} problems \
             (data.num_eval)",
            data.num_eval,
            eval.len()
        );
        eval.truncate(data.num_eval);
    }
    if let Some(system) = &data.system_prompt {
        for p in train.iter_mut().chain(eval.iter_mut()) {
            p.add_system_prompt(system);
        }
    }
    Ok((train, eval))
}

impl Problem {
    /// The problem as errors name it: the start of its question (on one line), its data
    /// source and id, so that a user finds the row.
    pub fn describe(&self) -> String {
        const SHOWN: usize = 60;
        let flat = self
            .question
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" ");
        let shown: String = flat.chars().take(SHOWN).collect();
        let more = if flat.chars().count() > SHOWN {
            "..."
        } else {
            ""
        };
        format!(
            "\"{shown}{more}\" ({}, id {})",
            self.data_source, self.prompt_id
        )
    }

    /// Puts `system` before the prompt as a system message, unless it has one.
    pub fn add_system_prompt(&mut self, system: &str) {
        let messages = self
            .messages
            .get_or_insert_with(|| vec![ChatMessage::new("user", &self.question)]);
        if !messages.iter().any(|m| m.role == "system") {
            messages.insert(0, ChatMessage::new("system", system));
        }
    }
}

/// `problems` and their prompt `tokens` without those longer than `max` tokens (all of
/// them when `None`), logging how many of the `what` prompts were left out.
pub fn drop_long_prompts(
    problems: Vec<Problem>,
    tokens: Vec<Vec<u32>>,
    max: Option<usize>,
    what: &str,
) -> (Vec<Problem>, Vec<Vec<u32>>) {
    let Some(max) = max else {
        return (problems, tokens);
    };
    let total = problems.len();
    let kept: (Vec<Problem>, Vec<Vec<u32>>) = problems
        .into_iter()
        .zip(tokens)
        .filter(|(_, t)| t.len() <= max)
        .unzip();
    if kept.0.len() < total {
        tracing::warn!(
            "{} of {total} {what} prompts are longer than data.max_prompt_length ({max} \
             tokens) and are left out",
            total - kept.0.len()
        );
    }
    kept
}

/// The held-out problems of the data set `source`: a built-in task's held-out split
/// (`builtin:arithmetic`: its first `num_eval`, drawn with `seed`) or every problem of a
/// JSONL file.
pub fn held_out(
    source: &str,
    fields: &Fields,
    num_eval: usize,
    seed: u64,
) -> Result<Vec<Problem>, DataError> {
    match source.strip_prefix("builtin:") {
        Some(task) => Ok(builtin_task(task, 0, num_eval, seed)?.1),
        None => load_file(Path::new(source), fields),
    }
}

/// A prompt file: parquet when its name ends in `.parquet`, JSONL otherwise.
pub fn load_file(path: &Path, fields: &Fields) -> Result<Vec<Problem>, DataError> {
    match path.extension().is_some_and(|e| e == "parquet") {
        true => load_parquet(path, fields),
        false => load_jsonl(path, fields),
    }
}

/// The extraction mode for a data set when `reward.extract` (or `--extract`) is not given:
/// the built-in tasks answer `Answer: N`, JSONL data sets are read `strict`.
pub fn default_extract_mode(data: &str) -> ExtractMode {
    if data.starts_with("builtin:") {
        ExtractMode::Answer
    } else {
        ExtractMode::Strict
    }
}

/// A built-in task's train and held-out problems.
pub fn builtin_task(
    name: &str,
    num_train: usize,
    num_eval: usize,
    seed: u64,
) -> Result<(Vec<Problem>, Vec<Problem>), DataError> {
    match name {
        "arithmetic" => Ok(arithmetic(num_train, num_eval, seed)),
        other => Err(DataError::UnknownTask(other.to_string())),
    }
}

/// Two-digit additions and subtractions, `What is a+b?`, answered `Answer: c`. Held-out
/// problems are operand pairs never drawn for training. They are drawn first, so the
/// held-out split depends on the seed alone (a smaller `num_eval` gives a prefix of a larger
/// one), whatever the training split's size: `dppo eval` rebuilds a run's split from its seed.
fn arithmetic(num_train: usize, num_eval: usize, seed: u64) -> (Vec<Problem>, Vec<Problem>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut seen = std::collections::BTreeSet::new();
    let mut draw = |count: usize, offset: u64| {
        let mut out = Vec::with_capacity(count);
        while out.len() < count {
            let (a, b) = (rng.random_range(10..100i64), rng.random_range(10..100i64));
            let minus = rng.random_bool(0.3);
            if !seen.insert((a, b, minus)) {
                continue;
            }
            let (op, c) = if minus { ('-', a - b) } else { ('+', a + b) };
            out.push(Problem {
                prompt_id: offset + out.len() as u64,
                legacy_id: offset + out.len() as u64,
                file: 0,
                data_source: "builtin:arithmetic".into(),
                question: format!("What is {a}{op}{b}?"),
                messages: None,
                label: c.to_string().into(),
                answer: Some(Answer::parse(&c.to_string())),
                extra_info: serde_json::Value::Null,
                solution: Some(format!("Answer: {c}")),
            });
        }
        out
    };
    let eval = draw(num_eval, 1 << 32);
    let train = draw(num_train, 0);
    (train, eval)
}

/// The RL stream of [`ProblemOrder`] over the training problems.
pub const TRAIN_STREAM: u64 = u64::MAX;
/// The warm-up's stream over the demonstrations.
pub const DEMO_STREAM: u64 = u64::MAX - 1;

/// A well-spread 64-bit seed from three numbers (splitmix64 rounds).
pub(crate) fn mix(a: u64, b: u64, c: u64) -> u64 {
    let round = |mut z: u64| {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    round(round(round(a) ^ b) ^ c)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dppo_rewards::verify;

    #[test]
    fn a_problem_is_described_by_its_question_source_and_id() {
        let (_, eval) = builtin_task("arithmetic", 0, 1, 7).unwrap();
        let mut p = eval[0].clone();
        p.question = "Tom has 17 apples\nand buys 5 more.".into();
        let id = p.prompt_id;
        assert_eq!(
            p.describe(),
            format!("\"Tom has 17 apples and buys 5 more.\" (builtin:arithmetic, id {id})")
        );
        p.question = "x".repeat(61);
        assert!(p
            .describe()
            .starts_with(&format!("\"{}...\" (", "x".repeat(60))));
    }

    #[test]
    fn arithmetic_splits_are_disjoint_and_self_consistent() {
        let (train, eval) = builtin_task("arithmetic", 500, 100, 7).unwrap();
        assert_eq!((train.len(), eval.len()), (500, 100));
        let questions: std::collections::HashSet<&str> =
            train.iter().map(|p| p.question.as_str()).collect();
        assert!(eval
            .iter()
            .all(|p| !questions.contains(p.question.as_str())));
        for p in train.iter().chain(&eval) {
            let mode = default_extract_mode("builtin:arithmetic");
            let verdict = verify(
                p.solution.as_deref().unwrap(),
                false,
                p.answer.as_ref().unwrap(),
                mode,
            );
            assert!(verdict.is_correct, "{p:?}");
        }
        let (_, larger) = builtin_task("arithmetic", 3000, 300, 7).unwrap();
        assert_eq!(
            eval,
            larger[..100],
            "held-out split depends on the seed alone"
        );
        assert!(builtin_task("algebra", 1, 1, 0)
            .unwrap_err()
            .to_string()
            .contains("algebra"));
    }

    #[test]
    fn a_system_prompt_is_added_once_and_long_prompts_are_left_out() {
        let (mut train, _) = builtin_task("arithmetic", 3, 0, 1).unwrap();
        train[0].add_system_prompt("Be brief.");
        train[0].add_system_prompt("Twice?");
        let messages = train[0].messages.as_ref().unwrap();
        let roles: Vec<(&str, &str)> = messages
            .iter()
            .map(|m| (m.role.as_str(), m.content.as_str()))
            .collect();
        assert_eq!(
            roles,
            [
                ("system", "Be brief."),
                ("user", train[0].question.as_str())
            ]
        );
        let tokens = vec![vec![1; 5], vec![1; 9], vec![1; 6]];
        let (kept, kept_tokens) = drop_long_prompts(train.clone(), tokens.clone(), Some(6), "t");
        assert_eq!(kept, [train[0].clone(), train[2].clone()]);
        assert_eq!(kept_tokens, [tokens[0].clone(), tokens[2].clone()]);
        assert_eq!(drop_long_prompts(train.clone(), tokens, None, "t").0, train);
    }

    #[test]
    fn run_and_evaluation_data_come_from_one_loader() {
        let mut data = crate::config::RunConfig::default_with(&[]).unwrap().data;
        (data.num_train, data.num_eval) = (50, 10);
        let (train, eval) = run_problems(&data, 3, true).unwrap();
        assert_eq!(
            (train, eval.clone()),
            builtin_task("arithmetic", 50, 10, 3).unwrap()
        );
        let fields = Fields {
            question: "question".into(),
            answer: "answer".into(),
            verify: true,
        };
        assert_eq!(held_out(data.train.first(), &fields, 10, 3).unwrap(), eval);
        let gsm8k = Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/gsm8k/test.jsonl");
        data.train = crate::config::TrainFiles::One(gsm8k.display().to_string());
        let err = run_problems(&data, 3, true).unwrap_err();
        assert!(matches!(err, DataError::NoEvalSet), "{err}");
        data.eval = Some(data.train.to_string());
        let (train, eval) = run_problems(&data, 3, true).unwrap();
        assert_eq!(eval[..], train[..10], "the held-out file, cut to num_eval");
    }
}
