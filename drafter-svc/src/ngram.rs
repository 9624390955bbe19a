//! Prompt-lookup drafting: find the most recent earlier occurrence of the context's last n
//! tokens (n from `max_n` down to `min_n`) and propose what followed it. Costs microseconds
//! and wins on input-grounded text (edits, quotes, structured rewrites).

/// Match lengths tried, longest first, and where a proposal stops.
#[derive(Debug, Clone, Copy)]
pub struct NgramConfig {
    pub max_n: usize,
    pub min_n: usize,
    /// End a proposal before the first token (after its first) where the suffix's earlier
    /// occurrences, followed as far as the proposal so far, disagree on what came next:
    /// the text varies there (a value in a repeated record, a renamed variable), and drafts
    /// past that point are rarely kept.
    pub stop_at_disagreement: bool,
}

impl Default for NgramConfig {
    fn default() -> Self {
        Self {
            max_n: 4,
            min_n: 1,
            stop_at_disagreement: true,
        }
    }
}

/// Prompt-lookup flags, shared by the drafter service and the orchestrator (which can
/// answer prompt-lookup drafts itself with --ngram-in-process).
#[derive(Debug, Clone, clap::Args)]
pub struct NgramArgs {
    /// Longest suffix the prompt-lookup drafter tries to match.
    #[arg(long, env = "SPECD_NGRAM_MAX", default_value_t = NgramConfig::default().max_n)]
    pub ngram_max: usize,
    /// Shortest suffix the prompt-lookup drafter accepts as a match (at least 1).
    #[arg(long, env = "SPECD_NGRAM_MIN", default_value_t = NgramConfig::default().min_n)]
    pub ngram_min: usize,
    /// End a prompt-lookup proposal where the matched suffix's earlier occurrences disagree
    /// on what came next (true/false).
    #[arg(long, env = "SPECD_NGRAM_STOP_AT_DISAGREEMENT", default_value_t = NgramConfig::default().stop_at_disagreement, action = clap::ArgAction::Set)]
    pub ngram_stop_at_disagreement: bool,
}

impl NgramArgs {
    pub fn config(&self) -> NgramConfig {
        NgramConfig {
            max_n: self.ngram_max,
            min_n: self.ngram_min.max(1),
            stop_at_disagreement: self.ngram_stop_at_disagreement,
        }
    }
}

/// A prompt-lookup proposal.
#[derive(Debug, Clone, PartialEq)]
pub struct NgramProposal {
    pub tokens: Vec<u32>,
    /// Length of the suffix that matched (0: no match, no tokens).
    pub match_length: usize,
    /// Share of the suffix's earlier occurrences followed by the proposed first token,
    /// smoothed: (agreeing + 1) / (occurrences + 2).
    pub confidence: f32,
}

impl NgramProposal {
    fn none() -> Self {
        Self {
            tokens: Vec::new(),
            match_length: 0,
            confidence: 0.0,
        }
    }
}

/// Proposes up to `max_tokens` tokens continuing `context`.
pub fn propose(context: &[u32], max_tokens: usize, config: NgramConfig) -> NgramProposal {
    let len = context.len();
    if max_tokens == 0 || config.min_n == 0 {
        return NgramProposal::none();
    }
    for n in (config.min_n..=config.max_n).rev() {
        if len <= n {
            continue;
        }
        let suffix = &context[len - n..];
        // Earlier occurrences, most recent first, each with a following token.
        let mut occurrences = (0..len - n).rev().filter(|&i| &context[i..i + n] == suffix);
        let Some(latest) = occurrences.next() else {
            continue;
        };
        let start = latest + n;
        let mut tokens: Vec<u32> = context[start..len.min(start + max_tokens)].to_vec();
        // Where the earlier occurrences' continuations start, and those that begin with the
        // proposal's first token.
        let earlier: Vec<usize> = occurrences.map(|i| i + n).collect();
        let agreeing: Vec<usize> = earlier
            .iter()
            .copied()
            .filter(|&s| context[s] == tokens[0])
            .collect();
        let confidence = (agreeing.len() as f32 + 2.0) / (earlier.len() as f32 + 3.0);
        if config.stop_at_disagreement {
            tokens.truncate(agreed_length(context, agreeing, &tokens));
        }
        return NgramProposal {
            tokens,
            match_length: n,
            confidence,
        };
    }
    NgramProposal::none()
}

