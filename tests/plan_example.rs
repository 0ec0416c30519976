//! The plan printer as a user runs it: names with control characters come out escaped, and a
//! reader that goes away early (`| head`) ends it quietly.

use std::io::Read;
use std::path::PathBuf;
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

#[test]
fn names_are_escaped_and_a_closed_pipe_ends_it_quietly() {
    let exe = build_plan_example();
    let model = model_file(
        "bell.json",
        r#"{"params": [{"name": "w\u001b[2J\u0007", "shape": [4], "dtype": "f32"}]}"#,
    );
    let out = Command::new(&exe)
        .args(["--world-size", "2", "--model"])
        .arg(&model)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8(out.stdout).unwrap();
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
