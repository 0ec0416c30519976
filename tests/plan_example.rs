//! The plan printer as a user runs it: names with control characters come out escaped, and a
//! reader that goes away early (`| head`) ends it quietly.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

fn build_plan_example() -> PathBuf {
    fsdp_fusion_support::examples::build("plan")
}

fn model_file(name: &str, json: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("fsdp-plan-example-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::write(&path, json).unwrap();
    path
}

/// What the example prints for `model` at world size 2 with `options`; it must succeed.
fn printed_plan(exe: &Path, model: &Path, options: &[&str]) -> String {
    let out = Command::new(exe)
        .args(["--world-size", "2", "--model"])
        .arg(model)
        .args(options)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn names_are_escaped_and_a_closed_pipe_ends_it_quietly() {
    let exe = build_plan_example();
    let model = model_file(
        "bell.json",
        r#"{"params": [{"name": "w\u001b[2J\u0007", "shape": [4], "dtype": "f32"}]}"#,
    );
    let text = printed_plan(&exe, &model, &[]);
    assert!(text.contains(r"w\u{1b}[2J\u{7}"), "{text}");
    assert!(
        !text.contains('\u{1b}'),
        "a raw escape reached the terminal"
    );

    // Many parameters, so the printer is still writing when its reader goes away.
    let params: Vec<String> = (0..5000)
        .map(|i| format!(r#"{{"name": "p{i}", "shape": [4], "dtype": "f32"}}"#))
        .collect();
    let model = model_file(
        "many.json",
        &format!(r#"{{"params": [{}]}}"#, params.join(",")),
    );
    let mut child = Command::new(&exe)
        .args(["--world-size", "2", "--model"])
        .arg(&model)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut first = [0u8; 16];
    child.stdout.take().unwrap().read_exact(&mut first).unwrap();
    // The pipe's read end is closed here.
    let status = child.wait().unwrap();
    let mut stderr = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    assert!(status.success(), "{status}: {stderr}");
    assert_eq!(stderr, "");
}

/// The bytes the example printed on the line of `what` ("  what ... (N bytes)...").
fn printed_bytes(text: &str, what: &str) -> usize {
    let line = text
        .lines()
        .find(|l| l.trim_start().starts_with(what))
        .unwrap_or_else(|| panic!("no line for {what}: {text}"));
    let (_, after) = line.split_once('(').unwrap();
    let (number, _) = after.split_once(" bytes)").unwrap();
    number.parse().unwrap()
}

#[test]
fn the_memory_options_give_the_bytes_the_engine_allocates() {
    use fsdp_fusion::{
        DType, EngineConfig, GradShardMemory, ModelSpec, ParamStorage, Plan, Policy,
    };
    let exe = build_plan_example();
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("examples/models/tiny.json");
    let plan = Plan::new(&ModelSpec::from_path(&path).unwrap(), 2).unwrap();
    let run = |options: &[&str]| printed_plan(&exe, &path, options);
    let lean = EngineConfig {
        param_storage: ParamStorage::MasterOnly,
        grad_shard_memory: GradShardMemory::PerStep,
        moment_dtype: DType::Bf16,
        ..EngineConfig::default()
    };
    let options = [
        "--param-storage",
        "master-only",
        "--grad-shards",
        "per-step",
        "--moment-dtype",
        "bf16",
    ];
    for (config, options) in [
        (EngineConfig::default(), &[][..]),
        (lean.clone(), &options[..]),
    ] {
        let text = run(options);
        let want = Policy::new(&plan, &config).unwrap().memory;
        let printed = |what| printed_bytes(&text, what);
        assert_eq!(printed("parameter shards"), want.param_shards, "{text}");
        assert_eq!(printed("optimizer state"), want.optimizer_state, "{text}");
        assert_eq!(printed("peak"), want.peak, "{text}");
        assert_eq!(printed("between steps"), want.between_steps, "{text}");
    }
    // The options change what a rank holds: each one's saving shows.
    let (default, lean_text) = (run(&[]), run(&options));
    for what in ["parameter shards", "optimizer state", "between steps"] {
        assert!(
            printed_bytes(&lean_text, what) < printed_bytes(&default, what),
            "{what}"
        );
    }
    // Stepping in the backward holds fewer gradient shards at the peak, as the policy bounds
    // them, and the same between steps.
    let in_backward = [&options[..], &["--step-in-backward"]].concat();
    let text = run(&in_backward);
    let want = Policy::new(
        &plan,
        &EngineConfig {
            step_in_backward: true,
            ..lean
        },
    )
    .unwrap()
    .memory;
    assert_eq!(
        printed_bytes(&text, "gradient shards"),
        want.grad_shards,
        "{text}"
    );
    assert_eq!(printed_bytes(&text, "peak"), want.peak, "{text}");
    assert!(
        printed_bytes(&text, "peak") < printed_bytes(&lean_text, "peak"),
        "{text}"
    );
    assert_eq!(
        printed_bytes(&text, "between steps"),
        printed_bytes(&lean_text, "between steps")
    );
}
