//! The text of one streamed sample: incremental detokenisation (vLLM's prefix/read offsets,
//! so decoders that strip a leading space decode the same text either way) that never
//! splits a UTF-8 character and never shows any part of a stop string.

use dppo_engine::request::find_stop;
use dppo_model::TextTokenizer;

/// Decoded text of a growing token list, and how much of it has been sent.
#[derive(Debug, Default)]
pub struct TextStream {
    tokens: Vec<u32>,
    /// `tokens[prefix..read]` is decoded context for the tokens after `read`.
    prefix: usize,
    read: usize,
    text: String,
    /// Bytes of `text` already handed out.
    sent: usize,
    /// Set once a stop string was seen: nothing after it is ever shown.
    stopped: bool,
}

impl TextStream {
    /// Appends a token; returns the text that can be shown now.
    pub fn push(&mut self, tokenizer: &TextTokenizer, token: u32, stop: &[String]) -> String {
        self.tokens.push(token);
        let decode = |ids: &[u32]| tokenizer.decode(ids, true).unwrap_or_default();
        let before = decode(&self.tokens[self.prefix..self.read]);
        let after = decode(&self.tokens[self.prefix..]);
        // An incomplete character decodes as U+FFFD: wait for the bytes that complete it.
        if after.len() > before.len() && !after.ends_with('\u{FFFD}') {
            if let Some(new) = after.strip_prefix(before.as_str()) {
                self.text.push_str(new);
            } else {
                self.text
                    .push_str(&after[floor_char_boundary(&after, before.len())..]);
            }
            self.prefix = self.read;
            self.read = self.tokens.len();
        }
        self.take(stop, false)
    }

    /// No more tokens: returns whatever was held back.
    pub fn finish(&mut self, stop: &[String]) -> String {
        self.take(stop, true)
    }

    /// The full visible text (up to, not including, the first stop string).
    pub fn text(&self) -> &str {
        &self.text[..self.sent]
    }

    fn take(&mut self, stop: &[String], last: bool) -> String {
        if self.stopped {
            return String::new();
        }
        let end = match find_stop(&self.text, stop) {
            Some(at) => {
                self.stopped = true;
                at
            }
            None if last => self.text.len(),
            // Hold back a tail that may be the start of a stop string.
            None => self.text.len() - held_back(&self.text, stop),
        };
        let end = end.max(self.sent);
        let delta = self.text[self.sent..end].to_string();
        self.sent = end;
        delta
    }
}

/// Length of the longest suffix of `text` that is a proper prefix of a stop string.
fn held_back(text: &str, stop: &[String]) -> usize {
    stop.iter()
        .flat_map(|s| {
            (1..s.len())
                .filter(|&k| s.is_char_boundary(k) && text.ends_with(&s[..k]))
                .max()
        })
        .max()
        .unwrap_or(0)
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;
    use dppo_model::presets::task_tokenizer;

    fn stream(words: &[&str], stop: &[&str]) -> (Vec<String>, String) {
        let tok = task_tokenizer().unwrap();
        let stop: Vec<String> = stop.iter().map(|s| s.to_string()).collect();
        let mut s = TextStream::default();
        let mut deltas = Vec::new();
        for w in words {
            for id in tok.encode(w, false).unwrap() {
                deltas.push(s.push(&tok, id, &stop));
            }
        }
        deltas.push(s.finish(&stop));
        (deltas, s.text().to_string())
    }

    #[test]
    fn deltas_concatenate_to_the_decoded_text() {
        let (deltas, text) = stream(&["12", "+", "34", " is", " 46"], &[]);
        assert_eq!(deltas.concat(), "12+34 is 46");
        assert_eq!(text, "12+34 is 46");
    }

    #[test]
    fn stop_strings_are_never_shown_even_in_part() {
        let (deltas, text) = stream(&["1", "2", "+", "3", "4", "5"], &["+34"]);
        assert_eq!(text, "12");
        assert_eq!(deltas.concat(), "12");
        // "+" and "+3" were held back, not sent and then taken back.
        assert!(deltas.iter().all(|d| !d.contains('+')));
    }

    #[test]
    fn a_held_back_tail_that_is_no_stop_is_flushed() {
        let (deltas, text) = stream(&["1", "+", "2"], &["+5"]);
        assert_eq!(text, "1+2");
        assert_eq!(deltas.concat(), "1+2");
        let (_, text) = stream(&["1", "+"], &["+5"]);
        assert_eq!(text, "1+", "the end of the sample flushes the held tail");
    }

    #[test]
    fn held_back_measures_the_longest_partial_stop() {
        let stop = vec!["abc".to_string(), "bcd".to_string()];
        assert_eq!(held_back("xxab", &stop), 2);
        assert_eq!(held_back("xxbc", &stop), 2);
        assert_eq!(held_back("xxb", &stop), 1);
        assert_eq!(held_back("xxx", &stop), 0);
    }
}