/// How many of `tokens` (the continuation of the latest occurrence of the context's last n
/// tokens) to propose: all, or up to the first one where the earlier continuations that
/// agreed with the proposal so far (`agreeing`, those agreeing on its first token) do not
/// all agree with it. (Earlier occurrences start before the latest, so each has a token
/// wherever it does.)
fn agreed_length(context: &[u32], mut agreeing: Vec<usize>, tokens: &[u32]) -> usize {
    for (j, &token) in tokens.iter().enumerate().skip(1) {
        let before = agreeing.len();
        agreeing.retain(|&start| context[start + j] == token);
        if agreeing.len() < before {
            return j;
        }
    }
    tokens.len()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn continues_the_most_recent_longest_match() {
        // "1 2 3 9 | 1 2 3 7 8 | 1 2 3" -> the most recent "1 2 3" was followed by 7 8.
        let context = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 1, 2, 3];
        let p = propose(&context, 2, NgramConfig::default());
        assert_eq!(p.tokens, vec![7, 8]);
        assert_eq!(p.match_length, 3);
        // Two earlier "1 2 3": one followed by 7, one by 9 -> (1 + 1) / (2 + 2).
        assert!((p.confidence - 0.5).abs() < 1e-6);
    }

    #[test]
    fn falls_back_to_shorter_matches_and_stops_at_the_context_end() {
        let context = [5, 6, 7, 1, 9, 9, 1];
        let p = propose(
            &context,
            8,
            NgramConfig {
                max_n: 3,
                min_n: 1,
                ..NgramConfig::default()
            },
        );
        assert_eq!(p.match_length, 1);
        assert_eq!(p.tokens, vec![9, 9, 1]);
    }

    #[test]
    fn proposes_nothing_without_a_match() {
        let p = propose(&[1, 2, 3, 4], 4, NgramConfig::default());
        assert!(p.tokens.is_empty());
        assert_eq!(p.match_length, 0);
        assert_eq!(propose(&[], 4, NgramConfig::default()).tokens, Vec::<u32>::new());
        assert!(propose(&[1, 1, 1], 0, NgramConfig::default()).tokens.is_empty());
    }

    #[test]
    fn a_proposal_ends_where_earlier_occurrences_disagree() {
        // "5 6" was followed by "3 4" and then by "3 0 2": the latest continuation is
        // proposed up to where the two part.
        let context = [5, 6, 3, 4, 1, 5, 6, 3, 0, 2, 5, 6];
        let stop = NgramConfig::default();
        let keep_going = NgramConfig {
            stop_at_disagreement: false,
            ..stop
        };
        assert_eq!(propose(&context, 4, keep_going).tokens, vec![3, 0, 2, 5]);
        assert_eq!(propose(&context, 4, stop).tokens, vec![3]);
        // A first token they disagree on is proposed all the same, with what follows it
        // (the caller's acceptance record for short matches prices it).
        let context = [5, 6, 7, 8, 9, 1, 5, 6, 3, 8, 9, 2, 5, 6];
        assert_eq!(propose(&context, 3, stop).tokens, vec![3, 8, 9]);
        // One occurrence: nothing to disagree with.
        assert_eq!(propose(&[1, 2, 3, 4, 1, 2], 4, stop).tokens, vec![3, 4, 1, 2]);
    }

    #[test]
    fn respects_min_n() {
        let context = [4, 1, 2, 8, 2];
        assert!(
            propose(
                &context,
                3,
                NgramConfig {
                    max_n: 3,
                    min_n: 2,
                    ..NgramConfig::default()
                }
            )
            .tokens
            .is_empty()
        );
        assert_eq!(
            propose(
                &context,
                3,
                NgramConfig {
                    max_n: 3,
                    min_n: 1,
                    ..NgramConfig::default()
                }
            )
            .tokens,
            vec![8, 2]
        );
    }

    #[test]
    fn flags_default_to_the_default_config_and_clamp_min_n() {
        use clap::Parser;
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            ngram: NgramArgs,
        }
        let defaults = Cli::try_parse_from(["specd"]).expect("no flags").ngram.config();
        let expected = NgramConfig::default();
        assert_eq!(
            (defaults.max_n, defaults.min_n, defaults.stop_at_disagreement),
            (expected.max_n, expected.min_n, expected.stop_at_disagreement)
        );
        let set = Cli::try_parse_from([
            "specd",
            "--ngram-max",
            "6",
            "--ngram-min",
            "0",
            "--ngram-stop-at-disagreement",
            "false",
        ])
        .expect("valid flags")
        .ngram
        .config();
        assert_eq!((set.max_n, set.min_n, set.stop_at_disagreement), (6, 1, false));
    }
}
