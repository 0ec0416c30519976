//! The on-disk form of a sharded checkpoint, with no engine in it.
//!
//! A checkpoint is a directory. Rank `r` writes `rank-<r>.bin` (its sections, one after
//! another) and then `rank-<r>.json` (its manifest: the save's id, the layout it was saved
//! with, the optimizer state's step and settings, where each section lies, the data file's
//! length and the xxh3-64 of each of its chunks, all under a checksum of the manifest's own
//! text). Each file is written under a unique temporary name, flushed to disk and linked into
//! place (never over an existing file), the manifest last, and the directory flushed, so a
//! rank's part becomes visible only once complete. A checkpoint is complete when every rank's
//! manifest is there and they describe one save.
//!
//! - `mod.rs`: the manifest and what it says of a plan; `layout`: a manifest checked field by
//!   field and the saved layout it describes (pure); `files`: the directory and its files,
//!   written atomically and durably; `data`: data files read in checked chunks.

mod data;
mod files;
mod layout;

use std::ops::Range;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::plan::{Group, Plan};
use crate::spec::ProcessGroupSpec;

pub use data::{CHUNK_BYTES, DataReader, FileRange, read_ranges};
pub(crate) use data::{ChunkDigests, RankReader};
pub use files::{
    check_free, check_path, make_dir, read_manifest, read_saved, sync_parent, write_new,
};
pub(crate) use files::{remove_rank, write_rank};
pub use layout::{Run, SaveId, Saved, SavedGroup};

/// The version of the layout below; a manifest of another is refused.
pub const FORMAT: u32 = 2;

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
#[serde(deny_unknown_fields)]
pub struct Section {
    pub group: usize,
    pub kind: SectionKind,
    pub offset: u64,
    pub bytes: u64,
}

/// A parameter as the checkpoint's plan laid it out.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
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
#[serde(deny_unknown_fields)]
pub struct RankManifest {
    /// The id its ranks agreed on when the save began (32 hex digits): rank files of two saves
    /// never load as one checkpoint.
    pub save_id: String,
    pub rank: usize,
    pub world_size: usize,
    /// Optimizer steps taken before the save (AdamW's bias correction continues from it).
    pub optimizer_steps: u64,
    pub lr: f32,
    pub weight_decay: f32,
    /// "adamw" or "sgd".
    pub optimizer: String,
    /// The dtype AdamW's moments are saved in ("f32" or "bf16").
    pub moment_dtype: String,
    pub params: Vec<ParamRecord>,
    /// The process groups of the save: rank `r` held copy `r / size` of their groups, at place
    /// `r % size`.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub process_groups: Vec<ProcessGroupSpec>,
    pub sections: Vec<Section>,
    pub data_bytes: u64,
    /// The data file is checksummed in chunks of this many bytes (the last one shorter).
    pub chunk_bytes: u64,
    /// Each chunk's xxh3-64, as 16 hex digits.
    pub chunk_xxh3: Vec<String>,
}

/// A manifest file: the format, the manifest, and the xxh3-64 of the manifest's text as the
/// file holds it.
#[derive(Serialize)]
struct Envelope<'a> {
    format: u32,
    manifest: &'a serde_json::value::RawValue,
    xxh3: String,
}

#[derive(Deserialize)]
struct ReadEnvelope<'a> {
    #[serde(borrow)]
    manifest: &'a serde_json::value::RawValue,
    xxh3: String,
}

#[derive(Deserialize)]
struct FormatOnly {
    format: Option<u32>,
}

/// The xxh3-64 of `bytes`, as 16 hex digits.
pub(crate) fn hex_digest(bytes: &[u8]) -> String {
    format!("{:016x}", xxhash_rust::xxh3::xxh3_64(bytes))
}

impl RankManifest {
    /// The manifest file's bytes.
    pub fn encode(&self) -> Result<Vec<u8>> {
        let invalid = |e: serde_json::Error| Error::CheckpointUnreadable {
            path: format!("the manifest of rank {}", self.rank),
            reason: e.to_string(),
        };
        let text = serde_json::to_string_pretty(self).map_err(invalid)?;
        let raw = serde_json::value::RawValue::from_string(text).map_err(invalid)?;
        let envelope = Envelope {
            format: FORMAT,
            xxh3: hex_digest(raw.get().as_bytes()),
            manifest: &raw,
        };
        serde_json::to_vec_pretty(&envelope).map_err(invalid)
    }

    /// The manifest in the bytes of the file `path`, refused (naming the file and the field)
    /// when they are not a manifest of this format whose text has its checksum.
    pub fn decode(path: &Path, bytes: &[u8]) -> Result<RankManifest> {
        let format = serde_json::from_slice::<FormatOnly>(bytes)
            .map_err(|e| unreadable(path, format!("not a manifest: {e}")))?
            .format;
        if format != Some(FORMAT) {
            let found = format.map_or("no format".to_string(), |f| format!("format {f}"));
            return Err(unreadable(
                path,
                format!("{found}; this library reads format {FORMAT}"),
            ));
        }
        let envelope: ReadEnvelope<'_> = serde_json::from_slice(bytes)
            .map_err(|e| unreadable(path, format!("not a manifest: {e}")))?;
        let digest = hex_digest(envelope.manifest.get().as_bytes());
        if digest != envelope.xxh3 {
            return Err(unreadable(
                path,
                format!(
                    "the manifest was changed: its text's checksum is {digest}, the file says {}",
                    envelope.xxh3
                ),
            ));
        }
        serde_json::from_str(envelope.manifest.get())
            .map_err(|e| unreadable(path, format!("field {e}")))
    }
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
    let first = plan.copy(group, rank)? * size;
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

/// Rank `rank`'s data file in the checkpoint `dir`.
pub fn data_path(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("rank-{rank:05}.bin"))
}

/// Rank `rank`'s manifest in the checkpoint `dir`.
pub fn manifest_path(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("rank-{rank:05}.json"))
}

/// Whether `name` is a rank file's: `rank-<digits>.json` or `.bin`.
fn is_rank_file(name: &str) -> bool {
    let Some(rest) = name.strip_prefix("rank-") else {
        return false;
    };
    let Some(digits) = rest
        .strip_suffix(".json")
        .or_else(|| rest.strip_suffix(".bin"))
    else {
        return false;
    };
    !digits.is_empty() && digits.bytes().all(|b| b.is_ascii_digit())
}

/// The refusal of the checkpoint file at `path`, for `reason`.
pub fn unreadable(path: &Path, reason: impl Into<String>) -> Error {
    Error::CheckpointUnreadable {
        path: path.display().to_string(),
        reason: reason.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_rank_files_are_taken_for_a_checkpoint() {
        for name in ["rank-00000.json", "rank-00012.bin", "rank-123456.json"] {
            assert!(is_rank_file(name), "{name}");
        }
        for name in [
            "rank-.json",
            "rank-0a.bin",
            "notes.json",
            ".rank-00000.bin.1.partial",
        ] {
            assert!(!is_rank_file(name), "{name}");
        }
    }

    #[test]
    fn a_save_id_reads_back_from_its_hex_and_from_nothing_else() {
        let id = SaveId::fresh();
        assert_eq!(SaveId::from_hex(&id.to_hex()), Some(id));
        let upper = id.to_hex().to_uppercase();
        assert_eq!(SaveId::from_hex(&upper), Some(id));
        let hex = id.to_hex();
        for text in [
            &hex[1..],
            &format!("{hex}0"),
            &format!("+{}", &hex[1..]),
            "",
        ] {
            assert_eq!(SaveId::from_hex(text), None, "{text:?}");
        }
    }
}
