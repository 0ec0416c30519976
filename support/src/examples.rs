//! The crate's examples as a user runs them, built for the test that runs them.

use std::path::{Path, PathBuf};
use std::process::Command;

/// Builds example `name` of the fsdp-fusion crate into the running test's target directory and
/// profile, and returns the path of its executable.
pub fn build(name: &str) -> PathBuf {
    let exe = std::env::current_exe().expect("test executable path");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>");
    let target = profile_dir.parent().expect("target");
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("the workspace");
    let mut cargo = Command::new(env!("CARGO"));
    cargo
        .current_dir(root)
        .args([
            "build",
            "-p",
            "fsdp-fusion",
            "--example",
            name,
            "--target-dir",
        ])
        .arg(target);
    if profile_dir.file_name().is_some_and(|p| p == "release") {
        cargo.arg("--release");
    }
    assert!(
        cargo.status().expect("run cargo").success(),
        "building example {name}"
    );
    profile_dir.join("examples").join(name)
}
