//! Offline round replay (DDTREE.md §7.2): the rounds speculative decoding would run on the
//! target's own greedy continuation, with the reference tokens standing in for the target.
//!
//! At temperature 0 the engine follows a tree node only when it equals the target's argmax
//! given the node's ancestors, so every accepted node is a prefix of the target's greedy
//! continuation `y`. A round anchored at `s` (the bonus `y[s]` at position `s`) therefore accepts
//! exactly the longest prefix of `y[s+1..]` that the round's tree contains, and the next round
//! starts at `s + 1 + accepted`. The drafter's inputs are reproducible too: its context is the
//! target features of positions `< s` (a causal forward over `[prompt, y]` computes the same
//! features as the verify passes, up to kernel numerics) and its block is
//! `[y[s], mask, ..., mask]`.
//!
//! Round-replay schedule: `s_0 = prompt_len`, the position of the first generated token (the
//! prefill's bonus), `s_{r+1} = s_r + 1 + accepted_r`, while fewer than `generated` tokens are
//! committed (`s - prompt_len + 1 < generated`); `generated` is where the engine stops (an
//! end-of-sequence token or `max_new_tokens`). Like the engine, a round's tree is cut to the
//! depth that `max_new_tokens` still allows (`max_new_tokens - committed - 1`; the engine's
//! second cap, the position table, never binds when prompt + `max_new_tokens` fits the
//! context), and it counts every accepted draft, also those past an end-of-sequence token, so
//! the reference continues past that token up to `max_new_tokens`.
//!
//! Trees are built and walked with the engine's own pure functions (`chain_tree`,
//! `build_ddtree`, `walk`), the walk getting `y[s + 1 + depth]` as "the target's token" at
//! every node.

use candle_core::Tensor;
use dflash_models::speculative::{
    build_ddtree, chain_tree, walk, Algorithm, DraftTree, ProposeItem, Proposer, SeqId, TopK,
};
use serde::Serialize;

use super::error::EvalError;

/// How a round's drafts are verified.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum Verify {
    /// Vanilla DFlash: the argmax chain `[y_s, d_1 .. d_L]`.
    Chain,
    /// DDTree with `budget` draft nodes (root excluded; depth <= budget).
    DDTree { budget: usize },
}

impl Verify {
    /// `chain` or `ddtree-B`, as in tables and JSON.
    pub fn label(&self) -> String {
        match self {
            Verify::Chain => "chain".into(),
            Verify::DDTree { budget } => format!("ddtree-{budget}"),
        }
    }

    /// The engine algorithm that decodes with this verification.
    pub fn algorithm(&self) -> Algorithm {
        match *self {
            Verify::Chain => Algorithm::Chain,
            Verify::DDTree { budget } => Algorithm::DDTree { budget },
        }
    }

    /// `chain` followed by `ddtree-B` for each budget.
    pub fn chain_and_budgets(budgets: &[usize]) -> Vec<Verify> {
        std::iter::once(Verify::Chain)
            .chain(budgets.iter().map(|&budget| Verify::DDTree { budget }))
            .collect()
    }

    fn top_k(&self) -> usize {
        match self {
            Verify::Chain => 1,
            Verify::DDTree { budget } => *budget,
        }
    }

    /// The engine's tree for this round, its depth cut to `depth_cap`.
    fn tree(&self, bonus: u32, topk: &TopK, depth_cap: usize) -> DraftTree {
        match *self {
            Verify::Chain => {
                let mut drafts = topk.argmax_tokens();
                drafts.truncate(depth_cap);
                chain_tree(bonus, &drafts)
            }
            // The proposal may hold more candidates than `budget` (one draft pass serves every
            // budget); the tree is the same, since a rank-r node needs r earlier siblings.
            Verify::DDTree { budget } => {
                let depths = topk.depths().min(depth_cap);
                let capped = TopK::new((0..depths).map(|d| topk.row(d).to_vec()).collect());
                build_ddtree(bonus, &capped, budget)
            }
        }
    }
}

/// One replayed round: what `SeqEvent::round` reports for it in the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct ReplayRound {
    /// Position of the round's bonus token.
    pub anchor: usize,
    /// Accepted drafts (the streak); tau of the round is `accepted + 1`.
    pub accepted: usize,
    /// Deepest node of the round's tree.
    pub tree_depth: usize,
    /// Draft nodes verified (root excluded).
    pub tree_nodes: usize,
}

/// One prompt's reference: prompt, greedy continuation and target features.
#[derive(Debug, Clone, Copy)]
pub struct ReplayInput<'a> {
    pub id: &'a str,
    /// Prompt tokens followed by the target's greedy continuation, `max_new_tokens` of it
    /// (past any end-of-sequence token).
    pub tokens: &'a [u32],
    pub prompt_len: usize,
    /// The request's length limit.
    pub max_new_tokens: usize,
    /// Tokens the engine commits before it stops (1..=max_new_tokens; 1 is the prefill token).
    pub generated: usize,
    /// Target features `[>= last anchor, taps * hidden]` in the proposer's layer order, on the
    /// proposer's device; `None` for proposers that need none.
    pub features: Option<&'a Tensor>,
}

/// One prompt's progress: each verification's next anchor and rounds so far.
struct PromptState {
    anchors: Vec<usize>,
    rounds: Vec<Vec<ReplayRound>>,
    /// Positions whose features the proposer has been given.
    fed: usize,
}

