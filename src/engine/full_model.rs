//! The full model as one safetensors file: exported from a world-size-1 engine, imported into
//! the ranks of any world size (each reading only its shard's elements).

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::Path;

use safetensors::tensor::Metadata;
use xxhash_rust::xxh3::Xxh3;

use super::Engine;
use super::agree::{Proposal, check_one_source};
use crate::backend::{Backend, Region};
use crate::comm::{Communicator, Fingerprint, Purpose};
use crate::error::{Error, Result};
use crate::export::{TensorHeader, file_error, safetensors_dtype, write};
use crate::types::{DType, ParamId, Stream};

/// The largest safetensors header read (the format's own limit).
const MAX_HEADER_BYTES: u64 = 100_000_000;

impl<B: Backend, C: Communicator<B>> Engine<B, C> {
    /// Writes every parameter, frozen ones included, under the model's names, shapes and dtypes
    /// (a master-only group's values are its masters rounded to the dtype, as a gather casts
    /// them), into the safetensors file `path`: under a unique temporary name, flushed and
    /// linked into place, so that a file at `path` is always whole; an empty path
    /// (`Error::EmptyPath`) and an existing file (`Error::CheckpointExists`) are refused. At
    /// world size 1, between steps (`Error::MidStep`); at a larger world size every rank saves
    /// ([`Engine::save`]) and [`crate::export::export_checkpoint`] converts the checkpoint
    /// (`Error::Unsupported` here). Holds one group's values in host memory at a time.
    pub fn export_safetensors(&self, path: &Path) -> Result<()> {
        self.healthy()?;
        self.check_step_boundary("exporting the model")?;
        if self.plan.world_size() != 1 {
            return Err(Error::Unsupported {
                backend: self.backend.name(),
                what: "an export above world size 1 (save, then export_checkpoint)",
            });
        }
        // Group by group, so that each group's values are read once.
        let order: Vec<ParamId> = (self.plan.groups().iter())
            .flat_map(|g| g.params.iter().copied())
            .collect();
        let tensors: Vec<TensorHeader> = order
            .iter()
            .map(|id| {
                let p = &self.plan.params()[id.0];
                TensorHeader {
                    name: p.name.clone(),
                    dtype: p.dtype,
                    shape: p.shape.iter().map(|&d| d as usize).collect(),
                }
            })
            .collect();
        let mut values: Option<(usize, Vec<u8>)> = None;
        write(&tensors, path, |i, out| {
            let p = &self.plan.params()[order[i].0];
            if values.as_ref().is_none_or(|(g, _)| *g != p.group) {
                values = Some((p.group, self.param_shard(p.group)?));
            }
            let bytes = values.as_ref().map_or(&[][..], |(_, v)| v);
            let size = p.dtype.size();
            out.copy_from_slice(&bytes[p.offset * size..(p.offset + p.numel) * size]);
            Ok(())
        })
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
            self.plan.shard_index(&g, self.rank)? * g.shard_numel,
            g.shard_numel,
            g.dtype,
        );
        let whole = Region::new(0, g.padded_numel, g.dtype);
        let master_only = self.policy.master_only(g.index);
        self.effects(|e| {
            let mut buffer = e.backend.alloc_scratch(g.padded_numel * g.dtype.size())?;
            let (source, region) = match (master_only, e.optimizer.groups[group].master.as_ref()) {
                (true, Some(master)) => (master, Region::new(0, g.shard_numel, DType::F32)),
                _ => (
                    &e.param_shards[group],
                    Region::new(0, g.shard_numel, g.dtype),
                ),
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
            let collective = Fingerprint::all_gather(tag, Region::new(0, g.shard_numel, g.dtype));
            let peers = e.peers(g.process_group);
            e.record_collective(Stream::Compute, Some((collective, peers)))?;
            let mut out =
                crate::fallible::filled(g.padded_numel * g.dtype.size(), 0u8, "a gathered group")?;
            e.backend.download(&buffer, whole, &mut out)?;
            Ok(out)
        })
    }

    /// Loads every parameter's values from the safetensors file `path` (as
    /// [`Engine::export_safetensors`] writes, or a pretrained model's), at any world size: each
    /// rank reads only its shard's elements, with plain reads (no memory map: a file changed
    /// under the call gives an error or the bytes it held when read, never a fault). The file
    /// must hold exactly the model's parameters, by name, shape and dtype; otherwise
    /// `Error::CheckpointMismatch` lists every difference. A collective: every rank calls it,
    /// and nothing changes on any rank unless every rank read its part and has the host memory
    /// to widen it for the fp32 masters (a rank that failed returns its error, the others
    /// `Error::PeerRefused` naming it); a rank whose upload fails after the ranks agreed (its
    /// device) is poisoned, its parameters half loaded. Ranks whose files differ
    /// (node-local copies of two models, say) in their length, header or the first 4 KiB of a
    /// tensor are refused alike, nothing changed (`Error::CheckpointMismatch` naming the
    /// differing ranks' digests of those bytes); files that differ only past those bytes are
    /// not told apart. A parameter of a process
    /// group takes the file's values in every copy. Between steps only. The optimizer's state
    /// is left as it is (a fresh engine's: zero moments, step 0). Holds this rank's shard of
    /// the values in host memory while it reads.
    pub fn import_safetensors(&mut self, path: &Path) -> Result<()> {
        self.healthy()?;
        self.check_step_boundary("importing a model")?;
        // The room to widen the largest parameter for its master is made before the ranks
        // agree, so that too little memory for it is refused with nothing changed on any rank.
        let read = self.read_import(path).and_then(|(held, identity)| {
            let most = (0..held.len()).try_fold(0, |most, i| {
                Ok::<_, Error>(most.max(self.held_master_bytes(ParamId(i))?))
            })?;
            let wide = crate::fallible::with_capacity(most, "a master")?;
            Ok(((held, wide), identity))
        });
        let ((held, mut wide), identities) = self.agree(path, read)?;
        check_one_source(&identities, "files")?;
        for (i, values) in held.into_iter().enumerate() {
            self.store_held(ParamId(i), &values, &mut wide)?;
        }
        Ok(())
    }

