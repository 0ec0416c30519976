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
/// this world size or another; a path that is not a directory, or cannot be listed, is
/// `Error::Write`; a missing one is free.
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
/// a rename that replaces nothing.
fn link_new(from: &Path, path: &Path) -> Result<()> {
    match fs::hard_link(from, path) {
        Ok(()) => Ok(()),
        Err(e) if e.kind() == ErrorKind::AlreadyExists => Err(Error::CheckpointExists {
            path: path.display().to_string(),
        }),
        Err(e)
            if matches!(
                e.kind(),
                ErrorKind::Unsupported | ErrorKind::PermissionDenied
            ) || e.raw_os_error() == Some(95) =>
        {
            rename_new(from, path)
        }
        Err(e) => Err(write_error(path)(e)),
    }
}

/// Renames `from` to `path`, refusing (`Error::CheckpointExists`) an existing file or symlink
/// there: in one step where the file system can (`RENAME_NOREPLACE`), else after a check.
fn rename_new(from: &Path, path: &Path) -> Result<()> {
    let exists = || Error::CheckpointExists {
        path: path.display().to_string(),
    };
    #[cfg(target_os = "linux")]
    {
        use std::os::unix::ffi::OsStrExt;
        let c = |p: &Path| std::ffi::CString::new(p.as_os_str().as_bytes());
        let (Ok(c_from), Ok(c_path)) = (c(from), c(path)) else {
            return Err(write_error(path)(ErrorKind::InvalidInput.into()));
        };
        // SAFETY: two NUL-terminated paths, read during the call.
        let renamed = unsafe {
            libc::renameat2(
                libc::AT_FDCWD,
                c_from.as_ptr(),
                libc::AT_FDCWD,
                c_path.as_ptr(),
                libc::RENAME_NOREPLACE,
            )
        };
        if renamed == 0 {
            return Ok(());
        }
        let e = std::io::Error::last_os_error();
        match e.raw_os_error() {
            Some(libc::EEXIST) => return Err(exists()),
            // The file system has no such rename: the check below.
            Some(libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP) => {}
            _ => return Err(write_error(path)(e)),
        }
    }
    match fs::symlink_metadata(path) {
        Ok(_) => Err(exists()),
        Err(_) => fs::rename(from, path).map_err(write_error(path)),
    }
}

/// Writes a new file at `path` with `write`: into a temporary file beside it, flushed to disk,
/// then linked into place (`Error::CheckpointExists` where `path` exists, a file or a symlink)
/// and the directory flushed. The temporary file is removed whatever happens, and the linked
/// one where the directory's flush fails, so a failure leaves nothing behind.
pub fn write_new(path: &Path, write: impl FnOnce(&mut File) -> Result<()>) -> Result<()> {
    check_path(path, "a file to write")?;
    let (temporary, mut file) = create_temporary(path)?;
    write(&mut file)?;
    file.sync_all().map_err(write_error(&temporary.path))?;
    drop(file);
    link_new(&temporary.path, path)?;
    drop(temporary);
    sync_parent(path).inspect_err(|_| {
        // Best effort: the flush's failure is the error to report. The file is this call's:
        // it was linked where nothing was.
        let _ = fs::remove_file(path);
    })
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
                self.start_writeback(self.window, WINDOW_BYTES)?;
                if let Some(older) = self.window.checked_sub(2 * WINDOW_BYTES) {
                    self.wait_writeback(older, WINDOW_BYTES)?;
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
    fn start_writeback(&self, offset: u64, bytes: u64) -> std::io::Result<()> {
        sync_range(self.file, offset, bytes, libc::SYNC_FILE_RANGE_WRITE)
    }

    /// Waits until the pages of `bytes` at `offset` are on disk.
    #[cfg(target_os = "linux")]
    fn wait_writeback(&self, offset: u64, bytes: u64) -> std::io::Result<()> {
        let wait = libc::SYNC_FILE_RANGE_WAIT_BEFORE
            | libc::SYNC_FILE_RANGE_WRITE
            | libc::SYNC_FILE_RANGE_WAIT_AFTER;
        sync_range(self.file, offset, bytes, wait)
    }

    #[cfg(not(target_os = "linux"))]
    fn start_writeback(&self, _offset: u64, _bytes: u64) -> std::io::Result<()> {
        Ok(())
    }

    #[cfg(not(target_os = "linux"))]
    fn wait_writeback(&self, _offset: u64, _bytes: u64) -> std::io::Result<()> {
        Ok(())
    }
}

/// `sync_file_range` on `file`. Where the file cannot take it, it is skipped: the final flush
/// writes the pages. Any other failure is the write's: a wait takes the file's writeback error
/// (a page the disk refused), which the final flush would then no longer report.
#[cfg(target_os = "linux")]
fn sync_range(file: &File, offset: u64, bytes: u64, flags: libc::c_uint) -> std::io::Result<()> {
    use std::os::fd::AsRawFd;
    let (Ok(offset), Ok(bytes)) = (i64::try_from(offset), i64::try_from(bytes)) else {
        return Ok(());
    };
    // SAFETY: a plain call on an open file descriptor.
    let done = unsafe { libc::sync_file_range(file.as_raw_fd(), offset, bytes, flags) };
    match done {
        0 => Ok(()),
        _ => match std::io::Error::last_os_error() {
            e if cannot_sync_range(&e) => Ok(()),
            e => Err(e),
        },
    }
}

/// Whether `e`, of `sync_file_range`, says that the file cannot take it (a pipe, a file system
/// without it), rather than that a write failed.
#[cfg(target_os = "linux")]
fn cannot_sync_range(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EINVAL | libc::ESPIPE | libc::ENOSYS | libc::EOPNOTSUPP)
    )
}

