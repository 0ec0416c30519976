//! A checkpoint's directory and whole files: each file written under a unique temporary name
//! (created new, so no existing file or symlink is ever written through), flushed, linked into
//! place without replacing anything, and its directory flushed; manifests read back and checked.

use std::fs::{self, File, OpenOptions};
use std::io::{ErrorKind, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use super::{
    ChunkDigests, RankManifest, Saved, data_path, is_rank_file, manifest_path, unreadable,
};
use crate::error::{Error, Result};

fn write_error(path: &Path) -> impl Fn(std::io::Error) -> Error + '_ {
    move |source| Error::Write {
        path: path.display().to_string(),
        source: Arc::new(source),
    }
}

/// Refuses an empty `path` (for `what`) before anything is read or written: it would mean the
/// working directory.
pub fn check_path(path: &Path, what: &str) -> Result<()> {
    if path.as_os_str().is_empty() {
        return Err(Error::EmptyPath { what: what.into() });
    }
    Ok(())
}

/// The directory `path` lies in (the working one for a bare name).
fn parent(path: &Path) -> &Path {
    match path.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => Path::new("."),
    }
}

/// Flushes the directory entry of `path` (the entries of the directory it lies in) to disk.
pub fn sync_parent(path: &Path) -> Result<()> {
    let dir = parent(path);
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(write_error(dir))
}

/// Refuses (`Error::CheckpointExists`) a directory that holds a rank file of any checkpoint, of
/// this world size or another, and a path that is not a directory; a missing one is free.
pub fn check_free(dir: &Path) -> Result<()> {
    check_path(dir, "a checkpoint directory")?;
    let entries = match fs::read_dir(dir) {
        Ok(entries) => entries,
        Err(e) if e.kind() == ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(write_error(dir)(e)),
    };
    for entry in entries {
        let entry = entry.map_err(write_error(dir))?;
        if entry.file_name().to_str().is_some_and(is_rank_file) {
            return Err(Error::CheckpointExists {
                path: entry.path().display().to_string(),
            });
        }
    }
    Ok(())
}

/// Makes `dir` and its missing ancestors, each one's entry flushed to disk.
pub fn make_dir(dir: &Path) -> Result<()> {
    let mut missing = Vec::new();
    let mut d = dir;
    while !d.as_os_str().is_empty() && !d.is_dir() {
        missing.push(d);
        d = parent(d);
        if d == Path::new(".") {
            break;
        }
    }
    fs::create_dir_all(dir).map_err(write_error(dir))?;
    missing.iter().rev().try_for_each(|d| sync_parent(d))
}

/// A temporary file that is removed unless it was linked into place.
struct Temporary {
    path: PathBuf,
}

impl Drop for Temporary {
    fn drop(&mut self) {
        let _ = fs::remove_file(&self.path);
    }
}

/// Creates a new temporary file beside `path`, under a name no other writer uses.
fn create_temporary(path: &Path) -> Result<(Temporary, File)> {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let name = path
        .file_name()
        .map_or_else(|| "file".into(), |n| n.to_string_lossy().into_owned());
    let mut last = None;
    for _ in 0..16 {
        let n = NEXT.fetch_add(1, Ordering::Relaxed);
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let candidate = parent(path).join(format!(
            ".{name}.{}-{n}-{nanos}.partial",
            std::process::id()
        ));
        match OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&candidate)
        {
            Ok(file) => return Ok((Temporary { path: candidate }, file)),
            Err(e) if e.kind() == ErrorKind::AlreadyExists => last = Some((candidate, e)),
            Err(e) => return Err(write_error(&candidate)(e)),
        }
    }
    let (candidate, e) =
        last.unwrap_or_else(|| (path.to_path_buf(), ErrorKind::AlreadyExists.into()));
    Err(write_error(&candidate)(e))
}

/// Puts the flushed file `from` at `path`, refusing (`Error::CheckpointExists`) an existing file
/// or symlink there: a hard link never replaces one. Where the file system has no hard links,
/// a rename after a check that `path` is free.
fn link_new(from: &Path, path: &Path) -> Result<()> {
    let exists = || Error::CheckpointExists {
        path: path.display().to_string(),
    };
    match fs::hard_link(from, path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::AlreadyExists => Err(exists()),
        Err(e)
            if matches!(
                e.kind(),
                ErrorKind::Unsupported | ErrorKind::PermissionDenied
            ) || e.raw_os_error() == Some(95) =>
        {
            match fs::symlink_metadata(path) {
                Ok(_) => Err(exists()),
                Err(_) => fs::rename(from, path).map_err(write_error(path)),
            }
        }
        Err(e) => Err(write_error(path)(e)),
    }
}

/// Writes a new file at `path` with `write`: into a temporary file beside it, flushed to disk,
/// then linked into place (`Error::CheckpointExists` where `path` exists, a file or a symlink)
/// and the directory flushed. The temporary file is removed whatever happens, so a failure
/// leaves nothing behind.
pub fn write_new(path: &Path, write: impl FnOnce(&mut File) -> Result<()>) -> Result<()> {
    check_path(path, "a file to write")?;
    let (temporary, mut file) = create_temporary(path)?;
    write(&mut file)?;
    file.sync_all().map_err(write_error(&temporary.path))?;
    drop(file);
    link_new(&temporary.path, path)?;
    drop(temporary);
    sync_parent(path)
}

/// Bytes of a window of [`Writeback`].
const WINDOW_BYTES: u64 = 32 << 20;

