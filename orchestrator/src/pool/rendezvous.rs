//! Session affinity by rendezvous (highest-random-weight) hashing with bounded load. Every
//! orchestrator ranks replicas for a session the same way, with a fixed hash (FNV-1a 64 then
//! the SplitMix64 finaliser) that no library upgrade can change, so a session keeps landing
//! on the replica that holds its cache; when a replica leaves, only its sessions move. A new
//! session skips a replica already carrying more than `load_factor` × its fair share of the
//! calls in flight, so one hot replica sheds to the next choice.

/// FNV-1a over the session id, a separator and the replica's key, finalised by SplitMix64.
/// Part of the wire-level contract between orchestrators: do not change.
pub fn weight(session: &str, replica: &str) -> u64 {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut hash = OFFSET;
    for byte in session.bytes().chain([0xff]).chain(replica.bytes()) {
        hash ^= u64::from(byte);
        hash = hash.wrapping_mul(PRIME);
    }
    hash = (hash ^ (hash >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    hash = (hash ^ (hash >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    hash ^ (hash >> 31)
}

/// Indices of `replicas` from the session's first choice to its last.
pub fn rank(session: &str, replicas: &[&str]) -> Vec<usize> {
    let mut order: Vec<usize> = (0..replicas.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(weight(session, replicas[i])), replicas[i]));
    order
}

/// The replica a new session should use: its highest-ranked one whose calls in flight are
/// under the bound ⌈load_factor × (total + 1) / n⌉. `candidates` holds (key, calls in
/// flight); `None` only when it is empty.
pub fn choose(session: &str, candidates: &[(&str, usize)], load_factor: f64) -> Option<usize> {
    if candidates.is_empty() {
        return None;
    }
    let keys: Vec<&str> = candidates.iter().map(|c| c.0).collect();
    let order = rank(session, &keys);
    let total: usize = candidates.iter().map(|c| c.1).sum();
    let bound = (load_factor.max(1.0) * (total + 1) as f64 / candidates.len() as f64).ceil() as usize;
    // Some replica is always under the bound (n × bound > total), so this finds one.
    order
        .iter()
        .copied()
        .find(|&i| candidates[i].1 < bound)
        .or(order.first().copied())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_hash_is_pinned() {
        // Values from an independent implementation (Python). Changing them moves every
        // session in a running fleet: never do it.
        assert_eq!(weight("", ""), 0x4f2d_b50f_1240_40cd);
        assert_eq!(weight("session-1", "10.0.0.1:50052"), 0x44a3_44fa_fadb_2781);
    }

    #[test]
    fn ranking_is_stable_and_only_a_leaving_replicas_sessions_move() {
        let all = [
            "10.0.0.1:50052",
            "10.0.0.2:50052",
            "10.0.0.3:50052",
            "10.0.0.4:50052",
        ];
        let without_third: Vec<&str> = all.iter().copied().filter(|r| *r != all[2]).collect();
        let mut moved = 0;
        for s in 0..2000 {
            let session = format!("s{s}");
            let first = all[rank(&session, &all)[0]];
            // The input order does not matter.
            let mut reversed = all;
            reversed.reverse();
            assert_eq!(reversed[rank(&session, &reversed)[0]], first);
            let after = without_third[rank(&session, &without_third)[0]];
            if first == all[2] {
                moved += 1;
                assert_ne!(after, all[2]);
            } else {
                assert_eq!(after, first, "a session on a staying replica must not move");
            }
        }
        // About a quarter of the sessions lived on the replica that left.
        assert!((350..650).contains(&moved), "{moved}");
    }

    #[test]
    fn sessions_spread_evenly() {
        let all = ["a:1", "b:1", "c:1"];
        let mut counts = [0usize; 3];
        for s in 0..3000 {
            counts[rank(&format!("session-{s}"), &all)[0]] += 1;
        }
        for c in counts {
            assert!((850..1150).contains(&c), "{counts:?}");
        }
    }

    #[test]
    fn a_hot_replica_sheds_new_sessions_to_the_next_choice() {
        let keys = ["a:1", "b:1", "c:1"];
        let session = "hot";
        let order = rank(session, &keys);
        let idle: Vec<(&str, usize)> = keys.iter().map(|k| (*k, 0)).collect();
        assert_eq!(choose(session, &idle, 1.25), Some(order[0]));
        // The first choice carries 10 of 12 calls in flight: bound is ceil(1.25 × 13 / 3) = 6.
        let mut loaded = idle.clone();
        loaded[order[0]].1 = 10;
        loaded[order[1]].1 = 1;
        loaded[order[2]].1 = 1;
        assert_eq!(choose(session, &loaded, 1.25), Some(order[1]));
        // Everyone busy but evenly: affinity wins.
        let even: Vec<(&str, usize)> = keys.iter().map(|k| (*k, 4)).collect();
        assert_eq!(choose(session, &even, 1.25), Some(order[0]));
        assert_eq!(choose(session, &[], 1.25), None);
    }
}
