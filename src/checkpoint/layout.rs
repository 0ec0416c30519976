//! A checkpoint's manifests checked field by field before a byte of its data is trusted, and the
//! saved layout they describe: where each element of each parameter lies. Pure: the manifests
//! come in already read.
//!
//! Every rank of a save holds the same sections (one shard of every group each), so the list
//! of sections, their sizes and offsets follow from rank 0's parameters, optimizer and world
//! size alone; each manifest must list exactly those, with the same save id and settings.

use std::collections::HashSet;
use std::ops::Range;
use std::path::{Path, PathBuf};

use super::data::MAX_CHUNK_BYTES;
use super::{RankManifest, Section, SectionKind, manifest_path, unreadable};
use crate::error::Result;
use crate::types::DType;

/// A save's identity, which its ranks agree on before any of them writes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SaveId(pub [u8; 16]);

impl SaveId {
    /// A fresh id: unique across processes and saves, not predictable from the time alone.
    pub fn fresh() -> SaveId {
        use std::hash::{BuildHasher, Hasher};
        use std::sync::atomic::{AtomicU64, Ordering};
        static SAVES: AtomicU64 = AtomicU64::new(0);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let count = SAVES.fetch_add(1, Ordering::Relaxed);
        let mut out = [0u8; 16];
        for (half, salt) in out.chunks_exact_mut(8).zip([0u64, 1]) {
            // Each RandomState is seeded from the operating system's randomness.
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u128(nanos);
            h.write_u32(std::process::id());
            h.write_u64(count);
            h.write_u64(salt);
            half.copy_from_slice(&h.finish().to_le_bytes());
        }
        SaveId(out)
    }

    /// As a manifest records it: 32 hex digits.
    pub fn to_hex(&self) -> String {
        self.0.iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The id a manifest records as [`SaveId::to_hex`] wrote it; `None` for other text.
    pub fn from_hex(text: &str) -> Option<SaveId> {
        if text.len() != 32 || !text.bytes().all(|b| b.is_ascii_hexdigit()) {
            return None;
        }
        let mut out = [0u8; 16];
        for (byte, digits) in out.iter_mut().zip(text.as_bytes().chunks_exact(2)) {
            let digits = std::str::from_utf8(digits).ok()?;
            *byte = u8::from_str_radix(digits, 16).ok()?;
        }
        Some(SaveId(out))
    }
}

/// A group as the save laid it out.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SavedGroup {
    pub dtype: DType,
    pub trainable: bool,
    /// The process group that sharded it; `None` for the data-parallel world.
    pub process_group: Option<String>,
    /// The ranks that held one copy of it.
    pub shards: usize,
    pub padded_numel: usize,
    pub shard_numel: usize,
}

/// Part of a parameter in one saved rank's data file: its `elements` (of the parameter) start
/// at byte `offset` of rank `rank`'s file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Run {
    pub rank: usize,
    pub offset: u64,
    pub elements: Range<usize>,
}

/// A checkpoint's manifests, each checked, all of one save, and the layout they describe.
#[derive(Debug)]
pub struct Saved {
    pub dir: PathBuf,
    /// Rank `r`'s manifest at `r`.
    pub manifests: Vec<RankManifest>,
    pub groups: Vec<SavedGroup>,
    /// The elements of each parameter of the manifests' `params`.
    pub numels: Vec<usize>,
    /// The sections of every rank's data file, in file order.
    pub sections: Vec<Section>,
    pub moment_dtype: DType,
    /// Per rank, the xxh3-64 of each chunk of its data file.
    pub chunks: Vec<Vec<u64>>,
    /// Per group, the index in `sections` of each kind (in [`SectionKind`]'s order).
    section_index: Vec<[Option<usize>; 4]>,
}

/// A field of a manifest that is wrong, and why.
type Refusal = (String, String);

fn refuse<T>(field: impl Into<String>, reason: impl Into<String>) -> Result<T, Refusal> {
    Err((field.into(), reason.into()))
}

fn kind_index(kind: SectionKind) -> usize {
    match kind {
        SectionKind::Values => 0,
        SectionKind::Master => 1,
        SectionKind::FirstMoment => 2,
        SectionKind::SecondMoment => 3,
    }
}

