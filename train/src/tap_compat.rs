//! Whether other engines serve a drafter's taps as this project does. Every tap here follows
//! transformers' `hidden_states[i + 1]` (`dflash_models::taps`), which is what z-lab's
//! `extract_context_feature` feeds a DFlash drafter, so a tap on the target's last layer is
//! the final-normed output. SGLang and vLLM capture their auxiliary hidden states inside the
//! layer loop, as the residual stream (`hidden_states + residual`), and never after the final
//! norm:
//! - vLLM: `EagleModelMixin._maybe_add_hidden_state` (`vllm/model_executor/models/interfaces.py`)
//!   appends `hidden_states + residual`; Qwen2/Qwen3 call it with `layer_idx + 1` after each
//!   layer, and DFlash asks for `target_layer_ids + 1`, so the last layer's tap (aux id L) is
//!   the raw output entering the final norm (vLLM's hidden-state extraction docs: aux id
//!   `num_hidden_layers` gives the last layer's output, "not normalized using the output
//!   norm");
//! - SGLang: `set_dflash_layers_to_capture` captures "before layer `k + 1`"
//!   (`python/sglang/srt/models/qwen3.py`), in a loop over layers `0..L`, so index L is never
//!   reached: dense targets return one feature short, and the Qwen3.5 path fails at startup
//!   with an IndexError (`qwen3_5.py` `set_dflash_layers_to_capture`, SGLang issue 32204; its
//!   open fix appends the pre-norm stream, again not the normed one).
//!
//! So a drafter tapping the last layer is served differently there; `dflash-train` says so.

/// A warning when `target_layer_ids` taps the last of `num_target_layers` layers; None when
/// every engine treats the taps alike.
pub fn last_layer_tap_warning(
    target_layer_ids: &[usize],
    num_target_layers: usize,
) -> Option<String> {
    let last = num_target_layers.checked_sub(1)?;
    if !target_layer_ids.contains(&last) {
        return None;
    }
    Some(format!(
        "target_layer_ids {target_layer_ids:?} taps layer {last}, the last of the target's \
         {num_target_layers}: dflash-serve, dflash-train and z-lab's dflash_generate feed the drafter \
         the final-normed output there (transformers' hidden_states[{num_target_layers}]), but vLLM \
         feeds the raw output before the final norm and SGLang does not capture it at all (one \
         feature short, or an IndexError on Qwen3.5 targets), so this drafter would not be served \
         alike there; taps below layer {last} are (the default rule picks them)"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_a_tap_on_the_last_layer_warns() {
        assert!(last_layer_tap_warning(&[1, 2], 4).is_none());
        assert!(last_layer_tap_warning(&[1, 9, 17, 25, 33], 36).is_none());
        let w = last_layer_tap_warning(&[1, 3], 4).unwrap();
        assert!(
            w.contains("layer 3") && w.contains("vLLM") && w.contains("SGLang"),
            "{w}"
        );
    }
}