/// Writes rank `manifest.rank`'s data (the sections `write_sections` writes, in order) and then
/// its manifest into `dir` (made if missing), each with [`write_new`]; fills in the data's length
/// and chunk digests. A failure leaves neither file: a data file whose manifest failed is
/// removed (left, it would refuse every later save into `dir`).
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
    let written = manifest.encode().and_then(|text| {
        write_new(&path, |file| {
            file.write_all(&text).map_err(write_error(&path))
        })
    });
    if written.is_err() {
        // Best effort: the manifest's failure is the error to report.
        let _ = remove_files(&[data]);
    }
    written
}

/// Removes rank `rank`'s files in `dir`, of a save that failed on another rank after this one
/// wrote them: its manifest first, so that an interruption leaves a part without a manifest,
/// never taken for a whole one; a file already gone is no error.
pub(crate) fn remove_rank(dir: &Path, rank: usize) -> Result<()> {
    remove_files(&[manifest_path(dir, rank), data_path(dir, rank)])
}

/// Removes `paths` in order, then flushes their directories' entries.
fn remove_files(paths: &[PathBuf]) -> Result<()> {
    for path in paths {
        match fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == ErrorKind::NotFound => {}
            Err(e) => return Err(write_error(path)(e)),
        }
    }
    paths.iter().try_for_each(|p| sync_parent(p))
}

/// The largest manifest [`read_manifest`] reads: far above one of a million parameters and a
/// digest for every chunk of a terabyte.
const MAX_MANIFEST_BYTES: u64 = 1 << 30;

