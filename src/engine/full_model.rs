//! The full model as one safetensors file: exported from a world-size-1 engine, imported into
//! the ranks of any world size (each reading only its shard's elements).

use std::fs::File;
use std::path::Path;

use safetensors::SafeTensors;

use super::Engine;
use crate::backend::{Backend, Input, Region};
use crate::comm::{Communicator, Fingerprint, Purpose};
use crate::error::{Error, Result};
use crate::export::{Tensor, check_new, file_error, safetensors_dtype, write};
use crate::types::{DType, ParamId, Stream};

impl<B: Backend, C: Communicator<B>> Engine<B, C> {
    /// Writes every parameter, frozen ones included, under the model's names, shapes and dtypes
    /// (a master-only group's values are its masters rounded to the dtype, as a gather casts
    /// them), into the safetensors file `path`: under a temporary name, flushed and renamed, so
    /// that a file at `path` is always whole; an existing file is refused
    /// (`Error::CheckpointExists`). At world size 1, between steps (`Error::MidStep`); at a
    /// larger world size every rank saves ([`Engine::save`]) and one engine of world size 1
    /// loads the checkpoint and exports, or [`crate::export::export_checkpoint`] converts the
    /// checkpoint (`Error::Unsupported` here). Holds the model's bytes in host memory while it
    /// writes.
    pub fn export_safetensors(&self, path: &Path) -> Result<()> {
        self.healthy()?;
        self.check_step_boundary("exporting the model")?;
        if self.plan.world_size() != 1 {
            return Err(Error::Unsupported {
                backend: self.backend.name(),
                what: "an export above world size 1 (save, then export_checkpoint)",
            });
        }
        check_new(path)?;
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
                        dtype: p.dtype,
                        shape,
                        bytes: copy,
                    },
                ));
            }
        }
        write(&tensors, path)
    }

    /// Group `group`'s whole padded buffer, as bytes in its dtype, gathered from every rank's
    /// shard (of a group of a process group, from the shards of this rank's copy; of a
    /// master-only group, its masters rounded to the dtype): a collective, every rank calls it
    /// for the same groups in the same order. Between steps. Borrows a device buffer of the
    /// group's size for the call (outside the plan's count). Blocks until the bytes are here.
    pub fn gather_group(&mut self, group: usize) -> Result<Vec<u8>> {
        self.healthy()?;
        self.check_step_boundary("gathering a group")?;
        let g = self.plan.group(group)?.clone();
        if self.plan.world_size() == 1 {
            return self.param_shard(group);
        }
        let own = Region::new(
            self.plan.place(&g, self.rank) * g.shard_numel,
            g.shard_numel,
            g.dtype,
        );
        let whole = Region::new(0, g.padded_numel, g.dtype);
        let master_only = self.plan.master_only(&self.config, &g);
        self.effects(|e| {
            let mut buffer = e.backend.alloc_scratch(g.padded_numel * g.dtype.size())?;
            let (source, region) = match (master_only, e.masters[group].as_ref()) {
                (true, Some(master)) => (master, Region::new(0, g.shard_numel, DType::F32)),
                _ => (&e.shards[group], Region::new(0, g.shard_numel, g.dtype)),
            };
            // SAFETY: the scratch buffer is this call's; the shard (or master) is read on the
            // compute stream, after the last optimizer step there and before the next one.
            unsafe {
                e.backend
                    .cast(Stream::Compute, source, region, &mut buffer, own)
            }?;
            let tag = e.next_tag(Purpose::Group(group), |tag| {
                Fingerprint::all_gather(tag, Region::new(0, g.shard_numel, g.dtype))
            });
            let comm = super::group_comm(&mut e.comm, &mut e.process_groups, g.process_group)?;
            // SAFETY: as above; the download below orders itself after the gather.
            unsafe {
                comm.all_gather_in_place(&e.backend, Stream::Compute, tag, &mut buffer, whole)
            }?;
            let mut out =
                crate::fallible::filled(g.padded_numel * g.dtype.size(), 0u8, "a gathered group")?;
            e.backend.download(&buffer, whole, &mut out)?;
            Ok(out)
        })
    }

    /// Loads every parameter's values from the safetensors file `path` (as
    /// [`Engine::export_safetensors`] writes, or a pretrained model's), at any world size: the
    /// file is memory-mapped and this rank reads only its shard's elements. The file must hold
    /// exactly the model's parameters, by name, shape and dtype; otherwise
    /// `Error::CheckpointMismatch` lists every difference and nothing is loaded. A parameter of
    /// a process group takes the file's values in every copy. Between steps only. The
    /// optimizer's state is left as it is (a fresh engine's: zero moments, step 0).
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
