//! The full model as one safetensors file: how it is written (atomically, under the callers'
//! names, shapes and dtypes, one tensor at a time), and how a sharded checkpoint of any world
//! size becomes one with no engine and no communication.

use std::io::Write;
use std::path::Path;
use std::sync::Arc;

use safetensors::Dtype;
use safetensors::tensor::{Metadata, TensorInfo};

use crate::checkpoint::{self, RankReader, SectionKind};
use crate::dtype::convert;
use crate::error::{Error, Result};
use crate::types::DType;

/// The key safetensors reserves for the file's own metadata: no tensor may take it.
pub const RESERVED_NAME: &str = "__metadata__";

/// A tensor of the file: its name, dtype and shape.
pub(crate) struct TensorHeader {
    pub(crate) name: String,
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<usize>,
}

impl TensorHeader {
    fn bytes(&self) -> Result<usize> {
        if self.shape.contains(&0) {
            return Ok(0);
        }
        self.shape
            .iter()
            .try_fold(self.dtype.size(), |n, &d| n.checked_mul(d))
            .ok_or(Error::SizeOverflow {
                what: "a tensor's bytes",
            })
    }
}

pub(crate) fn safetensors_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::Bf16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
        DType::F32 => Dtype::F32,
    }
}

pub(crate) fn file_error(path: &Path, reason: impl std::fmt::Display) -> Error {
    checkpoint::unreadable(path, reason.to_string())
}

/// Refuses an empty or existing `path`: an export never overwrites.
pub(crate) fn check_new(path: &Path) -> Result<()> {
    checkpoint::check_path(path, "the exported file")?;
    if std::fs::symlink_metadata(path).is_ok() {
        return Err(Error::CheckpointExists {
            path: path.display().to_string(),
        });
    }
    Ok(())
}

/// Writes the safetensors file `path` holding `tensors`, in their order, each tensor's bytes
/// made by `fill` (given its index and a buffer of its size) just before they are written, so
/// that only one tensor is in host memory at a time. Written as [`checkpoint::write_new`]
/// writes: never over an existing file, whole or not at all, flushed to disk.
pub(crate) fn write(
    tensors: &[TensorHeader],
    path: &Path,
    mut fill: impl FnMut(usize, &mut [u8]) -> Result<()>,
) -> Result<()> {
    check_new(path)?;
    let mut infos = Vec::with_capacity(tensors.len());
    let mut offset = 0usize;
    for t in tensors {
        if t.name == RESERVED_NAME {
            return Err(Error::ReservedName {
                name: t.name.clone(),
            });
        }
        let end = offset.checked_add(t.bytes()?).ok_or(Error::SizeOverflow {
            what: "the exported file's bytes",
        })?;
        let info = TensorInfo {
            dtype: safetensors_dtype(t.dtype),
            shape: t.shape.clone(),
            data_offsets: (offset, end),
        };
        infos.push((t.name.clone(), info));
        offset = end;
    }
    let metadata = Metadata::new(None, infos).map_err(|e| file_error(path, e))?;
    let mut header = serde_json::to_vec(&metadata).map_err(|e| file_error(path, e))?;
    // The data starts 8-byte aligned, as the format's own writer leaves it.
    header.resize(header.len().next_multiple_of(8), b' ');
    let io = |e: std::io::Error| Error::Write {
        path: path.display().to_string(),
        source: Arc::new(e),
    };
    checkpoint::write_new(path, |file| {
        let mut out = std::io::BufWriter::with_capacity(1 << 22, file);
        out.write_all(&(header.len() as u64).to_le_bytes())
            .and_then(|()| out.write_all(&header))
            .map_err(io)?;
        let mut buffer = Vec::new();
        for (i, t) in tensors.iter().enumerate() {
            crate::fallible::refill(&mut buffer, t.bytes()?, "a tensor of the export")?;
            fill(i, &mut buffer)?;
            out.write_all(&buffer).map_err(io)?;
        }
        out.flush().map_err(io)
    })
}

/// Writes the full model of the sharded checkpoint in `dir` (saved at any world size) into the
/// safetensors file `path`, as [`crate::Engine::export_safetensors`] does at world size 1: each
/// parameter's elements read from the ranks' parts that hold them (a group saved as its fp32
/// master only is rounded to its dtype, as a gather casts it), every chunk read checked. Every
/// rank's manifest is checked first (`Error::CheckpointUnreadable` naming the file and field);
/// an empty or existing `path` is refused, and so is a save whose process group held more than
/// one copy of its parameters (`Error::InvalidProcessGroup`: the file holds one model). No
/// engine and no communication: after every rank saved, one process exports. Holds one
/// parameter in host memory at a time.
pub fn export_checkpoint(dir: &Path, path: &Path) -> Result<()> {
    check_new(path)?;
    let saved = checkpoint::read_saved(dir)?;
    let first = &saved.manifests[0];
    if let Some(g) = first.process_groups.iter().find(|g| {
        let used = (first.params.iter()).any(|p| p.process_group.as_ref() == Some(&g.name));
        used && g.size != first.world_size
    }) {
        return Err(Error::InvalidProcessGroup {
            name: g.name.clone(),
            reason: format!(
                "held a copy per {} of the {} saved ranks, and an export writes one model",
                g.size, first.world_size
            ),
        });
    }
    // Group by group, as the engine's own export writes them.
    let mut order: Vec<usize> = (0..first.params.len()).collect();
    order.sort_by_key(|&i| first.params[i].group);
    let mut tensors = crate::fallible::with_capacity(first.params.len(), "the export")?;
    for p in order.iter().map(|&i| &first.params[i]) {
        tensors.push(TensorHeader {
            name: p.name.clone(),
            dtype: saved.groups[p.group].dtype,
            shape: p.shape.iter().map(|&d| d as usize).collect(),
        });
    }
    // A group's parameters lie in its ranks' files in rank order: each file is opened once a
    // group and section, and one at a time.
    let mut reader = RankReader::new(&saved);
    let mut wide = Vec::new();
    write(&tensors, path, |k, out| {
        let i = order[k];
        let group = &saved.groups[first.params[i].group];
        let kind = match saved.section(first.params[i].group, SectionKind::Values) {
            Some(_) => SectionKind::Values,
            None => SectionKind::Master,
        };
        let saved_dtype = saved.dtype_of(group, kind);
        let numel = saved.numels[i];
        let target: &mut [u8] = if saved_dtype == group.dtype {
            &mut *out
        } else {
            crate::fallible::refill(&mut wide, numel * saved_dtype.size(), "a master's part")?;
            &mut wide
        };
        for run in saved.runs(i, kind, 0, 0..numel)? {
            let size = saved_dtype.size();
            let bytes = &mut target[run.elements.start * size..run.elements.end * size];
            reader.read(run.rank, run.offset, bytes)?;
        }
        if saved_dtype != group.dtype {
            convert((out, group.dtype), (&wide, saved_dtype));
        }
        Ok(())
    })
}
