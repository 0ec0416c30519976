//! The full model as one safetensors file: how it is written (atomically, under the callers'
//! names, shapes and dtypes), and how a sharded checkpoint of any world size becomes one with no
//! engine and no communication.

use std::borrow::Cow;
use std::fs::File;
use std::path::Path;

use safetensors::{Dtype, View};

use crate::checkpoint::{self, RankManifest, SectionKind};
use crate::dtype::convert;
use crate::error::{Error, Result};
use crate::types::DType;

/// One parameter's bytes, as the file holds them.
pub(crate) struct Tensor {
    pub(crate) dtype: DType,
    pub(crate) shape: Vec<usize>,
    pub(crate) bytes: Vec<u8>,
}

impl View for &Tensor {
    fn dtype(&self) -> Dtype {
        safetensors_dtype(self.dtype)
    }

    fn shape(&self) -> &[usize] {
        &self.shape
    }

    fn data(&self) -> Cow<'_, [u8]> {
        Cow::Borrowed(&self.bytes)
    }

    fn data_len(&self) -> usize {
        self.bytes.len()
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

/// Refuses an existing `path`: an export never overwrites.
pub(crate) fn check_new(path: &Path) -> Result<()> {
    if path.exists() {
        return Err(Error::CheckpointExists {
            path: path.display().to_string(),
        });
    }
    Ok(())
}

/// Writes `tensors` into the safetensors file `path` under a temporary name, flushed and renamed.
pub(crate) fn write(tensors: &[(String, Tensor)], path: &Path) -> Result<()> {
    check_new(path)?;
    let temporary = path.with_extension("partial");
    let views = tensors.iter().map(|(name, t)| (name.as_str(), t));
    let written = safetensors::serialize_to_file(views, None, &temporary)
        .map_err(|e| file_error(&temporary, e))
        .and_then(|()| {
            File::open(&temporary)
                .and_then(|f| f.sync_all())
                .map_err(|e| file_error(&temporary, e))
        })
        .and_then(|()| std::fs::rename(&temporary, path).map_err(|e| file_error(path, e)));
    if written.is_err() {
        let _ = std::fs::remove_file(&temporary);
    }
    written
}

/// Writes the full model of the sharded checkpoint in `dir` (saved at any world size) into the
/// safetensors file `path`, as [`crate::Engine::export_safetensors`] does at world size 1: each
/// parameter's elements read from the ranks' parts that hold them (a group saved as its fp32
/// master only is rounded to its dtype, as a gather casts it). Every rank's manifest and data
/// file are checked first (`Error::CheckpointUnreadable` naming the file); an existing `path` is
/// refused, and so is a save whose process group held more than one copy of its parameters
/// (`Error::InvalidProcessGroup`: the file holds one model). No engine and no communication:
/// after every rank saved, one process exports. Holds the model's bytes in host memory
/// meanwhile.
pub fn export_checkpoint(dir: &Path, path: &Path) -> Result<()> {
    check_new(path)?;
    let saved = checkpoint::read_manifests(dir)?;
    if let Some(first) = saved.first()
        && let Some(g) = first.process_groups.iter().find(|g| {
            let used = (first.params.iter()).any(|p| p.process_group.as_ref() == Some(&g.name));
            used && g.size != first.world_size
        })
    {
        return Err(Error::InvalidProcessGroup {
            name: g.name.clone(),
            reason: format!(
                "held a copy per {} of the {} saved ranks, and an export writes one model",
                g.size, first.world_size
            ),
        });
    }
    let mut files = crate::fallible::with_capacity(saved.len(), "the data files")?;
    for m in &saved {
        files.push(checkpoint::verified_data(dir, m)?);
    }
    let params = saved.first().map_or(&[][..], |m| &m.params[..]);
    let mut tensors = crate::fallible::with_capacity(params.len(), "the export")?;
    for p in params {
        let dtype = DType::parse(&p.dtype).ok_or_else(|| {
            checkpoint::unreadable(
                &checkpoint::manifest_path(dir, 0),
                format!("{:?} has dtype {:?}", p.name, p.dtype),
            )
        })?;
        let numel = p
            .shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(usize::try_from(d).ok()?))
            .ok_or(Error::SizeOverflow {
                what: "a parameter's elements",
            })?;
        let mut bytes = crate::fallible::filled(numel * dtype.size(), 0u8, "a parameter's bytes")?;
        for (rank, (m, file)) in saved.iter().zip(&mut files).enumerate() {
            read_param_part(dir, (rank, m, file), p, (dtype, numel), &mut bytes)?;
        }
        let shape = p.shape.iter().map(|&d| d as usize).collect();
        tensors.push((
            p.name.clone(),
            Tensor {
                dtype,
                shape,
                bytes,
            },
        ));
    }
    write(&tensors, path)
}

/// Copies into `out` (the whole parameter in `dtype`) the elements of parameter `p` that rank
/// `rank` saved: from its values, or from its fp32 master rounded to `dtype`.
fn read_param_part(
    dir: &Path,
    (rank, m, file): (usize, &RankManifest, &mut File),
    p: &checkpoint::ParamRecord,
    (dtype, numel): (DType, usize),
    out: &mut [u8],
) -> Result<()> {
    let of = |kind| {
        m.sections
            .iter()
            .find(|s| (s.group, s.kind) == (p.group, kind))
    };
    let (section, saved_dtype) = match (of(SectionKind::Values), of(SectionKind::Master)) {
        (Some(values), _) => (values, dtype),
        (None, Some(master)) => (master, DType::F32),
        (None, None) => {
            return Err(checkpoint::unreadable(
                &checkpoint::manifest_path(dir, rank),
                format!("no values or master of group {}", p.group),
            ));
        }
    };
    let size = saved_dtype.size();
    let shard = (section.bytes / size as u64) as usize;
    let (first, last) = (rank * shard, (rank + 1) * shard);
    let start = p.offset.max(first);
    let end = (p.offset + numel).min(last);
    if start >= end {
        return Ok(());
    }
    let wanted = checkpoint::Wanted {
        offset: section.offset + ((start - first) * size) as u64,
        len: ((end - start) * size) as u64,
    };
    let target = &mut out[(start - p.offset) * dtype.size()..(end - p.offset) * dtype.size()];
    if saved_dtype == dtype {
        return checkpoint::read_range(dir, rank, file, wanted, target);
    }
    let mut wide = crate::fallible::filled(wanted.len as usize, 0u8, "a master's part")?;
    checkpoint::read_range(dir, rank, file, wanted, &mut wide)?;
    convert((target, dtype), (&wide, DType::F32));
    Ok(())
}
