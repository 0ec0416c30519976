//! Data files in checksummed chunks: the digests made while a save writes, and reads that check
//! each chunk they touch once, so a load reads every byte it needs once and no byte it does not.

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use xxhash_rust::xxh3::{Xxh3, xxh3_64};

use super::{Saved, data_path, unreadable};
use crate::error::Result;
use crate::threads::spawn_scoped;

/// The chunk a save checksums: large enough that a digest per chunk is nothing beside the bytes,
/// small enough that a load of part of a file reads little more than that part.
pub const CHUNK_BYTES: u64 = 4 << 20;

/// The largest chunk a manifest may declare: a reader holds one chunk at a time.
pub(crate) const MAX_CHUNK_BYTES: u64 = 1 << 30;

/// The xxh3-64 of each chunk of a stream of bytes, as they go by.
pub(crate) struct ChunkDigests {
    hasher: Xxh3,
    filled: u64,
    digests: Vec<String>,
    bytes: u64,
}

impl ChunkDigests {
    pub(crate) fn new() -> ChunkDigests {
        ChunkDigests {
            hasher: Xxh3::new(),
            filled: 0,
            digests: Vec::new(),
            bytes: 0,
        }
    }

    pub(crate) fn update(&mut self, mut bytes: &[u8]) {
        self.bytes += bytes.len() as u64;
        while !bytes.is_empty() {
            let room = (CHUNK_BYTES - self.filled).min(bytes.len() as u64) as usize;
            self.hasher.update(&bytes[..room]);
            self.filled += room as u64;
            bytes = &bytes[room..];
            if self.filled == CHUNK_BYTES {
                self.end_chunk();
            }
        }
    }

    fn end_chunk(&mut self) {
        self.digests.push(format!("{:016x}", self.hasher.digest()));
        self.hasher.reset();
        self.filled = 0;
    }

    /// The bytes seen, and the digests of their chunks (the last one shorter).
    pub(crate) fn finish(mut self) -> (u64, Vec<String>) {
        if self.filled > 0 {
            self.end_chunk();
        }
        (self.bytes, self.digests)
    }
}

/// One saved rank's data file, read by byte range: every chunk a read touches is checked against
/// its manifest's digest before its bytes are handed out.
pub struct DataReader<'a> {
    path: PathBuf,
    file: File,
    digests: &'a [u64],
    chunk_bytes: u64,
    data_bytes: u64,
    /// The last chunk read in part, checked: consecutive reads within one chunk read it once.
    cached: Option<(u64, Vec<u8>)>,
    bytes_read: u64,
}

