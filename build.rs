//! Compiles `kernels/*.cu` with nvcc into one fatbin, `$OUT_DIR/kernels.fatbin`, which the CUDA
//! backend embeds. Without nvcc the fatbin is empty: the crate still builds (CI has no CUDA
//! toolkit) and loading the kernels fails at run time with a clear error.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitCode};

/// The GPUs the fatbin carries code for: A100 and H100/H200 machine code, plus PTX that newer
/// GPUs compile at load time.
const ARCH_FLAGS: [&str; 6] = [
    "-gencode",
    "arch=compute_80,code=sm_80",
    "-gencode",
    "arch=compute_90,code=sm_90",
    "-gencode",
    "arch=compute_90,code=compute_90",
];

fn main() -> ExitCode {
    match build() {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("{message}");
            ExitCode::FAILURE
        }
    }
}

fn build() -> Result<(), String> {
    let manifest =
        env::var("CARGO_MANIFEST_DIR").map_err(|e| format!("CARGO_MANIFEST_DIR: {e}"))?;
    let out_dir = env::var("OUT_DIR").map_err(|e| format!("OUT_DIR: {e}"))?;
    let kernels = Path::new(&manifest).join("kernels");
    let fatbin = Path::new(&out_dir).join("kernels.fatbin");

    println!("cargo:rerun-if-changed={}", kernels.display());
    for var in ["NVCC", "CUDA_HOME", "PATH"] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let sources = kernel_files(&kernels)?;
    for file in &sources {
        println!("cargo:rerun-if-changed={}", file.display());
    }

    let Some(nvcc) = find_nvcc() else {
        println!(
            "cargo:warning=nvcc not found ($NVCC, $CUDA_HOME/bin/nvcc, PATH): the CUDA kernels are \
             not built, and the CUDA backend will report KernelsUnavailable"
        );
        return fs::write(&fatbin, []).map_err(|e| format!("writing {}: {e}", fatbin.display()));
    };

    // One translation unit that includes every family keeps this to one nvcc call and one fatbin.
    let unit = Path::new(&out_dir).join("kernels.cu");
    let includes: String = sources
        .iter()
        .filter(|f| f.extension().is_some_and(|e| e == "cu"))
        .map(|f| format!("#include \"{}\"\n", f.display()))
        .collect();
    fs::write(&unit, includes).map_err(|e| format!("writing {}: {e}", unit.display()))?;

    let output = Command::new(&nvcc)
        .arg("-fatbin")
        .args(ARCH_FLAGS)
        .args(["-O3", "-std=c++17", "-o"])
        .arg(&fatbin)
        .arg(&unit)
        .output()
        .map_err(|e| format!("running {}: {e}", nvcc.display()))?;
    if !output.status.success() {
        return Err(format!(
            "{} failed ({}) compiling the CUDA kernels:\n{}{}",
            nvcc.display(),
            output.status,
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        ));
    }
    Ok(())
}

/// The `.cu` and `.cuh` files of the kernels directory, sorted so the fatbin is reproducible.
fn kernel_files(dir: &Path) -> Result<Vec<PathBuf>, String> {
    let entries = fs::read_dir(dir).map_err(|e| format!("reading {}: {e}", dir.display()))?;
    let mut files = Vec::new();
    for entry in entries {
        let path = entry
            .map_err(|e| format!("reading {}: {e}", dir.display()))?
            .path();
        if path.extension().is_some_and(|e| e == "cu" || e == "cuh") {
            files.push(path);
        }
    }
    files.sort();
    Ok(files)
}

/// `$NVCC`, else `$CUDA_HOME/bin/nvcc`, else `nvcc` on `PATH`; the first that exists.
fn find_nvcc() -> Option<PathBuf> {
    let from_env = env::var_os("NVCC")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from);
    let from_home = env::var_os("CUDA_HOME").map(|home| Path::new(&home).join("bin").join("nvcc"));
    from_env
        .into_iter()
        .chain(from_home)
        .chain(Some(PathBuf::from("nvcc")))
        .find_map(|candidate| resolve(&candidate))
}

/// `candidate` itself when it is a file; a bare name is looked up in `PATH`.
fn resolve(candidate: &Path) -> Option<PathBuf> {
    if candidate.components().count() > 1 {
        return candidate.is_file().then(|| candidate.to_path_buf());
    }
    let path = env::var_os("PATH")?;
    env::split_paths(&path)
        .map(|dir| dir.join(candidate))
        .find(|p| p.is_file())
}