impl Saved {
    /// Checks `manifests` (rank `r`'s at `r`, read from `dir`) and the layout they describe;
    /// `Error::CheckpointUnreadable` names the manifest file and the field that is wrong.
    pub fn check(dir: &Path, manifests: Vec<RankManifest>) -> Result<Saved> {
        let at = |rank: usize| {
            move |(field, reason): Refusal| {
                unreadable(
                    &manifest_path(dir, rank),
                    format!("field `{field}`: {reason}"),
                )
            }
        };
        let Some(first) = manifests.first() else {
            return Err(unreadable(&manifest_path(dir, 0), "no manifest"));
        };
        let (groups, numels) = layout(first).map_err(at(0))?;
        let moment_dtype = match DType::parse(&first.moment_dtype) {
            Some(d @ (DType::F32 | DType::Bf16)) => d,
            _ => return Err(at(0)(("moment_dtype".into(), "not f32 or bf16".into()))),
        };
        let sections =
            sections(&groups, first.optimizer == "adamw", moment_dtype).map_err(at(0))?;
        let data_bytes = sections.last().map_or(0, |s| s.offset + s.bytes);
        if manifests.len() != first.world_size {
            return Err(at(0)((
                "world_size".into(),
                format!("{} ranks, {} manifests", first.world_size, manifests.len()),
            )));
        }
        let mut chunks = Vec::new();
        for (rank, m) in manifests.iter().enumerate() {
            same_save(first, m, rank).map_err(at(rank))?;
            if let Some(i) = (0..sections.len().max(m.sections.len()))
                .find(|&i| m.sections.get(i) != sections.get(i))
            {
                return Err(at(rank)((
                    format!("sections[{i}]"),
                    format!(
                        "{:?}, where the layout puts {:?}",
                        m.sections.get(i),
                        sections.get(i)
                    ),
                )));
            }
            if m.data_bytes != data_bytes {
                return Err(at(rank)((
                    "data_bytes".into(),
                    format!("{}, where the sections end at {data_bytes}", m.data_bytes),
                )));
            }
            chunks.push(chunk_digests(m).map_err(at(rank))?);
        }
        let mut section_index = vec![[None; 4]; groups.len()];
        for (i, s) in sections.iter().enumerate() {
            section_index[s.group][kind_index(s.kind)] = Some(i);
        }
        Ok(Saved {
            dir: dir.to_path_buf(),
            manifests,
            groups,
            numels,
            sections,
            moment_dtype,
            chunks,
            section_index,
        })
    }

    /// The world size of the save.
    pub fn world_size(&self) -> usize {
        self.manifests.len()
    }

    /// Group `group`'s section of `kind`, if the save holds one.
    pub fn section(&self, group: usize, kind: SectionKind) -> Option<&Section> {
        let index = self.section_index.get(group)?[kind_index(kind)]?;
        self.sections.get(index)
    }

    /// The dtype of a `kind` section of `group`.
    pub fn dtype_of(&self, group: &SavedGroup, kind: SectionKind) -> DType {
        match kind {
            SectionKind::Values => group.dtype,
            SectionKind::Master => DType::F32,
            SectionKind::FirstMoment | SectionKind::SecondMoment => self.moment_dtype,
        }
    }

    /// Where `elements` of parameter `param` (its index in the manifests' `params`) lie in
    /// the `kind` sections of the saved ranks `first_rank ..` that held one copy of its group,
    /// in element order.
    pub fn runs(
        &self,
        param: usize,
        kind: SectionKind,
        first_rank: usize,
        elements: Range<usize>,
    ) -> Result<Vec<Run>> {
        let path = manifest_path(&self.dir, 0);
        let (Some(record), Some(&numel)) =
            (self.manifests[0].params.get(param), self.numels.get(param))
        else {
            return Err(unreadable(&path, format!("no parameter #{param}")));
        };
        let group = &self.groups[record.group];
        let section = self.section(record.group, kind).ok_or_else(|| {
            unreadable(
                &path,
                format!("no {kind:?} section of group {}", record.group),
            )
        })?;
        if elements.end > numel || first_rank + group.shards > self.world_size() {
            return Err(unreadable(
                &path,
                format!(
                    "elements {elements:?} of {:?} on saved ranks {first_rank}.. are not in the save",
                    record.name
                ),
            ));
        }
        let size = self.dtype_of(group, kind).size();
        let mut runs = Vec::new();
        let mut e = elements.start;
        // In range: the layout's checks bound offset + numel by the group's padded length,
        // which is `shards * shard_numel` and fits its bytes in a `u64`.
        while e < elements.end {
            let position = record.offset + e;
            let (place, within) = (position / group.shard_numel, position % group.shard_numel);
            let len = (elements.end - e).min(group.shard_numel - within);
            runs.push(Run {
                rank: first_rank + place,
                offset: section.offset + (within * size) as u64,
                elements: e..e + len,
            });
            e += len;
        }
        Ok(runs)
    }
}