/// Rank `rank`'s manifest of the checkpoint in `dir`: of this format, its text unchanged since
/// it was written, and its own.
pub fn read_manifest(dir: &Path, rank: usize) -> Result<RankManifest> {
    check_path(dir, "a checkpoint directory")?;
    let path = manifest_path(dir, rank);
    let bytes = match crate::fallible::read_file(&path, MAX_MANIFEST_BYTES) {
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

#[cfg(all(test, target_os = "linux"))]
mod tests {
    use super::*;
    use std::io::Error as IoError;

    /// A fresh directory of this process for `what`.
    fn fresh_dir(what: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("fsdp-{what}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        fs::create_dir_all(&dir).unwrap();
        dir
    }

    fn names(dir: &Path) -> Vec<String> {
        let mut names: Vec<String> = fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    fn manifest() -> RankManifest {
        RankManifest {
            save_id: "0".repeat(32),
            rank: 0,
            world_size: 1,
            optimizer_steps: 0,
            lr: 1e-3,
            weight_decay: 0.0,
            optimizer: "sgd".into(),
            moment_dtype: "f32".into(),
            params: Vec::new(),
            process_groups: Vec::new(),
            sections: Vec::new(),
            data_bytes: 0,
            chunk_bytes: 0,
            chunk_xxh3: Vec::new(),
        }
    }

    #[test]
    fn a_rank_whose_manifest_fails_leaves_no_data_and_a_removed_rank_nothing() {
        let dir = fresh_dir("write-rank");
        // Another writer's manifest in the way: this one's link refuses, and its data goes.
        fs::write(manifest_path(&dir, 0), b"another's").unwrap();
        let written = write_rank(&dir, manifest(), |write| write(&[1, 2, 3]));
        assert!(
            matches!(written, Err(Error::CheckpointExists { .. })),
            "{written:?}"
        );
        assert_eq!(names(&dir), ["rank-00000.json"]);
        assert_eq!(fs::read(manifest_path(&dir, 0)).unwrap(), b"another's");
        fs::remove_file(manifest_path(&dir, 0)).unwrap();
        write_rank(&dir, manifest(), |write| write(&[1, 2, 3])).unwrap();
        assert_eq!(names(&dir), ["rank-00000.bin", "rank-00000.json"]);
        remove_rank(&dir, 0).unwrap();
        assert!(names(&dir).is_empty());
        remove_rank(&dir, 0).unwrap();
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_rename_into_place_replaces_no_file_nor_symlink() {
        let dir = fresh_dir("rename-new");
        let (from, taken, link, free) = (
            dir.join("from"),
            dir.join("taken"),
            dir.join("link"),
            dir.join("free"),
        );
        fs::write(&from, b"new").unwrap();
        fs::write(&taken, b"old").unwrap();
        std::os::unix::fs::symlink(&taken, &link).unwrap();
        for existing in [&taken, &link] {
            let r = rename_new(&from, existing);
            assert!(matches!(r, Err(Error::CheckpointExists { .. })), "{r:?}");
        }
        assert_eq!(fs::read(&taken).unwrap(), b"old");
        rename_new(&from, &free).unwrap();
        assert_eq!(fs::read(&free).unwrap(), b"new");
        assert!(!from.exists());
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_failed_sync_of_a_range_is_the_write_s_unless_the_file_cannot_take_one() {
        for errno in [libc::EIO, libc::ENOSPC, libc::EDQUOT, libc::EBADF] {
            assert!(
                !cannot_sync_range(&IoError::from_raw_os_error(errno)),
                "{errno}"
            );
        }
        for errno in [libc::EINVAL, libc::ESPIPE, libc::ENOSYS, libc::EOPNOTSUPP] {
            assert!(
                cannot_sync_range(&IoError::from_raw_os_error(errno)),
                "{errno}"
            );
        }
        // A pipe cannot take one (ESPIPE): skipped, the write goes on.
        let mut fds = [0; 2];
        // SAFETY: a plain call filling `fds`.
        assert_eq!(unsafe { libc::pipe(fds.as_mut_ptr()) }, 0);
        // SAFETY: both descriptors were just opened, and each is owned once.
        let (reader, writer) = unsafe {
            use std::os::fd::FromRawFd;
            (File::from_raw_fd(fds[0]), File::from_raw_fd(fds[1]))
        };
        assert!(sync_range(&writer, 0, 4096, libc::SYNC_FILE_RANGE_WRITE).is_ok());
        drop((reader, writer));
        // A descriptor that cannot write (EBADF) fails the write.
        use std::os::unix::fs::OpenOptionsExt;
        let path = std::env::temp_dir().join(format!("sync-range-{}", std::process::id()));
        drop(File::create(&path).unwrap());
        let opened = OpenOptions::new()
            .read(true)
            .custom_flags(libc::O_PATH)
            .open(&path);
        let _ = fs::remove_file(&path);
        let refused = sync_range(&opened.unwrap(), 0, 4096, libc::SYNC_FILE_RANGE_WRITE);
        assert_eq!(refused.unwrap_err().raw_os_error(), Some(libc::EBADF));
    }

    /// A manifest that is not a regular file (a device that never ends) is refused by name
    /// instead of read until memory runs out.
    #[test]
    fn a_manifest_that_is_not_a_regular_file_is_refused() {
        let dir = fresh_dir("manifest-device");
        std::os::unix::fs::symlink("/dev/zero", manifest_path(&dir, 0)).unwrap();
        let refused = read_manifest(&dir, 0).unwrap_err();
        fs::remove_dir_all(&dir).unwrap();
        assert!(
            matches!(&refused, Error::CheckpointUnreadable { reason, .. } if reason.contains("not a regular file")),
            "{refused:?}"
        );
    }
}
