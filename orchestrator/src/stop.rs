//! Stop strings over streamed text: text is released only once it can no longer be the
//! start of a stop string, and generation ends where a stop string completes (the stop
//! string itself is not part of the output).

pub struct StopMatcher {
    stops: Vec<String>,
    /// Text decoded but not yet released.
    pending: String,
    /// Longest stop string, in bytes.
    longest: usize,
}

/// What adding text produced.
#[derive(Debug, PartialEq, Eq)]
pub struct StopCheck {
    /// Text that is safe to release now.
    pub release: String,
    /// A stop string completed (everything after it is dropped).
    pub stopped: bool,
}

impl StopMatcher {
    pub fn new(stops: Vec<String>) -> Self {
        let longest = stops.iter().map(String::len).max().unwrap_or(0);
        Self {
            stops,
            pending: String::new(),
            longest,
        }
    }

    pub fn push(&mut self, text: &str) -> StopCheck {
        self.pending.push_str(text);
        let first_stop = self
            .stops
            .iter()
            .filter_map(|s| self.pending.find(s.as_str()))
            .min();
        if let Some(at) = first_stop {
            let release = self.pending[..at].to_string();
            self.pending.clear();
            return StopCheck {
                release,
                stopped: true,
            };
        }
        // Hold back the longest tail that is a prefix of some stop string.
        let hold = (1..self.longest.min(self.pending.len() + 1))
            .rev()
            .find(|&n| {
                let start = self.pending.len() - n;
                self.pending.is_char_boundary(start)
                    && self.stops.iter().any(|s| s.starts_with(&self.pending[start..]))
            })
            .unwrap_or(0);
        let cut = self.pending.len() - hold;
        let release = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        StopCheck {
            release,
            stopped: false,
        }
    }

    /// Releases whatever is held back (generation ended for another reason).
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_without_stops_flows_through() {
        let mut m = StopMatcher::new(vec![]);
        assert_eq!(m.push("abc").release, "abc");
    }

    #[test]
    fn a_stop_split_across_chunks_is_held_then_cut() {
        let mut m = StopMatcher::new(vec!["\n\n".into(), "END".into()]);
        assert_eq!(m.push("Hello E").release, "Hello ");
        assert_eq!(m.push("N").release, "");
        let check = m.push("D and more");
        assert_eq!(
            check,
            StopCheck {
                release: String::new(),
                stopped: true
            }
        );
    }

    #[test]
    fn a_false_start_is_released() {
        let mut m = StopMatcher::new(vec!["END".into()]);
        assert_eq!(m.push("EN").release, "");
        assert_eq!(m.push("X").release, "ENX");
        assert_eq!(m.push("E").release, "");
        assert_eq!(m.finish(), "E");
    }

    #[test]
    fn the_earliest_stop_wins() {
        let mut m = StopMatcher::new(vec!["b".into(), "a".into()]);
        assert_eq!(m.push("xxab").release, "xx");
    }
}
