//! The GPU check of the trainer's fused AdamW (`gpu-check --trainer-optimizer`,
//! src/bin/gpu_check/train_optim.rs) run on the CPU, where the fused optimizer runs its host
//! reference: resume exactness, the NaN-gradient skip, the step against the reference
//! optimizer and the checkpoint snapshot (flat buffers cut on the writer's side, bit-identical
//! to the per-tensor state) must all pass here before they are read on the GPU.

use std::process::Command;

#[test]
fn trainer_optimizer_check_passes_on_the_cpu() {
    let out = Command::new(env!("CARGO_BIN_EXE_gpu_check"))
        .args(["cpu", "--trainer-optimizer"])
        .output()
        .expect("gpu_check runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let cases: Vec<&str> = stdout
        .lines()
        .filter(|l| l.starts_with("trainer_optimizer_"))
        .collect();
    let names: Vec<&str> = cases
        .iter()
        .filter_map(|l| l.split_once(' ').map(|(n, _)| n))
        .collect();
    assert_eq!(
        names,
        [
            "trainer_optimizer_resume",
            "trainer_optimizer_nan_skip",
            "trainer_optimizer_step_parity",
            "trainer_optimizer_snapshot"
        ],
        "{stdout}"
    );
    for line in cases {
        let (name, body) = line.split_once(' ').expect("name and JSON");
        let v: serde_json::Value = serde_json::from_str(body).expect("JSON");
        assert_eq!(v["pass"], true, "{name}: {v}");
    }
}
