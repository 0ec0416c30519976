//! The on-disk form of a sharded checkpoint, with no engine in it: each rank's manifest and data
//! file, written atomically, read back and checked.
//!
//! A checkpoint is a directory. Rank `r` writes `rank-<r>.bin` (its sections, one after
//! another) and then `rank-<r>.json` (its manifest: the layout it was saved with, the optimizer
//! state's step and settings, where each section lies, the data file's length and xxh3-64
//! checksum). Each file is written under a temporary name, flushed to disk and renamed, the
//! manifest last, so a rank's part becomes visible only once complete; a checkpoint is complete
//! when every rank's manifest is there and they agree.

use std::fs::{self, File};
use std::io::{Read, Write};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use xxhash_rust::xxh3::Xxh3;

use crate::error::{Error, Result};
use crate::plan::{Group, Plan};
use crate::spec::ProcessGroupSpec;
use crate::types::DType;

/// The version of the layout below; a manifest of another is refused.
pub const FORMAT: u32 = 1;

/// What a section of a rank's data file holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SectionKind {
    /// The rank's shard of the group's values, in the group's dtype.
    Values,
    /// The fp32 master of a bf16/f16 group.
    Master,
    /// AdamW's first moment.
    FirstMoment,
    /// AdamW's second moment.
    SecondMoment,
}

/// One section of a data file: `bytes` bytes at `offset`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Section {
    pub group: usize,
    pub kind: SectionKind,
    pub offset: u64,
    pub bytes: u64,
}

/// A parameter as the checkpoint's plan laid it out.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ParamRecord {
    pub name: String,
    pub shape: Vec<u64>,
    pub dtype: String,
    pub trainable: bool,
    pub group: usize,
    pub offset: usize,
    pub padded_numel: usize,
    /// The process group that shards it; absent for the data-parallel world.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub process_group: Option<String>,
}

/// One rank's manifest.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct RankManifest {
    pub format: u32,
    pub rank: usize,
    pub world_size: usize,
    /// Optimizer steps taken before the save (AdamW's bias correction continues from it).
    pub optimizer_steps: u64,
    pub lr: f32,
    pub weight_decay: f32,
    /// "adamw" or "sgd".
    pub optimizer: String,
    /// The dtype AdamW's moments are saved in ("f32" or "bf16"; absent in earlier saves: f32).
    #[serde(default = "f32_name")]
    pub moment_dtype: String,
    pub params: Vec<ParamRecord>,
    /// The process groups of the save: rank `r` held copy `r / size` of their groups, at place
    /// `r % size`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub process_groups: Vec<ProcessGroupSpec>,
    pub sections: Vec<Section>,
    pub data_bytes: u64,
    /// The data file's xxh3-64, as 16 hex digits.
    pub data_xxh3: String,
}

fn f32_name() -> String {
    DType::F32.to_string()
}

/// Every parameter of `plan`, as a manifest records it.
pub fn records(plan: &Plan) -> Vec<ParamRecord> {
    plan.params()
        .iter()
        .map(|p| ParamRecord {
            name: p.name.clone(),
            shape: p.shape.clone(),
            dtype: p.dtype.name().to_string(),
            trainable: p.trainable,
            group: p.group,
            offset: p.offset,
            padded_numel: p.padded_numel,
            process_group: plan.groups()[p.group]
                .process_group
                .map(|pg| plan.process_groups()[pg].name.clone()),
        })
        .collect()
}

/// The saved ranks that hold, at their places in order, the copy of `group` that rank `rank`
/// of `plan` holds: the whole saved world for a group of the data-parallel world, else the
/// block of the saved process group's size at the same copy. `Error::CheckpointMismatch` when
/// the save holds another number of copies.
pub fn saved_block(
    saved: &RankManifest,
    plan: &Plan,
    group: &Group,
    rank: usize,
) -> Result<Range<usize>> {
    let Some(pg) = group.process_group else {
        return Ok(0..saved.world_size);
    };
    let name = &plan.process_groups()[pg].name;
    let size = saved
        .process_groups
        .iter()
        .find(|g| &g.name == name)
        .map_or(0, |g| g.size);
    let saved_copies = saved.world_size.checked_div(size).unwrap_or(0);
    if size == 0 || saved_copies != plan.copies(group) {
        return Err(Error::CheckpointMismatch {
            differences: vec![format!(
                "process group {name:?}: saved as {saved_copies} copies ({} ranks, groups of \
                 {size}), loaded as {} ({} ranks, groups of {})",
                saved.world_size,
                plan.copies(group),
                plan.world_size(),
                group.shards
            )],
        });
    }
    let first = plan.copy(group, rank) * size;
    Ok(first..first + size)
}

