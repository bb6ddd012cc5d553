//! A constraint on what a sequence may generate (a grammar: JSON schema, regex, EBNF), applied
//! like the penalties at every tree node: a node's row is masked for the position after the
//! committed tokens and that node's path, so the walk only accepts drafts the grammar allows
//! and speculative decoding chooses exactly the tokens plain decoding would.
//!
//! The engine knows no grammar: a server implements [`Constraint`] (dflash-serve with
//! llguidance, whose parser rolls back, which is what per-node masks need).

/// One sequence's grammar state, advanced by the engine as tokens are committed.
pub trait Constraint: Send {
    /// Sets every token the grammar forbids after the committed tokens followed by `path`
    /// to `-inf` in `row`. A `path` that itself leaves the grammar leaves `row` as it is: the
    /// walk never reaches such a node (its parent's row forbade the token).
    fn mask(&mut self, path: &[u32], row: &mut [f32]);

    /// Advances past committed tokens.
    fn commit(&mut self, tokens: &[u32]);
}

/// Sets the entries of `row` whose `allowed` test fails to `-inf`.
pub fn mask_row(row: &mut [f32], allowed: impl Fn(u32) -> bool) {
    for (t, x) in row.iter_mut().enumerate() {
        if !allowed(t as u32) {
            *x = f32::NEG_INFINITY;
        }
    }
}
