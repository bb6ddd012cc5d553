//! The CTA table of the varlen causal attention (`attn_varlen.cu`): which (sequence, query
//! tile) each CTA of a launch takes. Free of CUDA so that it is tested on every machine;
//! `attn_varlen.rs` uploads and launches it.
// Without the `cuda` feature only the tests use it.
#![cfg_attr(not(feature = "cuda"), allow(dead_code))]

/// Query rows (token x q-head of one KV head) per CTA: 4 warps of 16.
pub(crate) const ROWS_PER_CTA: usize = 64;

/// (sequence, tile within it) pairs, flattened, for `lens` tokens per sequence and `groups`
/// q-heads per KV head: every tile of every sequence once, tiles with the most keys (the
/// highest tile index: causal rows see more keys the later they are) first, so the longest
/// CTAs start first and the launch has a short tail.
pub fn varlen_tiles(lens: &[usize], groups: usize) -> Vec<u32> {
    let mut tiles: Vec<(u32, u32)> = lens
        .iter()
        .enumerate()
        .flat_map(|(s, &l)| {
            (0..(l * groups).div_ceil(ROWS_PER_CTA)).map(move |t| (s as u32, t as u32))
        })
        .collect();
    tiles.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
    tiles.into_iter().flat_map(|(s, t)| [s, t]).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_tile_of_every_sequence_appears_once_latest_tiles_first() {
        let (lens, groups) = ([5usize, 70, 1, 0, 200], 2);
        let flat = varlen_tiles(&lens, groups);
        let pairs: Vec<(u32, u32)> = flat.chunks(2).map(|p| (p[0], p[1])).collect();
        let mut want = Vec::new();
        for (s, &l) in lens.iter().enumerate() {
            for t in 0..(l * groups).div_ceil(ROWS_PER_CTA) {
                want.push((s as u32, t as u32));
            }
        }
        let mut got = pairs.clone();
        got.sort();
        want.sort();
        assert_eq!(got, want, "each (sequence, tile) once");
        // 5 * 2 = 10 rows: 1 tile; 140: 3; 2: 1; 0: none; 400: 7.
        assert_eq!(pairs.len(), 12);
        assert!(pairs.windows(2).all(|w| w[0].1 >= w[1].1), "{pairs:?}");
        assert_eq!(pairs[0], (4, 6));
    }
}
