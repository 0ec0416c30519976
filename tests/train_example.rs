//! The main job's checkpoints as a user runs them: a 4-rank run saved after 3 steps, resumed at 3
//! ranks (no step left) and exported, writes the 4-rank run's own export bit for bit; a save
//! into a folder that holds a checkpoint is refused before training; a run with `--capture` prints
//! the eager run's losses; exports that would fail after training, and steps of no backward
//! pass, are refused before it.

use std::process::Command;

use fsdp_fusion_support::scratch::Scratch;

/// Runs the main job `train` with `args`: whether it succeeded, its output and its errors.
fn run(train: &std::path::Path, args: &[&str]) -> (bool, String, String) {
    let out = Command::new(train)
        .args(args)
        .output()
        .expect("run the example");
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.success(), text(&out.stdout), text(&out.stderr))
}

#[test]
fn a_run_saved_at_4_ranks_exports_bit_for_bit_from_3() {
    let train = fsdp_fusion_support::examples::build("train");
    let scratch = Scratch::new("train-example");
    let (dir, four, three) = (
        scratch.join("ckpt"),
        scratch.join("four.safetensors"),
        scratch.join("three.safetensors"),
    );
    let run = |args: &[&str]| {
        let (ok, _, err) = run(&train, args);
        (ok, err)
    };
    let path = |p: &std::path::Path| p.to_str().unwrap().to_string();
    let (ok, err) = run(&[
        "--ranks",
        "4",
        "--steps",
        "3",
        "--save",
        &path(&dir),
        "--export",
        &path(&four),
    ]);
    assert!(ok, "{err}");
    let (ok, err) = run(&[
        "--ranks",
        "3",
        "--steps",
        "3",
        "--resume",
        &path(&dir),
        "--export",
        &path(&three),
    ]);
    assert!(ok, "{err}");
    let (a, b) = (
        std::fs::read(&four).unwrap(),
        std::fs::read(&three).unwrap(),
    );
    assert!(
        a == b,
        "the exports differ ({} and {} bytes)",
        a.len(),
        b.len()
    );
    let (ok, err) = run(&["--ranks", "2", "--steps", "1", "--save", &path(&dir)]);
    assert!(!ok && err.contains("exists"), "{err}");
    // An export over a file, or onto the checkpoint it is made from, is refused before training
    // (nothing saved), and so are steps of no backward pass.
    let other = scratch.join("other");
    let (ok, err) = run(&[
        "--steps",
        "1",
        "--save",
        &path(&other),
        "--export",
        &path(&four),
    ]);
    assert!(!ok && err.contains("exists") && !other.exists(), "{err}");
    let onto = format!("{}/./", path(&other));
    let (ok, err) = run(&["--steps", "1", "--save", &path(&other), "--export", &onto]);
    assert!(
        !ok && err.contains("checkpoint directory") && !other.exists(),
        "{err}"
    );
    // A dangling link where the export goes is taken too.
    let link = scratch.join("link.safetensors");
    std::os::unix::fs::symlink(scratch.join("nowhere"), &link).unwrap();
    let (ok, err) = run(&["--steps", "1", "--export", &path(&link)]);
    assert!(!ok && err.contains("exists"), "{err}");
    // A name ending in .checkpoint is a file like any other: its checkpoint is named after it.
    let named = scratch.join("x.checkpoint");
    let (ok, err) = run(&["--steps", "1", "--export", &path(&named)]);
    assert!(ok && named.is_file(), "{err}");
    let (ok, err) = run(&["--steps", "1", "--passes", "0"]);
    assert!(!ok && err.contains("--passes"), "{err}");
}

#[test]
fn the_optimizer_stepping_in_the_backward_agrees_with_the_reference_and_refuses_what_it_cannot() {
    let train = fsdp_fusion_support::examples::build("train");
    let run = |args: &[&str]| run(&train, args);
    let (ok, out, err) = run(&[
        "--step-in-backward",
        "--passes",
        "1",
        "--steps",
        "3",
        "--lr-schedule",
        "warmup-cosine",
    ]);
    assert!(ok, "{err}");
    assert!(out.contains("over all steps: 0.000e0"), "{out}");
    let (ok, _, err) = run(&["--step-in-backward", "--steps", "1"]);
    assert!(!ok && err.contains("--passes 1"), "{err}");
    let (ok, _, err) = run(&[
        "--step-in-backward",
        "--passes",
        "1",
        "--clip",
        "1",
        "--steps",
        "1",
    ]);
    assert!(!ok && err.contains("step_in_backward"), "{err}");
}

#[test]
fn a_captured_run_prints_the_eager_run_s_losses_and_refuses_the_cuda_backend() {
    let train = fsdp_fusion_support::examples::build("train");
    let run = |args: &[&str]| run(&train, args);
    let recipe = [
        "--steps",
        "4",
        "--lr-schedule",
        "warmup-cosine",
        "--warmup-steps",
        "2",
        "--clip",
        "0.1",
    ];
    let (ok, eager, err) = run(&recipe);
    assert!(ok, "{err}");
    let (ok, captured, err) = run(&[&recipe[..], &["--capture"]].concat());
    assert!(ok, "{err}");
    // Each step's line: step, sharded loss, reference loss, norm, reference norm, difference.
    let steps = |out: &str| -> Vec<Vec<String>> {
        out.lines()
            .map(|l| l.split_whitespace().map(str::to_string).collect::<Vec<_>>())
            .filter(|f| f.len() == 6 && f[0].parse::<u64>().is_ok())
            .collect()
    };
    let (eager, captured) = (steps(&eager), steps(&captured));
    assert_eq!(eager.len(), 4, "{eager:?}");
    assert_eq!(captured.len(), 4, "{captured:?}");
    for (step, (e, c)) in eager.iter().zip(&captured).enumerate() {
        let same = [0, 1, 2, 4, 5];
        assert!(
            same.iter().all(|&i| e[i] == c[i]),
            "step {step}: {e:?} {c:?}"
        );
        assert_eq!(c[5], "0.000e0", "step {step}: {c:?}");
        // The replayed steps' norm stays on the device.
        assert!(
            (step == 0) == (c[3] == e[3]) && (step == 0 || c[3] == "NaN"),
            "{c:?}"
        );
    }
    let (ok, _, err) = run(&["--capture", "--backend", "cuda", "--steps", "1"]);
    assert!(!ok && err.contains("--backend cpu"), "{err}");
}
