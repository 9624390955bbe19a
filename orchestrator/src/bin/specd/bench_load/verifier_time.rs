//! Where the verifiers' time went during a run, from their engines' metrics (see the model
//! crate's pass record), read from each verifier's `/metrics` page before and after it:
//! seconds in passes that carried prompt chunks, seconds in decode-only passes and the rows
//! those scored; what remains of the run's wall time on each verifier is idle. It is what
//! bounds batching end to end: prompt passes cost the same batched or not, so the share of
//! time they take limits what faster decode passes can gain (Amdahl).

use specd_common::metrics_page::{scrape, value};

/// Engine time summed over a stack's verifiers (totals since start, or a run's difference).
#[derive(Debug, Default, Clone, Copy)]
pub struct EngineTime {
    pub prompt_pass_seconds: f64,
    pub decode_pass_seconds: f64,
    /// Rows (decode and verify tokens) scored in decode-only passes.
    pub decode_pass_rows: f64,
}

impl EngineTime {
    /// The totals of the verifiers whose metrics pages are at `addresses`.
    pub async fn read(addresses: &[String]) -> anyhow::Result<Self> {
        let mut total = Self::default();
        for address in addresses {
            let samples = scrape(address).await?;
            total.prompt_pass_seconds += value(&samples, "specd_engine_pass_seconds_sum{kind=\"prompt\"}");
            total.decode_pass_seconds += value(&samples, "specd_engine_pass_seconds_sum{kind=\"decode\"}");
            total.decode_pass_rows += value(&samples, "specd_engine_scored_tokens_total{kind=\"decode\"}");
        }
        Ok(total)
    }

    /// What accrued between `earlier` and these totals.
    pub fn since(self, earlier: Self) -> Self {
        Self {
            prompt_pass_seconds: self.prompt_pass_seconds - earlier.prompt_pass_seconds,
            decode_pass_seconds: self.decode_pass_seconds - earlier.decode_pass_seconds,
            decode_pass_rows: self.decode_pass_rows - earlier.decode_pass_rows,
        }
    }

    pub fn add(&mut self, other: Self) {
        self.prompt_pass_seconds += other.prompt_pass_seconds;
        self.decode_pass_seconds += other.decode_pass_seconds;
        self.decode_pass_rows += other.decode_pass_rows;
    }

    /// Shares of `verifier_seconds` (wall time × verifiers) in prompt passes, in decode
    /// passes and idle, and the rows per second of the decode passes.
    pub fn breakdown(&self, verifier_seconds: f64) -> Breakdown {
        let share = |s: f64| {
            if verifier_seconds > 0.0 {
                s / verifier_seconds
            } else {
                0.0
            }
        };
        let busy = self.prompt_pass_seconds + self.decode_pass_seconds;
        Breakdown {
            prompt_pass_share: share(self.prompt_pass_seconds),
            decode_pass_share: share(self.decode_pass_seconds),
            idle_share: share((verifier_seconds - busy).max(0.0)),
            decode_pass_rows_per_second: if self.decode_pass_seconds > 0.0 {
                self.decode_pass_rows / self.decode_pass_seconds
            } else {
                0.0
            },
        }
    }
}

/// A run's verifier time, as reported per row.
#[derive(Debug, Default, Clone, Copy, serde::Serialize)]
pub struct Breakdown {
    pub prompt_pass_share: f64,
    pub decode_pass_share: f64,
    pub idle_share: f64,
    pub decode_pass_rows_per_second: f64,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shares_split_the_verifiers_wall_time() {
        let before = EngineTime {
            prompt_pass_seconds: 1.0,
            decode_pass_seconds: 2.0,
            decode_pass_rows: 100.0,
        };
        let after = EngineTime {
            prompt_pass_seconds: 2.0,
            decode_pass_seconds: 4.0,
            decode_pass_rows: 500.0,
        };
        let b = after.since(before).breakdown(4.0);
        assert_eq!(b.prompt_pass_share, 0.25);
        assert_eq!(b.decode_pass_share, 0.5);
        assert_eq!(b.idle_share, 0.25);
        assert_eq!(b.decode_pass_rows_per_second, 200.0);
    }
}
