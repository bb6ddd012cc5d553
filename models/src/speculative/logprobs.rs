//! Log-probabilities of committed tokens under the target: `log_softmax` of the target's logits
//! row that predicted each token (the verify row of its parent node, or the prefill's last
//! row), so speculation changes nothing in them: a committed token's row is the same row plain
//! decoding samples it from. Computed in f64 on the host, only for sequences that ask
//! ([`crate::speculative::Engine::set_logprobs`]).

/// One committed token's log-probability and the row's `top` most likely tokens (most likely
/// first, ties by lower id).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// `log_softmax(row)[token]` and the `top_n` best entries.
pub fn token_logprob(row: &[f32], token: u32, top_n: usize) -> TokenLogprob {
    let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    let lse = max
        + row
            .iter()
            .map(|&x| (x as f64 - max).exp())
            .sum::<f64>()
            .ln();
    let lp = |i: usize| row.get(i).map_or(f64::NEG_INFINITY, |&x| x as f64 - lse) as f32;
    let top = if top_n == 0 {
        Vec::new()
    } else {
        let mut idx: Vec<usize> = (0..row.len()).collect();
        let n = top_n.min(idx.len());
        let order = |a: &usize, b: &usize| row[*b].total_cmp(&row[*a]).then(a.cmp(b));
        if n < idx.len() {
            idx.select_nth_unstable_by(n, order);
            idx.truncate(n);
        }
        idx.sort_by(order);
        idx.into_iter().map(|i| (i as u32, lp(i))).collect()
    };
    TokenLogprob {
        token,
        logprob: lp(token as usize),
        top,
    }
}

/// The committed tokens of one verify round: token `j` of `emitted` was predicted by the row
/// of accepted node `accepted[j]` (`rows` are the tree's rows, node order).
pub fn committed(
    rows: &[Vec<f32>],
    accepted: &[usize],
    emitted: &[u32],
    top_n: usize,
) -> Vec<TokenLogprob> {
    emitted
        .iter()
        .zip(accepted)
        .filter_map(|(&t, &node)| rows.get(node).map(|r| token_logprob(r, t, top_n)))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn logprobs_are_the_log_softmax_and_top_entries_are_ordered() {
        let row = [1.0f32, 3.0, 2.0, 3.0];
        let z: f64 = row.iter().map(|&x| (x as f64).exp()).sum();
        let t = token_logprob(&row, 2, 3);
        assert!((t.logprob as f64 - (2.0 - z.ln())).abs() < 1e-6);
        let ids: Vec<u32> = t.top.iter().map(|p| p.0).collect();
        assert_eq!(ids, [1, 3, 2]);
        let total: f64 = (0..4)
            .map(|i| (token_logprob(&row, i, 0).logprob as f64).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-6);
    }

    #[test]
    fn each_committed_token_takes_its_parents_row() {
        let rows = vec![vec![0.0, 5.0], vec![5.0, 0.0], vec![0.0, 0.0]];
        // Root 0 accepted child 2; tokens: child 2's token (from row 0) then the bonus (row 2).
        let lps = committed(&rows, &[0, 2], &[1, 0], 0);
        assert_eq!(lps.len(), 2);
        assert!(lps[0].logprob > -0.01, "{lps:?}");
        assert!((lps[1].logprob - (0.5f32).ln()).abs() < 1e-6);
    }
}