impl<'a> DataReader<'a> {
    /// Opens rank `rank`'s data file of `saved`, refused when its length is not its manifest's.
    pub fn open(saved: &'a Saved, rank: usize) -> Result<DataReader<'a>> {
        let path = data_path(&saved.dir, rank);
        let (Some(m), Some(digests)) = (saved.manifests.get(rank), saved.chunks.get(rank)) else {
            return Err(unreadable(&path, format!("rank {rank} is not in the save")));
        };
        let (file, length) =
            crate::fallible::open_regular(&path).map_err(|e| unreadable(&path, e.to_string()))?;
        if length != m.data_bytes {
            return Err(unreadable(
                &path,
                format!(
                    "truncated or grown: {length} bytes, the manifest says {}",
                    m.data_bytes
                ),
            ));
        }
        Ok(DataReader {
            path,
            file,
            digests,
            chunk_bytes: m.chunk_bytes,
            data_bytes: m.data_bytes,
            cached: None,
            bytes_read: 0,
        })
    }

    /// Bytes read from the file so far.
    pub fn bytes_read(&self) -> u64 {
        self.bytes_read
    }

    /// Fills `out` with the file's bytes from `offset`, each chunk they lie in checked.
    pub fn read(&mut self, offset: u64, out: &mut [u8]) -> Result<()> {
        let end = offset
            .checked_add(out.len() as u64)
            .filter(|&end| end <= self.data_bytes)
            .ok_or_else(|| {
                unreadable(
                    &self.path,
                    format!(
                        "{} bytes at {offset} are past its {} bytes",
                        out.len(),
                        self.data_bytes
                    ),
                )
            })?;
        let mut at = offset;
        while at < end {
            let index = at / self.chunk_bytes;
            let chunk = self.chunk_range(index);
            let upto = end.min(chunk.end);
            let dst = &mut out[(at - offset) as usize..(upto - offset) as usize];
            if at == chunk.start && upto == chunk.end {
                // A whole chunk goes straight to its place.
                self.read_at(chunk.start, dst)?;
                self.check(index, dst)?;
            } else {
                let cached = self.cached_chunk(index)?;
                dst.copy_from_slice(
                    &cached[(at - chunk.start) as usize..(upto - chunk.start) as usize],
                );
            }
            at = upto;
        }
        Ok(())
    }

    fn chunk_range(&self, index: u64) -> std::ops::Range<u64> {
        let start = index * self.chunk_bytes;
        start..(start + self.chunk_bytes).min(self.data_bytes)
    }

    fn cached_chunk(&mut self, index: u64) -> Result<&[u8]> {
        if self.cached.as_ref().is_none_or(|(i, _)| *i != index) {
            let range = self.chunk_range(index);
            let mut bytes = self.cached.take().map(|(_, b)| b).unwrap_or_default();
            let len = (range.end - range.start) as usize;
            crate::fallible::refill(&mut bytes, len, "a checkpoint chunk")?;
            self.read_at(range.start, &mut bytes)?;
            self.check(index, &bytes)?;
            self.cached = Some((index, bytes));
        }
        Ok(self.cached.as_ref().map_or(&[][..], |(_, b)| b))
    }

    fn read_at(&mut self, offset: u64, out: &mut [u8]) -> Result<()> {
        self.file
            .read_exact_at(out, offset)
            .map_err(|e| unreadable(&self.path, format!("{} bytes at {offset}: {e}", out.len())))?;
        self.bytes_read += out.len() as u64;
        Ok(())
    }

    fn check(&self, index: u64, bytes: &[u8]) -> Result<()> {
        let digest = xxh3_64(bytes);
        let expected = self.digests.get(index as usize).copied();
        if expected == Some(digest) {
            return Ok(());
        }
        let range = self.chunk_range(index);
        Err(unreadable(
            &self.path,
            format!(
                "corrupted: chunk {index} (bytes {}..{}) has checksum {digest:016x}, the manifest \
                 says {}",
                range.start,
                range.end,
                expected.map_or("none".into(), |e| format!("{e:016x}"))
            ),
        ))
    }
}

/// The data file of one saved rank at a time, opened as reads reach it: reads taken rank after
/// rank open each file once, and however many ranks a save has, one file and one chunk are
/// held.
pub(crate) struct RankReader<'a> {
    saved: &'a Saved,
    open: Option<(usize, DataReader<'a>)>,
}

impl<'a> RankReader<'a> {
    pub(crate) fn new(saved: &'a Saved) -> RankReader<'a> {
        RankReader { saved, open: None }
    }

    /// As [`DataReader::read`] on rank `rank`'s file, closing the file read before if another.
    pub(crate) fn read(&mut self, rank: usize, offset: u64, out: &mut [u8]) -> Result<()> {
        let reader = match &mut self.open {
            Some((open, reader)) if *open == rank => reader,
            other => &mut other.insert((rank, DataReader::open(self.saved, rank)?)).1,
        };
        reader.read(offset, out)
    }
}

/// Bytes of a saved rank's data file to be read into `to .. to + bytes` of a destination.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FileRange {
    pub rank: usize,
    pub from: u64,
    pub to: usize,
    pub bytes: usize,
}

/// Below this many bytes a load reads on one thread.
const PARALLEL_BYTES: usize = 64 << 20;

/// Reads every range of `saved`'s data into `out`, each chunk checked as it is read, and zeroes
/// every other byte of `out`: on several
/// threads for a large load (page-cache reads go at memory speed, not a disk's, and one core
/// does not reach it), each a run of the ranges, cut at chunk boundaries so that no chunk is
/// read twice but where a range begins or ends inside one. The ranges' destinations increase
/// and do not overlap.
pub fn read_ranges(saved: &Saved, ranges: &[FileRange], out: &mut [u8]) -> Result<()> {
    let mut pieces = Vec::new();
    for c in ranges {
        let chunk = saved
            .manifests
            .get(c.rank)
            .map_or(CHUNK_BYTES, |m| m.chunk_bytes);
        let (mut from, mut to, end) = (c.from, c.to, c.to + c.bytes);
        while to < end {
            let to_boundary = (chunk - from % chunk) as usize;
            let bytes = to_boundary.min(end - to);
            pieces.push(FileRange {
                rank: c.rank,
                from,
                to,
                bytes,
            });
            (from, to) = (from + bytes as u64, to + bytes);
        }
    }
    // Each piece's own part of `out`; what no piece covers (padding) is zeroed.
    let mut places = Vec::with_capacity(pieces.len());
    let (mut rest, mut cursor) = (out, 0usize);
    for p in &pieces {
        let skip =
            p.to.checked_sub(cursor)
                .filter(|&s| s + p.bytes <= rest.len());
        let Some(skip) = skip else {
            return Err(unreadable(
                &saved.dir,
                format!("ranges out of order at byte {}", p.to),
            ));
        };
        let (gap, after) = std::mem::take(&mut rest).split_at_mut(skip);
        gap.fill(0);
        let (place, after) = after.split_at_mut(p.bytes);
        places.push(place);
        (rest, cursor) = (after, p.to + p.bytes);
    }
    rest.fill(0);

    let total: usize = pieces.iter().map(|p| p.bytes).sum();
    let threads = match total < PARALLEL_BYTES {
        true => 1,
        false => std::thread::available_parallelism().map_or(1, |n| n.get().min(8)),
    };
    // Runs of pieces of about equal bytes, one per thread.
    let mut runs: Vec<Vec<(FileRange, &mut [u8])>> = (0..threads).map(|_| Vec::new()).collect();
    let mut done = 0usize;
    for (p, place) in pieces.into_iter().zip(places) {
        let run = (done * threads / total.max(1)).min(threads - 1);
        done += p.bytes;
        runs[run].push((p, place));
    }
    let read_run = |mut run: Vec<(FileRange, &mut [u8])>| -> Result<()> {
        // Rank after rank, each file in order: one file open at a time, each chunk read once.
        run.sort_unstable_by_key(|(p, _)| (p.rank, p.from));
        let mut reader = RankReader::new(saved);
        for (p, place) in run {
            reader.read(p.rank, p.from, place)?;
        }
        Ok(())
    };
    std::thread::scope(|s| {
        let handles = runs
            .into_iter()
            .map(|run| spawn_scoped(s, "a checkpoint reader", move || read_run(run)))
            .collect::<Result<Vec<_>>>()?;
        handles
            .into_iter()
            .map(|h| {
                h.join().unwrap_or_else(|_| {
                    Err(crate::error::Error::Panicked {
                        message: "a checkpoint reader panicked".into(),
                    })
                })
            })
            .collect::<Result<Vec<()>>>()
            .map(|_| ())
    })
}
