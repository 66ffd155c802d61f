//! The mock node's own token count, deliberately not the filter's rule (the filter estimates
//! from characters by script; here it is words and punctuation), so that the filter has to
//! estimate, as it must with a real engine's tokenizer.

/// Tokens in a piece of text: 1.3 per whitespace-separated word, plus one per punctuation mark.
pub fn count(text: &str) -> u64 {
    let words = text.split_whitespace().count() as u64;
    let punct = text.chars().filter(|c| c.is_ascii_punctuation()).count() as u64;
    (words * 13).div_ceil(10) + punct
}

/// Chat templates add a few tokens per message (role markers, separators).
pub const PER_MESSAGE: u64 = 4;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts() {
        for (text, want) in [
            ("", 0),
            ("hello", 2),
            ("hello world", 3),
            ("Hello, world!", 5),
            ("a b c d e f g h i j", 13),
        ] {
            assert_eq!(count(text), want, "{text:?}");
        }
    }
}
