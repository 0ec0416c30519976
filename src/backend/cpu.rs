//! The CPU backend: host memory, eager execution. Streams and events keep the engine's ordering
//! explicit; since every operation completes before it returns, events are always complete.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Instant;

use crate::backend::{Backend, Input, MemoryUsage, OptimizerShard, RawAddress, Region, Stream};
use crate::dtype::{DType, load_f32, store_f32};
use crate::error::{Error, Result};
use crate::optim::{Update, accumulate_element, adamw_element, sgd_element};

#[derive(Debug, Default)]
struct Tracker {
    current: AtomicUsize,
    peak: AtomicUsize,
}

/// Host memory, 8-byte aligned, counted by its backend while it lives.
#[derive(Debug)]
pub struct CpuBuffer {
    words: Vec<u64>,
    len: usize,
    tracker: Arc<Tracker>,
}

impl CpuBuffer {
    pub fn bytes(&self) -> &[u8] {
        &bytemuck::cast_slice(&self.words)[..self.len]
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut bytemuck::cast_slice_mut(&mut self.words)[..self.len]
    }

    /// The bytes of `region`, or an error when it runs past the end.
    pub fn region(&self, region: Region) -> Result<&[u8]> {
        let range = checked(region, self.len)?;
        Ok(&self.bytes()[range])
    }

    pub fn region_mut(&mut self, region: Region) -> Result<&mut [u8]> {
        let range = checked(region, self.len)?;
        Ok(&mut self.bytes_mut()[range])
    }

    /// `region` as f32 values.
    fn f32s(&self, region: Region) -> Result<&[f32]> {
        Ok(bytemuck::cast_slice(self.region(Region {
            dtype: DType::F32,
            ..region
        })?))
    }

    fn f32s_mut(&mut self, region: Region) -> Result<&mut [f32]> {
        Ok(bytemuck::cast_slice_mut(self.region_mut(Region {
            dtype: DType::F32,
            ..region
        })?))
    }
}

impl Drop for CpuBuffer {
    fn drop(&mut self) {
        self.tracker.current.fetch_sub(self.len, Ordering::Relaxed);
    }
}

fn checked(region: Region, capacity_bytes: usize) -> Result<std::ops::Range<usize>> {
    let size = region.dtype.size();
    let fits = region
        .offset
        .checked_add(region.len)
        .and_then(|end| end.checked_mul(size))
        .is_some_and(|end| end <= capacity_bytes);
    if !fits {
        return Err(Error::OutOfRange {
            offset: region.offset,
            len: region.len,
            capacity: capacity_bytes / size,
        });
    }
    Ok(region.bytes())
}

/// A completed point in a stream, and when the host reached it.
#[derive(Clone, Copy, Debug)]
pub struct CpuEvent(Instant);

/// The CPU backend of one rank.
#[derive(Debug, Default)]
pub struct CpuBackend {
    tracker: Arc<Tracker>,
    host_waits: AtomicU64,
}

impl CpuBackend {
    pub fn new() -> CpuBackend {
        CpuBackend::default()
    }
}

impl Backend for CpuBackend {
    type Buffer = CpuBuffer;
    type Event = CpuEvent;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn alloc(&self, bytes: usize) -> Result<CpuBuffer> {
        let words = vec![0u64; bytes.div_ceil(8)];
        let current = self.tracker.current.fetch_add(bytes, Ordering::Relaxed) + bytes;
        self.tracker.peak.fetch_max(current, Ordering::Relaxed);
        Ok(CpuBuffer {
            words,
            len: bytes,
            tracker: Arc::clone(&self.tracker),
        })
    }

    fn memory(&self) -> MemoryUsage {
        MemoryUsage {
            current: self.tracker.current.load(Ordering::Relaxed),
            peak: self.tracker.peak.load(Ordering::Relaxed),
        }
    }

    fn host_waits(&self) -> u64 {
        self.host_waits.load(Ordering::Relaxed)
    }

    fn record(&self, _stream: Stream) -> Result<CpuEvent> {
        Ok(CpuEvent(Instant::now()))
    }

    fn wait(&self, _stream: Stream, _event: &CpuEvent) -> Result<()> {
        Ok(())
    }

