//! The GDN layer's verify-tree kernels on CUDA: the tree's delta rule walked one node after
//! another in depth-first order (`cuda::gdn_tree`) or, where [`crate::cuda::gdn_tree_chunked_on`],
//! in the chunked form with the ancestor mask (`cuda::gdn_tree_chunked`); either stages the
//! rows' inputs as the plain tree form does.

use candle_core::{Result, Tensor};

use super::GatedDeltaNet;
use crate::cache::{GdnState, RowInputs, StagedState};
use crate::qwen3_5::delta_rule::Forest;

impl GatedDeltaNet {
    /// A verify tree's mixer (one sequence, `parents` the tree, rollback-able) on the CUDA tree
    /// kernels (`cuda::gdn_tree`): the same outputs and [`RowInputs`] staging as
    /// [`Self::mix_staged`], in three launches (four in the chunked form). `None` where the
    /// kernels do not apply (as [`Self::mix_prefill_split`], or a tree too deep for the
    /// depth-first walk); the caller then runs `mix_staged`.
    pub fn mix_tree_split(
        &self,
        proj: &Tensor,
        forest: &Forest,
        parents: &[Option<usize>],
        state: &GdnState,
    ) -> Result<Option<(Tensor, StagedState)>> {
        let t = proj.dim(0)?;
        let applies = self.kernels_apply(proj, state)? && forest.len() == t;
        let chunked =
            (crate::cuda::GDN_TREE_CHUNKED_MIN_NODES..=crate::cuda::GDN_CHUNK).contains(&t);
        // Any depth; the forest has the bits only where parents come before their children.
        if applies && chunked && crate::cuda::gdn_tree_chunked_on() {
            if let Some(anc) = forest.ancestor_bits()? {
                let out = crate::cuda::gdn_tree_chunked(
                    &state.conv,
                    proj,
                    &state.ssm,
                    &self.kernel_weights(),
                    &forest.conv_taps,
                    anc,
                )?;
                return Ok(Some((
                    out.y,
                    self.staged_inputs(proj, out.k, out.u, out.g)?,
                )));
            }
        }
        let walk = match applies {
            true => forest.depth_first_walk(crate::cuda::GDN_TREE_MAX_DEPTH)?,
            false => None,
        };
        let Some((order, depth)) = walk else {
            // Visible once per process: a declined tree runs the plain tree form (~15x slower
            // for 64 nodes at the 27B shape), which a benchmark must be able to see.
            static DECLINED: std::sync::Once = std::sync::Once::new();
            DECLINED.call_once(|| {
                let depth = crate::qwen3_5::delta_rule::dfs_order(parents, usize::MAX)
                    .and_then(|(_, d)| d.into_iter().max());
                tracing::warn!(
                    rows = t,
                    forest_rows = forest.len(),
                    kernels_apply = applies,
                    // None: a parent after its child (not a topological order).
                    tree_depth = ?depth,
                    max_depth = crate::cuda::GDN_TREE_MAX_DEPTH,
                    state_contiguous = state.ssm.is_contiguous(),
                    "GDN tree kernels declined a verify tree (plain tree form instead; logged once)"
                )
            });
            return Ok(None);
        };
        let out = crate::cuda::gdn_tree(
            &state.conv,
            proj,
            &state.ssm,
            &self.kernel_weights(),
            &forest.conv_taps,
            order,
            depth,
        )?;
        Ok(Some((
            out.y,
            self.staged_inputs(proj, out.k, out.u, out.g)?,
        )))
    }

    /// What a tree kernel's verify stages: the pre-conv rows and its keys, writes and log-decays.
    fn staged_inputs(
        &self,
        proj: &Tensor,
        k: Tensor,
        writes: Option<Tensor>,
        g: Tensor,
    ) -> Result<StagedState> {
        let Some(writes) = writes else {
            candle_core::bail!("the GDN tree kernels returned no written values")
        };
        Ok(StagedState::Inputs(RowInputs {
            pre_conv: proj.narrow(1, 0, self.conv_dim())?.contiguous()?,
            k,
            writes,
            g,
        }))
    }
}
