//! The C consumer, `examples/c/train.c`, compiled with the system C compiler against the static
//! library and the checked-in header, trains the example model and matches the Rust trainer; in
//! its captured mode (the model's math as host functions on the streams, one step captured and
//! replayed) it prints its eager losses bit for bit.

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fsdp_fusion::{DType, EngineConfig, OptimizerConfig, Plan};
use fsdp_fusion_support::mlp::{Mlp, MlpConfig, Recipe, Training};
use fsdp_fusion_support::ranks::{DEADLINE, Mode, for_each_mode};

/// The cargo target directory this test runs from: `<target>/<profile>/deps/<test>`.
fn target_dir() -> (PathBuf, String) {
    let exe = std::env::current_exe().expect("test executable path");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>");
    let profile = profile_dir
        .file_name()
        .expect("profile")
        .to_string_lossy()
        .to_string();
    (profile_dir.parent().expect("target").to_path_buf(), profile)
}

/// Compiles the C program beside this test, against the static library that cargo built for
/// it: the test depends on the library, so cargo built every crate type of it (the static one
/// too) into the profile's `deps` before it ran the test. A build of its own would build the
/// crate and its dependencies again, with the features of a build without the tests.
fn build_c_consumer() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let (target, profile) = target_dir();
    let lib = target.join(&profile).join("deps").join("libfsdp_fusion.a");
    assert!(
        lib.is_file(),
        "{} is missing: run this test through cargo, which builds it",
        lib.display()
    );
    let exe = target.join(&profile).join("c-train");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".to_string());
    let out = Command::new(cc)
        .current_dir(root)
        .args([
            "-std=c11",
            "-O2",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-Iinclude",
            "examples/c/train.c",
        ])
        .arg(&lib)
        .args(["-lpthread", "-ldl", "-lm", "-lrt", "-o"])
        .arg(&exe)
        .output()
        .expect("run the C compiler");
    assert!(
        out.status.success(),
        "compiling examples/c/train.c failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    exe
}

fn rust_losses(world: usize, steps: u64) -> Vec<f32> {
    let model = Mlp::new(MlpConfig {
        layers: 2,
        width: 16,
        inputs: 8,
        batch: 4,
        dtype: DType::F32,
        seed: 7,
        embed_lr_scale: 1.0,
    });
    let plan = Arc::new(Plan::new(&model.spec().unwrap(), world).unwrap());
    let config = EngineConfig {
        double_buffer_limit: 4,
        optimizer: OptimizerConfig::AdamW {
            lr: 1e-2,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
        },
        ..EngineConfig::default()
    };
    let init = model.init(1);
    let training = Training {
        model: &model,
        plan: &plan,
        config: &config,
        init: &init,
        steps,
        passes: 2,
        recipe: Recipe::default(),
    };
    let mut losses = Vec::new();
    training
        .on_cpu(|_, ranks| {
            losses.push(ranks.iter().map(|r| r.loss).sum::<f32>() / world as f32);
            Ok(())
        })
        .unwrap();
    losses
}

#[test]
fn the_c_consumer_trains_like_the_rust_trainer() {
    let exe = build_c_consumer();
    let runs = [(2usize, 6u64), (3, 4)];
    for_each_mode(|mode| {
        for (world, steps) in runs {
            let mut args = vec![world.to_string(), steps.to_string()];
            if let Mode::Async(seed) = mode {
                args.push(seed.to_string());
            }
            let losses = check_c_losses(&exe, &args, world, steps);
            if let Mode::Async(_) = mode {
                // The model's math on the streams, the second step captured and replayed.
                args.push("captured".into());
                let captured = check_c_losses(&exe, &args, world, steps);
                assert_eq!(captured, losses, "captured ({args:?}) against eager");
            }
        }
    });
}

/// Runs `command` to its end, killing it (and failing) past [`DEADLINE`].
fn run_within_deadline(command: &mut Command) -> Output {
    let mut child = command
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the C consumer");
    let start = Instant::now();
    while child.try_wait().expect("wait for the C consumer").is_none() {
        if start.elapsed() > DEADLINE {
            let _ = child.kill();
            panic!("the C consumer did not finish within {:?}", DEADLINE);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    child.wait_with_output().expect("the C consumer's output")
}

/// Runs the C consumer with `args` and compares its losses with the Rust trainer's; returns its
/// output.
fn check_c_losses(exe: &Path, args: &[String], world: usize, steps: u64) -> String {
    {
        let out = run_within_deadline(Command::new(exe).args(args));
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let c: Vec<f32> = String::from_utf8_lossy(&out.stdout)
            .lines()
            .map(|l| {
                l.rsplit(' ')
                    .next()
                    .and_then(|v| v.parse().ok())
                    .expect("step <n> loss <v>")
            })
            .collect();
        let rust = rust_losses(world, steps);
        assert_eq!(c.len(), rust.len());
        // The C program multiplies matrices in another order than the Rust one: equal to rounding.
        for (step, (c, r)) in c.iter().zip(&rust).enumerate() {
            assert!(
                (c - r).abs() <= 1e-4 * r.abs(),
                "world {world} step {step}: C {c} Rust {r}"
            );
        }
        assert!(rust.last() < rust.first(), "no training happened: {rust:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}