/// The groups and each parameter's elements that rank 0's manifest describes, checked: every
/// size in range, every group's parameters laid one after another from 0, every group split
/// evenly over the ranks that hold it.
fn layout(m: &RankManifest) -> Result<(Vec<SavedGroup>, Vec<usize>), Refusal> {
    if m.world_size == 0 {
        return refuse("world_size", "0");
    }
    if m.optimizer != "adamw" && m.optimizer != "sgd" {
        return refuse(
            "optimizer",
            format!("{:?} is not adamw or sgd", m.optimizer),
        );
    }
    if !m.lr.is_finite() {
        return refuse("lr", format!("{} is not finite", m.lr));
    }
    if !m.weight_decay.is_finite() {
        return refuse("weight_decay", format!("{} is not finite", m.weight_decay));
    }
    let mut names = HashSet::new();
    for (i, g) in m.process_groups.iter().enumerate() {
        if g.size == 0 || m.world_size % g.size != 0 || !names.insert(g.name.as_str()) {
            return refuse(
                format!("process_groups[{i}]"),
                format!(
                    "{:?} of size {} in a world of {} (sizes divide it, names are unique)",
                    g.name, g.size, m.world_size
                ),
            );
        }
    }
    if m.params.is_empty() {
        return refuse("params", "empty");
    }
    let mut seen = HashSet::new();
    let mut groups: Vec<Option<SavedGroup>> = Vec::new();
    let mut numels = Vec::with_capacity(m.params.len());
    for (i, p) in m.params.iter().enumerate() {
        let field = |name: &str| format!("params[{i}].{name}");
        if !seen.insert(p.name.as_str()) {
            return refuse(field("name"), format!("{:?} appears twice", p.name));
        }
        let Some(dtype) = DType::parse(&p.dtype) else {
            return refuse(
                field("dtype"),
                format!("{:?} is not bf16, f16 or f32", p.dtype),
            );
        };
        let numel = p
            .shape
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(usize::try_from(d).ok()?));
        let Some(numel) = numel else {
            return refuse(
                field("shape"),
                format!("{:?} has too many elements", p.shape),
            );
        };
        if p.padded_numel < numel {
            return refuse(
                field("padded_numel"),
                format!(
                    "{} is less than the shape's {numel} elements",
                    p.padded_numel
                ),
            );
        }
        let shards = match &p.process_group {
            None => m.world_size,
            Some(name) => match m.process_groups.iter().find(|g| &g.name == name) {
                Some(g) => g.size,
                None => return refuse(field("process_group"), format!("{name:?} is not declared")),
            },
        };
        if p.group >= m.params.len() {
            return refuse(
                field("group"),
                format!("{} with {} parameters", p.group, m.params.len()),
            );
        }
        if groups.len() <= p.group {
            groups.resize(p.group + 1, None);
        }
        let group = groups[p.group].get_or_insert(SavedGroup {
            dtype,
            trainable: p.trainable,
            process_group: p.process_group.clone(),
            shards,
            padded_numel: 0,
            shard_numel: 0,
        });
        if (group.dtype, group.trainable, &group.process_group)
            != (dtype, p.trainable, &p.process_group)
        {
            return refuse(
                field("group"),
                format!(
                    "{} holds parameters of another dtype, training or process group",
                    p.group
                ),
            );
        }
        if p.offset != group.padded_numel {
            return refuse(
                field("offset"),
                format!(
                    "{}, where the group's parameters before it end at {}",
                    p.offset, group.padded_numel
                ),
            );
        }
        let end = group.padded_numel.checked_add(p.padded_numel);
        match end.filter(|&e| {
            e.checked_mul(dtype.size())
                .is_some_and(|b| u64::try_from(b).is_ok())
        }) {
            Some(end) => group.padded_numel = end,
            None => return refuse(field("padded_numel"), "the group's bytes overflow"),
        }
        numels.push(numel);
    }
    let mut out = Vec::with_capacity(groups.len());
    for (index, group) in groups.into_iter().enumerate() {
        let Some(mut group) = group else {
            return refuse("params", format!("no parameter is in group {index}"));
        };
        if group.padded_numel % group.shards != 0 {
            return refuse(
                "params",
                format!(
                    "group {index}'s {} elements do not split over its {} ranks",
                    group.padded_numel, group.shards
                ),
            );
        }
        group.shard_numel = group.padded_numel / group.shards;
        out.push(group);
    }
    Ok((out, numels))
}