/// What differs between a checkpoint's parameters and a plan's declarations (names, shapes,
/// dtypes, trainable, and so groups), one line each; empty when they agree. Offsets and padding
/// may differ: they follow the world size.
pub fn differences(saved: &[ParamRecord], plan: &[ParamRecord]) -> Vec<String> {
    let mut out = Vec::new();
    for p in plan {
        match saved.iter().find(|s| s.name == p.name) {
            None => out.push(format!("{:?} is not in the checkpoint", p.name)),
            Some(s) if s.process_group != p.process_group => out.push(format!(
                "{:?}: saved sharded over {}, declared over {}",
                p.name,
                sharded_over(&s.process_group),
                sharded_over(&p.process_group)
            )),
            Some(s) if (&s.shape, &s.dtype, s.trainable) != (&p.shape, &p.dtype, p.trainable) => {
                out.push(format!(
                    "{:?}: saved as {} {:?}{}, declared {} {:?}{}",
                    p.name,
                    s.dtype,
                    s.shape,
                    if s.trainable { "" } else { " frozen" },
                    p.dtype,
                    p.shape,
                    if p.trainable { "" } else { " frozen" },
                ));
            }
            Some(_) => {}
        }
    }
    for s in saved {
        if !plan.iter().any(|p| p.name == s.name) {
            out.push(format!(
                "{:?} is in the checkpoint, not in the model",
                s.name
            ));
        }
    }
    let groups = |records: &[ParamRecord]| -> Vec<(String, usize)> {
        records.iter().map(|r| (r.name.clone(), r.group)).collect()
    };
    if out.is_empty() && groups(saved) != groups(plan) {
        out.push("the parameters are declared in another order (other groups)".into());
    }
    out
}

fn sharded_over(process_group: &Option<String>) -> String {
    match process_group {
        Some(name) => format!("process group {name:?}"),
        None => "the data-parallel world".into(),
    }
}

pub fn data_path(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("rank-{rank:05}.bin"))
}

pub fn manifest_path(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("rank-{rank:05}.json"))
}

fn io_error(path: &Path) -> impl Fn(std::io::Error) -> Error + '_ {
    move |source| Error::Write {
        path: path.display().to_string(),
        source: Arc::new(source),
    }
}

/// The refusal of the checkpoint file at `path`, for `reason`.
pub fn unreadable(path: &Path, reason: impl Into<String>) -> Error {
    Error::CheckpointUnreadable {
        path: path.display().to_string(),
        reason: reason.into(),
    }
}

/// Writes `path` under a temporary name, flushed to disk, then renames it into place.
fn write_atomically(path: &Path, write: impl FnOnce(&mut File) -> Result<()>) -> Result<()> {
    let temporary = path.with_extension("partial");
    let mut file = File::create(&temporary).map_err(io_error(&temporary))?;
    write(&mut file)?;
    file.sync_all().map_err(io_error(&temporary))?;
    drop(file);
    fs::rename(&temporary, path).map_err(io_error(path))
}

/// Makes `dir` for rank `rank`'s part, refusing one that holds that part already: a save never
/// overwrites a checkpoint.
pub fn prepare(dir: &Path, rank: usize) -> Result<()> {
    fs::create_dir_all(dir).map_err(io_error(dir))?;
    for path in [manifest_path(dir, rank), data_path(dir, rank)] {
        if path.exists() {
            return Err(Error::CheckpointExists {
                path: path.display().to_string(),
            });
        }
    }
    Ok(())
}

/// Writes rank `manifest.rank`'s data (the sections `write_sections` writes, in order) and then
/// its manifest, each atomically; fills in the data's length and checksum.
pub fn write_rank(
    dir: &Path,
    mut manifest: RankManifest,
    write_sections: impl FnOnce(&mut dyn FnMut(&[u8]) -> Result<()>) -> Result<()>,
) -> Result<()> {
    let data = data_path(dir, manifest.rank);
    let mut hasher = Xxh3::new();
    let mut length = 0u64;
    write_atomically(&data, |file| {
        let mut out = std::io::BufWriter::with_capacity(1 << 22, file);
        write_sections(&mut |bytes: &[u8]| {
            hasher.update(bytes);
            length += bytes.len() as u64;
            out.write_all(bytes).map_err(io_error(&data))
        })?;
        out.flush().map_err(io_error(&data))
    })?;
    manifest.data_bytes = length;
    manifest.data_xxh3 = format!("{:016x}", hasher.digest());
    let path = manifest_path(dir, manifest.rank);
    let text =
        serde_json::to_vec_pretty(&manifest).map_err(|e| unreadable(&path, e.to_string()))?;
    write_atomically(&path, |file| file.write_all(&text).map_err(io_error(&path)))?;
    sync_dir(dir)
}