/// A file written front to back whose pages go to disk as it is written: each window of
/// [`WINDOW_BYTES`] starts its writeback once written, and the window two before it is waited
/// for. The disk is busy from the first window on and dirty memory stays at a few windows,
/// where left to the page cache nothing would start before gigabytes were dirty, and the final
/// flush would wait for all of it.
struct Writeback<'f> {
    file: &'f mut File,
    written: u64,
    /// Where the current window starts.
    window: u64,
}

impl<'f> Writeback<'f> {
    fn new(file: &'f mut File) -> Writeback<'f> {
        Writeback {
            file,
            written: 0,
            window: 0,
        }
    }

    fn write(&mut self, mut bytes: &[u8]) -> std::io::Result<()> {
        while !bytes.is_empty() {
            let room = (self.window + WINDOW_BYTES - self.written) as usize;
            let (now, later) = bytes.split_at(room.min(bytes.len()));
            self.file.write_all(now)?;
            self.written += now.len() as u64;
            bytes = later;
            if self.written == self.window + WINDOW_BYTES {
                self.start_writeback(self.window, WINDOW_BYTES);
                if let Some(older) = self.window.checked_sub(2 * WINDOW_BYTES) {
                    self.wait_writeback(older, WINDOW_BYTES);
                }
                self.window += WINDOW_BYTES;
            }
        }
        Ok(())
    }

    /// Ends the writes; the caller's flush (`sync_all`) makes them durable.
    fn finish(self) -> std::io::Result<()> {
        self.file.flush()
    }

    /// Starts writing the pages of `bytes` at `offset` to disk.
    #[cfg(target_os = "linux")]
    fn start_writeback(&self, offset: u64, bytes: u64) {
        self.sync_range(offset, bytes, libc::SYNC_FILE_RANGE_WRITE);
    }

    /// Waits until the pages of `bytes` at `offset` are on disk.
    #[cfg(target_os = "linux")]
    fn wait_writeback(&self, offset: u64, bytes: u64) {
        let wait = libc::SYNC_FILE_RANGE_WAIT_BEFORE
            | libc::SYNC_FILE_RANGE_WRITE
            | libc::SYNC_FILE_RANGE_WAIT_AFTER;
        self.sync_range(offset, bytes, wait);
    }

    /// `sync_file_range` on the file: a hint; where it fails, the final flush writes the pages.
    #[cfg(target_os = "linux")]
    fn sync_range(&self, offset: u64, bytes: u64, flags: libc::c_uint) {
        use std::os::fd::AsRawFd;
        // SAFETY: a plain call on an open file descriptor.
        unsafe {
            libc::sync_file_range(
                self.file.as_raw_fd(),
                offset as libc::off64_t,
                bytes as libc::off64_t,
                flags,
            )
        };
    }

    #[cfg(not(target_os = "linux"))]
    fn start_writeback(&self, _offset: u64, _bytes: u64) {}

    #[cfg(not(target_os = "linux"))]
    fn wait_writeback(&self, _offset: u64, _bytes: u64) {}
}

/// Writes rank `manifest.rank`'s data (the sections `write_sections` writes, in order) and then
/// its manifest into `dir` (made if missing), each with [`write_new`]; fills in the data's length
/// and chunk digests.
pub(crate) fn write_rank(
    dir: &Path,
    mut manifest: RankManifest,
    write_sections: impl FnOnce(&mut (dyn FnMut(&[u8]) -> Result<()> + Send)) -> Result<()>,
) -> Result<()> {
    make_dir(dir)?;
    let data = data_path(dir, manifest.rank);
    let mut digests = ChunkDigests::new();
    write_new(&data, |file| {
        let mut out = Writeback::new(file);
        write_sections(&mut |bytes: &[u8]| {
            digests.update(bytes);
            out.write(bytes).map_err(write_error(&data))
        })?;
        out.finish().map_err(write_error(&data))
    })?;
    let (bytes, chunks) = digests.finish();
    manifest.data_bytes = bytes;
    manifest.chunk_bytes = super::CHUNK_BYTES;
    manifest.chunk_xxh3 = chunks;
    let path = manifest_path(dir, manifest.rank);
    let text = manifest.encode()?;
    write_new(&path, |file| {
        file.write_all(&text).map_err(write_error(&path))
    })
}

/// Rank `rank`'s manifest of the checkpoint in `dir`: of this format, its text unchanged since
/// it was written, and its own.
pub fn read_manifest(dir: &Path, rank: usize) -> Result<RankManifest> {
    check_path(dir, "a checkpoint directory")?;
    let path = manifest_path(dir, rank);
    let bytes = match fs::read(&path) {
        Ok(bytes) => bytes,
        Err(e) if e.kind() == ErrorKind::NotFound => {
            let reason = if dir.is_dir() {
                "missing: the checkpoint is incomplete (a save that did not finish), or of fewer ranks"
            } else {
                "missing: no checkpoint directory"
            };
            return Err(unreadable(&path, reason));
        }
        Err(e) => return Err(unreadable(&path, e.to_string())),
    };
    let manifest = RankManifest::decode(&path, &bytes)?;
    if manifest.rank != rank {
        return Err(unreadable(
            &path,
            format!("field `rank`: {}, in rank {rank}'s file", manifest.rank),
        ));
    }
    Ok(manifest)
}

/// Every rank's manifest of the checkpoint in `dir`, each checked, all of one save
/// ([`Saved::check`]).
pub fn read_saved(dir: &Path) -> Result<Saved> {
    let first = read_manifest(dir, 0)?;
    let world = first.world_size;
    let mut manifests = vec![first];
    for rank in 1..world {
        manifests.push(read_manifest(dir, rank)?);
    }
    Saved::check(dir, manifests)
}
