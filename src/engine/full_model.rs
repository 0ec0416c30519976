//! The full model as one safetensors file: exported from a world-size-1 engine, imported into
//! the ranks of any world size (each reading only its shard's elements).

use std::borrow::Cow;
use std::fs::File;
use std::path::Path;

use safetensors::{Dtype, SafeTensors, View};

use super::Engine;
use crate::backend::{Backend, Input};
use crate::checkpoint;
use crate::comm::Communicator;
use crate::error::{Error, Result};
use crate::types::{DType, ParamId};

/// One parameter's bytes, as the file holds them.
struct Tensor {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

impl View for &Tensor {
    fn dtype(&self) -> Dtype {
        self.dtype
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

fn safetensors_dtype(dtype: DType) -> Dtype {
    match dtype {
        DType::Bf16 => Dtype::BF16,
        DType::F16 => Dtype::F16,
        DType::F32 => Dtype::F32,
    }
}

fn file_error(path: &Path, reason: impl std::fmt::Display) -> Error {
    checkpoint::unreadable(path, reason.to_string())
}

impl<B: Backend, C: Communicator<B>> Engine<B, C> {
    /// Writes every parameter, frozen ones included, under the model's names, shapes and dtypes
    /// (a master-only group's values are its masters rounded to the dtype, as a gather casts
    /// them), into the safetensors file `path`: under a temporary name, flushed and renamed, so
    /// that a file at `path` is always whole; an existing file is refused
    /// (`Error::CheckpointExists`). At world size 1, between steps (`Error::MidStep`); at a
    /// larger world size every rank saves ([`Engine::save`]) and one engine of world size 1
    /// loads the checkpoint and exports (`Error::Unsupported` here). Holds the model's bytes in
    /// host memory while it writes.
    pub fn export_safetensors(&self, path: &Path) -> Result<()> {
        self.healthy()?;
        self.check_step_boundary("exporting the model")?;
        if self.plan.world_size() != 1 {
            return Err(Error::Unsupported {
                backend: self.backend.name(),
                what: "an export above world size 1 (save, load into an engine of world size 1, \
                       export from it)",
            });
        }
        if path.exists() {
            return Err(Error::CheckpointExists {
                path: path.display().to_string(),
            });
        }
        let mut tensors = crate::fallible::with_capacity(self.plan.params().len(), "the export")?;
        for group in self.plan.groups() {
            let values = self.param_shard(group.index)?;
            let size = group.dtype.size();
            for &id in &group.params {
                let p = &self.plan.params()[id.0];
                let bytes = &values[p.offset * size..(p.offset + p.numel) * size];
                let mut copy = crate::fallible::with_capacity(bytes.len(), "a parameter's bytes")?;
                copy.extend_from_slice(bytes);
                let shape = p.shape.iter().map(|&d| d as usize).collect();
                tensors.push((
                    p.name.clone(),
                    Tensor {
                        dtype: safetensors_dtype(p.dtype),
                        shape,
                        bytes: copy,
                    },
                ));
            }
        }
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

    /// Loads every parameter's values from the safetensors file `path` (as
    /// [`Engine::export_safetensors`] writes, or a pretrained model's), at any world size: the
    /// file is memory-mapped and this rank reads only its shard's elements. The file must hold
    /// exactly the model's parameters, by name, shape and dtype; otherwise
    /// `Error::CheckpointMismatch` lists every difference and nothing is loaded. Between steps
    /// only. The optimizer's state is left as it is (a fresh engine's: zero moments, step 0).
    pub fn import_safetensors(&mut self, path: &Path) -> Result<()> {
        self.healthy()?;
        self.check_step_boundary("importing a model")?;
        let file = File::open(path).map_err(|e| file_error(path, e))?;
        // SAFETY: the map is read only while this call runs; a file changed under it by another
        // process gives wrong values, never memory outside the map.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| file_error(path, e))?;
        let file = SafeTensors::deserialize(&map).map_err(|e| file_error(path, e))?;
        let mut differences = Vec::new();
        let mut found = Vec::with_capacity(self.plan.params().len());
        for p in self.plan.params() {
            match file.tensor(&p.name) {
                Err(_) => differences.push(format!("{:?} is not in the file", p.name)),
                Ok(t) => {
                    let shape: Vec<u64> = t.shape().iter().map(|&d| d as u64).collect();
                    if shape != p.shape {
                        differences.push(format!(
                            "{:?} has shape {shape:?} in the file, {:?} in the model",
                            p.name, p.shape
                        ));
                    } else if t.dtype() != safetensors_dtype(p.dtype) {
                        differences.push(format!(
                            "{:?} is {:?} in the file, {} in the model",
                            p.name,
                            t.dtype(),
                            p.dtype
                        ));
                    } else {
                        found.push(t);
                    }
                }
            }
        }
        let mut extra: Vec<&str> = file
            .names()
            .into_iter()
            .filter(|name| self.plan.param_id(name).is_err())
            .collect();
        extra.sort_unstable();
        differences.extend(
            extra
                .into_iter()
                .map(|name| format!("{name:?} is in the file, not in the model")),
        );
        if !differences.is_empty() {
            return Err(Error::CheckpointMismatch { differences });
        }
        for (i, t) in found.into_iter().enumerate() {
            let dtype = self.plan.params()[i].dtype;
            self.load_param(ParamId(i), Input::host_bytes(t.data(), dtype))?;
        }
        Ok(())
    }
}