impl PromptState {
    /// The next anchor to draft at: the smallest one still inside the output.
    fn next(&self, input: &ReplayInput<'_>) -> Option<usize> {
        let end = input.prompt_len + input.generated;
        self.anchors.iter().copied().filter(|&s| s + 1 < end).min()
    }

    /// Walks every verification anchored at `s` with the reference tokens and moves it on.
    fn advance(&mut self, input: &ReplayInput<'_>, verifies: &[Verify], s: usize, topk: &TopK) {
        let committed = s - input.prompt_len + 1;
        let depth_cap = (input.max_new_tokens - committed).saturating_sub(1);
        for (v, verify) in verifies.iter().enumerate() {
            if self.anchors[v] != s {
                continue;
            }
            let tree = verify.tree(input.tokens[s], topk, depth_cap);
            let reference: Vec<u32> = tree
                .depths
                .iter()
                .map(|&d| input.tokens[s + 1 + d])
                .collect();
            let accepted = walk(&tree, &reference).0.len() - 1;
            self.rounds[v].push(ReplayRound {
                anchor: s,
                accepted,
                tree_depth: tree.depths.iter().copied().max().unwrap_or(0),
                tree_nodes: tree.num_nodes(),
            });
            self.anchors[v] = s + 1 + accepted;
        }
    }
}

fn check_input(input: &ReplayInput<'_>) -> Result<(), EvalError> {
    let (p, n, max_new) = (input.prompt_len, input.generated, input.max_new_tokens);
    let bad = |message: String| EvalError::Replay {
        id: input.id.to_string(),
        message,
    };
    if p == 0 || n == 0 || n > max_new {
        return Err(bad(format!(
            "needs a prompt and 1..={max_new} generated tokens, got {n}"
        )));
    }
    // A round at s reads at most up to s + 1 + depth_cap = p + max_new - 1.
    if input.tokens.len() < p + max_new {
        return Err(bad(format!(
            "{} reference tokens, but a {p}-token prompt with max_new_tokens {max_new} needs {}",
            input.tokens.len(),
            p + max_new
        )));
    }
    Ok(())
}

/// Replays every round of each prompt in `inputs` under each of `verifies`, returning
/// `rounds[prompt][verify]`.
///
/// The prompts advance together: each proposer call carries one item per unfinished prompt
/// (sequence id = its index), so a batched drafter runs one forward per step for all of them.
/// Per prompt, the proposer sees each distinct anchor once, in ascending order, with exactly
/// the features it would have received online by then; one draft pass serves every
/// verification whose schedule reaches that anchor. A proposer with hidden state (a seeded
/// noisy one) reproduces the engine's call sequence only when replayed one prompt and one
/// verification at a time, as the engine runs one request.
pub fn replay_batch(
    proposer: &mut dyn Proposer,
    inputs: &[ReplayInput<'_>],
    verifies: &[Verify],
) -> Result<Vec<Vec<Vec<ReplayRound>>>, EvalError> {
    for input in inputs {
        check_input(input)?;
    }
    let top_k = verifies.iter().map(Verify::top_k).max().unwrap_or(1);
    let mut states: Vec<PromptState> = inputs
        .iter()
        .map(|input| PromptState {
            anchors: vec![input.prompt_len; verifies.len()],
            rounds: vec![Vec::new(); verifies.len()],
            fed: 0,
        })
        .collect();
    let mut opened = 0;
    let result = (|| {
        for (i, input) in inputs.iter().enumerate() {
            proposer.open(i as SeqId, input.tokens.len())?;
            opened += 1;
        }
        loop {
            let step: Vec<(usize, usize)> = states
                .iter()
                .zip(inputs)
                .enumerate()
                .filter_map(|(i, (st, input))| st.next(input).map(|s| (i, s)))
                .collect();
            if step.is_empty() {
                return Ok(());
            }
            let features = step
                .iter()
                .map(|&(i, s)| match inputs[i].features {
                    Some(f) if s > states[i].fed => {
                        f.narrow(0, states[i].fed, s - states[i].fed).map(Some)
                    }
                    _ => Ok(None),
                })
                .collect::<candle_core::Result<Vec<Option<Tensor>>>>()?;
            let items: Vec<ProposeItem<'_>> = step
                .iter()
                .zip(&features)
                .map(|(&(i, s), f)| ProposeItem {
                    seq: i as SeqId,
                    tokens: &inputs[i].tokens[..=s],
                    features: f.as_ref(),
                    top_k,
                })
                .collect();
            let proposals = proposer.propose(&items)?;
            if proposals.len() != step.len() {
                return Err(EvalError::Replay {
                    id: inputs[step[0].0].id.to_string(),
                    message: format!(
                        "the proposer returned {} proposals for {} items",
                        proposals.len(),
                        step.len()
                    ),
                });
            }
            for (&(i, s), topk) in step.iter().zip(&proposals) {
                states[i].fed = s;
                states[i].advance(&inputs[i], verifies, s, topk);
            }
        }
    })();
    for i in 0..opened {
        proposer.close(i as SeqId);
    }
    result.map(|()| states.into_iter().map(|st| st.rounds).collect())
}

/// [`replay_batch`] for one prompt: `rounds[verify]`.
pub fn replay_prompt(
    proposer: &mut dyn Proposer,
    input: &ReplayInput<'_>,
    verifies: &[Verify],
) -> Result<Vec<Vec<ReplayRound>>, EvalError> {
    let mut all = replay_batch(proposer, std::slice::from_ref(input), verifies)?;
    Ok(all.pop().unwrap_or_default())
}