    /// The elements of every parameter that this rank holds, read from the safetensors file
    /// `path` once its header is checked against the plan, and what identifies the file to the
    /// other ranks.
    fn read_import(&self, path: &Path) -> Result<(Vec<Vec<u8>>, Proposal)> {
        crate::checkpoint::check_path(path, "the imported file")?;
        let (file, length) =
            crate::fallible::open_regular(path).map_err(|e| file_error(path, e))?;
        let mut prefix = [0u8; 8];
        file.read_exact_at(&mut prefix, 0)
            .map_err(|e| file_error(path, format!("not safetensors: {e}")))?;
        let header_bytes = u64::from_le_bytes(prefix);
        if header_bytes > MAX_HEADER_BYTES || 8 + header_bytes > length {
            return Err(file_error(
                path,
                format!("not safetensors: a header of {header_bytes} bytes in {length}"),
            ));
        }
        let mut header = crate::fallible::filled(header_bytes as usize, 0u8, "a header")?;
        file.read_exact_at(&mut header, 8)
            .map_err(|e| file_error(path, e))?;
        let metadata: Metadata = serde_json::from_slice(&header)
            .map_err(|e| file_error(path, format!("not safetensors: {e}")))?;
        let data_start = 8 + header_bytes;
        let data_end = u64::try_from(metadata.data_len())
            .ok()
            .and_then(|data| data_start.checked_add(data));
        if data_end != Some(length) {
            let says = data_end.map_or_else(|| "over 2^64".into(), |end| end.to_string());
            return Err(file_error(
                path,
                format!("truncated or grown: {length} bytes, the header says {says}"),
            ));
        }
        let mut differences = Vec::new();
        let mut offsets = Vec::with_capacity(self.plan.params().len());
        for p in self.plan.params() {
            match metadata.info(&p.name) {
                None => differences.push(format!("{:?} is not in the file", p.name)),
                Some(t) => {
                    let shape: Vec<u64> = t.shape.iter().map(|&d| d as u64).collect();
                    if shape != p.shape {
                        differences.push(format!(
                            "{:?} has shape {shape:?} in the file, {:?} in the model",
                            p.name, p.shape
                        ));
                    } else if t.dtype != safetensors_dtype(p.dtype) {
                        differences.push(format!(
                            "{:?} is {:?} in the file, {} in the model",
                            p.name, t.dtype, p.dtype
                        ));
                    } else {
                        let (start, end) = t.data_offsets;
                        let bytes = end.saturating_sub(start) as u64;
                        offsets.push((data_start + start as u64, bytes));
                    }
                }
            }
        }
        let mut extra: Vec<String> = metadata
            .tensors()
            .into_keys()
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
        let identity = import_identity(path, &file, (length, &header), &offsets)?;
        let mut held = crate::fallible::with_capacity(offsets.len(), "the imported values")?;
        for (i, (start, _)) in offsets.into_iter().enumerate() {
            let elements = self.held_elements(ParamId(i))?;
            let size = self.plan.params()[i].dtype.size();
            let mut values =
                crate::fallible::filled(elements.len() * size, 0u8, "a parameter's values")?;
            // Within the file: the header's tensors tile its data, whose length was checked.
            file.read_exact_at(&mut values, start + (elements.start * size) as u64)
                .map_err(|e| file_error(path, e))?;
            held.push(values);
        }
        Ok((held, identity))
    }
}

/// Bytes at the start of each tensor that, with its length and header, identify an imported
/// file to the ranks: two files of one architecture with other weights differ there.
const IMPORT_IDENTITY_BYTES: u64 = 4096;

/// The digest of the file `path` (open as `file`) of `length` bytes with `header`: its length,
/// its header and the first [`IMPORT_IDENTITY_BYTES`] of each of `tensors` (where it starts,
/// its bytes).
fn import_identity(
    path: &Path,
    file: &File,
    (length, header): (u64, &[u8]),
    tensors: &[(u64, u64)],
) -> Result<Proposal> {
    let mut hasher = Xxh3::new();
    hasher.update(&length.to_le_bytes());
    hasher.update(header);
    let mut start =
        crate::fallible::filled(IMPORT_IDENTITY_BYTES as usize, 0u8, "a tensor's start")?;
    for &(at, bytes) in tensors {
        let read = &mut start[..bytes.min(IMPORT_IDENTITY_BYTES) as usize];
        // Within the file: the header's tensors tile its data, whose length was checked.
        file.read_exact_at(read, at)
            .map_err(|e| file_error(path, e))?;
        hasher.update(read);
    }
    Ok(hasher.digest128().to_le_bytes())
}