/// The sections of each rank's data file for `groups`, as a save writes them: per group in
/// order, its values (its fp32 master for a trainable bf16/f16 group), then AdamW's moments
/// where `moments`.
fn sections(
    groups: &[SavedGroup],
    moments: bool,
    moment_dtype: DType,
) -> Result<Vec<Section>, Refusal> {
    let mut out = Vec::new();
    let mut offset = 0u64;
    for (index, g) in groups.iter().enumerate() {
        let values = match g.trainable && g.dtype != DType::F32 {
            true => (SectionKind::Master, DType::F32),
            false => (SectionKind::Values, g.dtype),
        };
        let mut kinds = vec![values];
        if g.trainable && moments {
            kinds.push((SectionKind::FirstMoment, moment_dtype));
            kinds.push((SectionKind::SecondMoment, moment_dtype));
        }
        for (kind, dtype) in kinds {
            let bytes = (g.shard_numel as u64).checked_mul(dtype.size() as u64);
            let Some((bytes, end)) = bytes.and_then(|b| Some((b, offset.checked_add(b)?))) else {
                return refuse("sections", format!("group {index}'s bytes overflow"));
            };
            out.push(Section {
                group: index,
                kind,
                offset,
                bytes,
            });
            offset = end;
        }
    }
    Ok(out)
}

/// Refuses a manifest of rank `rank` that is not of `first`'s save.
fn same_save(first: &RankManifest, m: &RankManifest, rank: usize) -> Result<(), Refusal> {
    if m.rank != rank {
        return refuse("rank", format!("{}, in rank {rank}'s file", m.rank));
    }
    if m.save_id.len() != 32 || !m.save_id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return refuse("save_id", format!("{:?} is not 32 hex digits", m.save_id));
    }
    if m.save_id != first.save_id {
        return refuse(
            "save_id",
            format!(
                "{}: a file of another save (rank 0's is {})",
                m.save_id, first.save_id
            ),
        );
    }
    let differs = [
        ("world_size", m.world_size != first.world_size),
        (
            "optimizer_steps",
            m.optimizer_steps != first.optimizer_steps,
        ),
        ("lr", m.lr.to_bits() != first.lr.to_bits()),
        (
            "weight_decay",
            m.weight_decay.to_bits() != first.weight_decay.to_bits(),
        ),
        ("optimizer", m.optimizer != first.optimizer),
        ("moment_dtype", m.moment_dtype != first.moment_dtype),
        ("params", m.params != first.params),
        ("process_groups", m.process_groups != first.process_groups),
    ];
    match differs.iter().find(|(_, differs)| *differs) {
        Some((field, _)) => refuse(*field, "differs from rank 0's, of the same save"),
        None => Ok(()),
    }
}

/// The chunk digests of `m`'s data file, checked to cover its bytes.
fn chunk_digests(m: &RankManifest) -> Result<Vec<u64>, Refusal> {
    if m.chunk_bytes == 0 || m.chunk_bytes > MAX_CHUNK_BYTES {
        return refuse(
            "chunk_bytes",
            format!("{} is not in 1..={MAX_CHUNK_BYTES}", m.chunk_bytes),
        );
    }
    let count = m.data_bytes.div_ceil(m.chunk_bytes);
    if m.chunk_xxh3.len() as u64 != count {
        return refuse(
            "chunk_xxh3",
            format!("{} digests for {count} chunks", m.chunk_xxh3.len()),
        );
    }
    m.chunk_xxh3
        .iter()
        .enumerate()
        .map(|(i, d)| match u64::from_str_radix(d, 16) {
            Ok(v) if d.len() == 16 => Ok(v),
            _ => refuse(
                format!("chunk_xxh3[{i}]"),
                format!("{d:?} is not 16 hex digits"),
            ),
        })
        .collect()
}