/// Makes the renames durable.
fn sync_dir(dir: &Path) -> Result<()> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(io_error(dir))
}

/// Rank `rank`'s manifest, parsed and of this format.
pub fn read_manifest(dir: &Path, rank: usize) -> Result<RankManifest> {
    let path = manifest_path(dir, rank);
    let text = match fs::read(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let reason = if dir.is_dir() {
                "missing: the checkpoint is incomplete (a save that did not finish), or of fewer ranks"
            } else {
                "missing: no checkpoint directory"
            };
            return Err(unreadable(&path, reason));
        }
        Err(e) => return Err(unreadable(&path, e.to_string())),
    };
    let manifest: RankManifest = serde_json::from_slice(&text)
        .map_err(|e| unreadable(&path, format!("not a manifest: {e}")))?;
    if manifest.format != FORMAT || manifest.rank != rank {
        return Err(unreadable(
            &path,
            format!(
                "format {} of rank {}, expected format {FORMAT} of rank {rank}",
                manifest.format, manifest.rank
            ),
        ));
    }
    Ok(manifest)
}

/// Every rank's manifest of the checkpoint in `dir`, checked to be of one save: the same world
/// size, step and parameters as rank 0's.
pub fn read_manifests(dir: &Path) -> Result<Vec<RankManifest>> {
    let first = read_manifest(dir, 0)?;
    let mut saved = crate::fallible::with_capacity(first.world_size, "the manifests")?;
    for rank in 0..first.world_size {
        let m = read_manifest(dir, rank)?;
        let agrees = m.world_size == first.world_size
            && m.optimizer_steps == first.optimizer_steps
            && m.params == first.params
            && m.process_groups == first.process_groups;
        if !agrees {
            return Err(unreadable(
                &manifest_path(dir, rank),
                format!(
                    "of another save: {} ranks at step {}, rank 0's says {} at {}",
                    m.world_size, m.optimizer_steps, first.world_size, first.optimizer_steps
                ),
            ));
        }
        saved.push(m);
    }
    Ok(saved)
}

/// A byte range of a data file that a load needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Wanted {
    pub offset: u64,
    pub len: u64,
}

/// Rank `manifest.rank`'s data file, opened once its length and checksum are checked against
/// the manifest (a front-to-back read): ranges read from it afterwards are the saved bytes.
pub fn verified_data(dir: &Path, manifest: &RankManifest) -> Result<File> {
    let path = data_path(dir, manifest.rank);
    let mut file = File::open(&path).map_err(|e| unreadable(&path, e.to_string()))?;
    let mut chunk = crate::fallible::filled(1 << 23, 0u8, "a checkpoint read")?;
    let mut hasher = Xxh3::new();
    let mut length = 0u64;
    loop {
        match file.read(&mut chunk) {
            Ok(0) => break,
            Ok(n) => {
                hasher.update(&chunk[..n]);
                length += n as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(unreadable(&path, e.to_string())),
        }
    }
    if length != manifest.data_bytes {
        return Err(unreadable(
            &path,
            format!(
                "truncated or grown: {length} bytes, the manifest says {}",
                manifest.data_bytes
            ),
        ));
    }
    let digest = format!("{:016x}", hasher.digest());
    if digest != manifest.data_xxh3 {
        return Err(unreadable(
            &path,
            format!(
                "corrupted: checksum {digest}, the manifest says {}",
                manifest.data_xxh3
            ),
        ));
    }
    Ok(file)
}

/// Reads `wanted` of the data file `file` of rank `rank` into `out` (`wanted.len` bytes).
pub fn read_range(
    dir: &Path,
    rank: usize,
    file: &mut File,
    wanted: Wanted,
    out: &mut [u8],
) -> Result<()> {
    use std::io::{Seek, SeekFrom};
    let path = data_path(dir, rank);
    file.seek(SeekFrom::Start(wanted.offset))
        .and_then(|_| file.read_exact(out))
        .map_err(|e| unreadable(&path, format!("{wanted:?}: {e}")))
}
