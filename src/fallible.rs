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
}