    fn synchronize(&self, _event: &CpuEvent) -> Result<()> {
        self.host_waits.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    fn record_timed(&self, stream: Stream) -> Result<CpuEvent> {
        self.record(stream)
    }

    fn elapsed_ms(&self, start: &CpuEvent, end: &CpuEvent) -> Result<f32> {
        let (start, end) = (start.0, end.0);
        Ok(if end >= start {
            (end - start).as_secs_f32() * 1e3
        } else {
            -((start - end).as_secs_f32() * 1e3)
        })
    }

    fn zero(&self, _stream: Stream, buf: &mut CpuBuffer, region: Region) -> Result<()> {
        buf.region_mut(region)?.fill(0);
        Ok(())
    }

    fn upload(&self, buf: &mut CpuBuffer, region: Region, data: &[u8]) -> Result<()> {
        let dst = buf.region_mut(region)?;
        if dst.len() != data.len() {
            return Err(Error::OutOfRange {
                offset: 0,
                len: data.len() / region.dtype.size(),
                capacity: region.len,
            });
        }
        dst.copy_from_slice(data);
        Ok(())
    }

    fn download(&self, buf: &CpuBuffer, region: Region, out: &mut [u8]) -> Result<()> {
        let src = buf.region(region)?;
        if src.len() != out.len() {
            return Err(Error::OutOfRange {
                offset: 0,
                len: region.len,
                capacity: out.len() / region.dtype.size(),
            });
        }
        out.copy_from_slice(src);
        Ok(())
    }

    fn accumulate_input(
        &self,
        _stream: Stream,
        src: Input<'_>,
        dst: &mut CpuBuffer,
        dst_region: Region,
        scale: f32,
        add: bool,
    ) -> Result<()> {
        let Input::Host { bytes, dtype } = src else {
            return Err(Error::Unsupported {
                backend: "cpu",
                what: "device memory",
            });
        };
        let dst = dst.f32s_mut(dst_region)?;
        if bytes.len() != dst.len() * dtype.size() {
            return Err(Error::OutOfRange {
                offset: 0,
                len: bytes.len() / dtype.size(),
                capacity: dst.len(),
            });
        }
        for (i, d) in dst.iter_mut().enumerate() {
            *d = accumulate_element(*d, load_f32(bytes, dtype, i), scale, add);
        }
        Ok(())
    }

    #[allow(clippy::too_many_arguments)]
    fn accumulate(
        &self,
        _stream: Stream,
        src: &CpuBuffer,
        src_region: Region,
        dst: &mut CpuBuffer,
        dst_region: Region,
        scale: f32,
        add: bool,
    ) -> Result<()> {
        let src = src.f32s(src_region)?;
        let dst = dst.f32s_mut(dst_region)?;
        if src.len() != dst.len() {
            return Err(Error::OutOfRange {
                offset: 0,
                len: src.len(),
                capacity: dst.len(),
            });
        }
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = accumulate_element(*d, s, scale, add);
        }
        Ok(())
    }

    fn optimizer_step(
        &self,
        _stream: Stream,
        update: &Update,
        shard: OptimizerShard<'_, CpuBackend>,
    ) -> Result<()> {
        let n = shard.numel;
        let whole = Region::new(0, n, DType::F32);
        let grad = shard.grad.f32s(whole)?;
        let dtype = shard.dtype;
        let param = shard.param.region_mut(Region::new(0, n, dtype))?;
        let mut master = match shard.master {
            Some(m) => Some(m.f32s_mut(whole)?),
            None => None,
        };
        let mut moments = match shard.moments {
            Some((m, v)) => Some((m.f32s_mut(whole)?, v.f32s_mut(whole)?)),
            None => None,
        };
        for i in 0..n {
            let p = match &master {
                Some(master) => master[i],
                None => load_f32(param, dtype, i),
            };
            let p = match (update, &mut moments) {
                (Update::Sgd { lr }, _) => sgd_element(p, grad[i], *lr),
                (Update::AdamW(c), Some((m, v))) => {
                    let (p, mi, vi) = adamw_element(p, m[i], v[i], grad[i], c);
                    m[i] = mi;
                    v[i] = vi;
                    p
                }
                (Update::AdamW(_), None) => {
                    return Err(Error::InvalidConfig {
                        field: "optimizer",
                        reason: "AdamW needs moment buffers".into(),
                    });
                }
            };
            if let Some(master) = &mut master {
                master[i] = p;
            }
            store_f32(param, dtype, i, p);
        }
        Ok(())
    }

    fn widen(
        &self,
        _stream: Stream,
        src: &CpuBuffer,
        src_region: Region,
        dst: &mut CpuBuffer,
    ) -> Result<()> {
        let bytes = src.region(src_region)?;
        let dst = dst.f32s_mut(Region::new(0, src_region.len, DType::F32))?;
        for (i, d) in dst.iter_mut().enumerate() {
            *d = load_f32(bytes, src_region.dtype, i);
        }
        Ok(())
    }
}

impl RawAddress for CpuBackend {
    fn address(buf: &CpuBuffer, region: Region) -> Result<u64> {
        Ok(buf.region(region)?.as_ptr() as u64)
    }

    fn address_mut(buf: &mut CpuBuffer, region: Region) -> Result<u64> {
        Ok(buf.region_mut(region)?.as_mut_ptr() as u64)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn memory_is_counted_while_buffers_live() {
        let b = CpuBackend::new();
        let x = b.alloc(100).unwrap();
        let y = b.alloc(28).unwrap();
        assert_eq!(
            b.memory(),
            MemoryUsage {
                current: 128,
                peak: 128
            }
        );
        drop(x);
        assert_eq!(
            b.memory(),
            MemoryUsage {
                current: 28,
                peak: 128
            }
        );
        assert_eq!(y.bytes(), &[0u8; 28][..]);
    }

    #[test]
    fn regions_past_the_end_are_errors() {
        let b = CpuBackend::new();
        let mut x = b.alloc(16).unwrap();
        let r = Region::new(3, 2, DType::F32);
        assert!(matches!(
            b.zero(Stream::Compute, &mut x, r),
            Err(Error::OutOfRange {
                offset: 3,
                len: 2,
                capacity: 4
            })
        ));
    }

    #[test]
    fn accumulate_input_widens_and_scales() {
        let b = CpuBackend::new();
        let mut dst = b.alloc(12).unwrap();
        let r = Region::new(0, 3, DType::F32);
        let g = [
            half::bf16::from_f32(1.5),
            half::bf16::from_f32(-2.0),
            half::bf16::from_f32(0.25),
        ];
        b.accumulate_input(Stream::Compute, Input::host(&g), &mut dst, r, 2.0, false)
            .unwrap();
        b.accumulate_input(Stream::Compute, Input::host(&g), &mut dst, r, 1.0, true)
            .unwrap();
        assert_eq!(dst.f32s(r).unwrap(), &[4.5, -6.0, 0.75]);
    }
}
