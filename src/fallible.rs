//! Host allocations that report too little memory as an error instead of aborting the process.

use crate::error::{Error, Result};

fn out_of_memory<T>(n: usize, what: &str) -> Error {
    Error::OutOfMemory {
        bytes: n.saturating_mul(std::mem::size_of::<T>()),
        what: what.to_string(),
    }
}

/// An empty vector with room for `n` elements.
pub(crate) fn with_capacity<T>(n: usize, what: &str) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n)
        .map_err(|_| out_of_memory::<T>(n, what))?;
    Ok(v)
}

/// `n` copies of `value`.
pub(crate) fn filled<T: Clone>(n: usize, value: T, what: &str) -> Result<Vec<T>> {
    let mut v = with_capacity(n, what)?;
    v.resize(n, value);
    Ok(v)
}

/// `n` zero bytes, from memory the system zeroes as it is first touched: no pass writes them, so
/// a large buffer costs nothing until used.
pub(crate) fn zeroed(n: usize, what: &str) -> Result<Vec<u8>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    let layout = std::alloc::Layout::array::<u8>(n).map_err(|_| out_of_memory::<u8>(n, what))?;
    // SAFETY: `layout` has a non-zero size.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
    if ptr.is_null() {
        return Err(out_of_memory::<u8>(n, what));
    }
    ask_for_huge_pages(ptr, n);
    // SAFETY: `ptr` was allocated by the global allocator with `layout` (n bytes, align 1) and
    // holds n initialized (zero) bytes.
    Ok(unsafe { Vec::from_raw_parts(ptr, n, n) })
}

/// Asks the system to back the `n` bytes at `ptr` with huge pages where it can: a buffer of
/// gigabytes first touched by several threads then takes a fault per 2 MiB, not per 4 KiB. A hint;
/// refused, nothing changes.
#[cfg(target_os = "linux")]
fn ask_for_huge_pages(ptr: *mut u8, n: usize) {
    const PAGE: usize = 4096;
    let start = (ptr as usize).next_multiple_of(PAGE);
    let end = (ptr as usize).saturating_add(n) / PAGE * PAGE;
    if end > start {
        // SAFETY: advice on whole pages inside an allocation this function's caller owns; it
        // changes no byte of it.
        unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_HUGEPAGE) };
    }
}

#[cfg(not(target_os = "linux"))]
fn ask_for_huge_pages(_ptr: *mut u8, _n: usize) {}

/// A copy of `bytes`.
pub(crate) fn copy_of(bytes: &[u8], what: &str) -> Result<Vec<u8>> {
    let mut v = with_capacity(bytes.len(), what)?;
    v.extend_from_slice(bytes);
    Ok(v)
}

/// Makes `v` `n` zeros, reusing its memory.
pub(crate) fn refill(v: &mut Vec<u8>, n: usize, what: &str) -> Result<()> {
    v.clear();
    v.try_reserve_exact(n)
        .map_err(|_| out_of_memory::<u8>(n, what))?;
    v.resize(n, 0);
    Ok(())
}

/// The regular file at `path`, open for reading, and its length. A file that is not regular (a
/// FIFO, whose open or read would block, or a device such as `/dev/zero`, which never ends) is
/// an error; the file is opened without blocking, so a FIFO is refused without waiting for a
/// writer.
pub(crate) fn open_regular(path: &std::path::Path) -> std::io::Result<(std::fs::File, u64)> {
    use std::os::unix::fs::OpenOptionsExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NONBLOCK)
        .open(path)?;
    let metadata = file.metadata()?;
    if !metadata.is_file() {
        let refused = std::io::Error::new(std::io::ErrorKind::InvalidInput, "not a regular file");
        return Err(refused);
    }
    Ok((file, metadata.len()))
}

/// The bytes of the regular file at `path` ([`open_regular`]), at most `limit` of them: a
/// larger file is an error, as is too little memory, rather than an abort.
pub(crate) fn read_file(path: &std::path::Path, limit: u64) -> std::io::Result<Vec<u8>> {
    use std::io::{Error as IoError, ErrorKind, Read};
    let (file, length) = open_regular(path)?;
    if length > limit {
        let message = format!("{length} bytes, more than the {limit} a file of this kind may hold");
        return Err(IoError::new(ErrorKind::InvalidData, message));
    }
    let mut bytes = Vec::new();
    bytes
        .try_reserve_exact(length as usize)
        .map_err(|_| IoError::new(ErrorKind::OutOfMemory, "too little memory for the file"))?;
    // The file may have grown since: read no more than the limit and one byte past it.
    file.take(limit.saturating_add(1)).read_to_end(&mut bytes)?;
    if bytes.len() as u64 > limit {
        return Err(IoError::new(
            ErrorKind::InvalidData,
            format!("more than the {limit} bytes a file of this kind may hold"),
        ));
    }
    Ok(bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn too_much_is_an_error_naming_what_it_was_for() {
        assert!(matches!(
            filled(usize::MAX / 2, 0u64, "a test"),
            Err(Error::OutOfMemory { what, .. }) if what == "a test"
        ));
        assert_eq!(filled(3, 7u8, "x").unwrap(), vec![7, 7, 7]);
        assert_eq!(copy_of(&[1, 2], "x").unwrap(), vec![1, 2]);
        assert!(matches!(
            zeroed(usize::MAX / 2, "a test"),
            Err(Error::OutOfMemory { what, .. }) if what == "a test"
        ));
        assert_eq!(zeroed(5, "x").unwrap(), vec![0; 5]);
        assert!(zeroed(0, "x").unwrap().is_empty());
        let mut v = vec![1u8; 3];
        refill(&mut v, 4, "x").unwrap();
        assert_eq!(v, vec![0; 4]);
    }

    /// A FIFO with no writer, a device that never ends, a directory and a file past the limit
    /// are refused, the FIFO without waiting for a writer; a regular file within the
    /// limit is read.
    #[test]
    fn only_regular_files_within_the_limit_are_read() {
        /// The test's directory, removed however the test ends.
        struct Scratch(std::path::PathBuf);
        impl Drop for Scratch {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
        let scratch =
            Scratch(std::env::temp_dir().join(format!("fsdp-read-file-{}", std::process::id())));
        let dir = scratch.0.clone();
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let (fifo, large, small) = (dir.join("fifo"), dir.join("large"), dir.join("small"));
        let c_fifo = std::ffi::CString::new(fifo.as_os_str().as_encoded_bytes()).unwrap();
        // SAFETY: a NUL-terminated path.
        assert_eq!(unsafe { libc::mkfifo(c_fifo.as_ptr(), 0o600) }, 0);
        std::fs::write(&large, b"0123456789a").unwrap();
        std::fs::write(&small, b"0123456789").unwrap();
        let (done, outcome) = std::sync::mpsc::channel();
        let paths = [fifo, "/dev/zero".into(), dir.clone(), large.clone()];
        std::thread::spawn(move || {
            for path in paths {
                let _ = done.send(read_file(&path, 10).map_err(|e| e.to_string()));
            }
        });
        let expected = ["not a regular file"; 3]
            .into_iter()
            .map(String::from)
            .chain(["11 bytes, more than the 10 a file of this kind may hold".into()]);
        for (i, expected) in expected.enumerate() {
            let got = outcome.recv_timeout(std::time::Duration::from_secs(10));
            assert_eq!(got, Ok(Err(expected)), "path {i}");
        }
        assert_eq!(read_file(&small, 10).unwrap(), b"0123456789");
        assert!(read_file(&small, 9).is_err());
    }
}
