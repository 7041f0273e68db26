//! glibc malloc tuning for the CPU forward. A prefill allocates and frees activation tensors of
//! a few MB per op; by default glibc serves those with fresh `mmap`s (or trims the heap after
//! freeing them), so every op pays page faults and page clearing for memory it just gave back
//! (~7% of a 512-token prefill on SmolLM2-135M, mostly `clear_page_erms`). Keeping freed memory
//! in the heap for reuse removes that; peak RSS is unchanged (the memory was in use anyway).

/// Sets the mmap threshold to its maximum (32 MiB on 64-bit glibc) and stops heap trimming
/// below 512 MiB of free memory. Called once, when the CPU thread pool starts; a no-op on other
/// C libraries.
pub fn tune() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        const M_TRIM_THRESHOLD: i32 = -1;
        const M_MMAP_THRESHOLD: i32 = -3;
        extern "C" {
            fn mallopt(param: i32, value: i32) -> i32;
        }
        // SAFETY: mallopt only changes allocator parameters; it is thread-safe in glibc.
        unsafe {
            mallopt(M_MMAP_THRESHOLD, 32 << 20);
            mallopt(M_TRIM_THRESHOLD, 512 << 20);
        }
    }
}

/// Memory for weights the kernels stream, in transparent huge pages where the OS allows
/// (`madvise` mode or `always`). Decode of a bandwidth-bound model reads every weight once per
/// token, and through 4 KiB pages, as a memory-mapped model file gives, two threads read 31 GB/s
/// on our EPYC VM against 54–57 GB/s through 2 MiB pages (`bench/membw.c`; TLB misses, and the
/// hardware prefetchers stop at page boundaries). So CPU weights are copied (or repacked) here
/// at load, and the file's pages are released as the copy goes.
///
/// Buffers are cut from shared chunks of at least `CHUNK` bytes (a matrix of a small model is
/// often smaller than one huge page, which would otherwise be spent on each), 64-byte aligned,
/// and a chunk is unmapped when its last buffer is dropped.
pub struct HugeBuf {
    chunk: std::sync::Arc<Chunk>,
    start: usize,
    len: usize,
}

/// An anonymous mapping advised for huge pages, its usable part starting at a 2 MiB boundary.
struct Chunk {
    /// Unmapped when the chunk is dropped.
    _map: memmap2::MmapMut,
    base: *mut u8,
    len: usize,
}

// SAFETY: `base` points into `map`, which lives as long as the chunk; buffers cut from a chunk
// are disjoint, and each is written only through its own `&mut HugeBuf`.
unsafe impl Send for Chunk {}
unsafe impl Sync for Chunk {}

const HUGE_PAGE: usize = 2 << 20;
/// The smallest chunk mapped at a time.
const CHUNK: usize = 32 << 20;
/// Bytes per step of `HugeBuf::copy_of`: the source's pages are released after each.
const COPY_CHUNK: usize = 4 << 20;

impl Chunk {
    fn new(len: usize) -> std::io::Result<Self> {
        // One huge page more leaves room to align the start.
        let mut map = memmap2::MmapMut::map_anon(len + HUGE_PAGE)?;
        #[cfg(target_os = "linux")]
        {
            // Only a hint: without huge pages the chunk is ordinary memory.
            let _ = map.advise(memmap2::Advice::HugePage);
        }
        let skip = (HUGE_PAGE - map.as_ptr() as usize % HUGE_PAGE) % HUGE_PAGE;
        // SAFETY: `skip < HUGE_PAGE`, inside the mapping.
        let base = unsafe { map.as_mut_ptr().add(skip) };
        Ok(Self { _map: map, base, len })
    }
}

/// The chunk new buffers are cut from, and how much of it is taken.
static CURRENT: std::sync::Mutex<Option<(std::sync::Arc<Chunk>, usize)>> = std::sync::Mutex::new(None);

impl HugeBuf {
    /// `len` zero bytes, 64-byte aligned.
    pub fn zeroed(len: usize) -> std::io::Result<Self> {
        let need = len.next_multiple_of(64).max(64);
        if need >= CHUNK {
            return Ok(Self { chunk: std::sync::Arc::new(Chunk::new(need)?), start: 0, len });
        }
        let mut current = CURRENT.lock().unwrap_or_else(|e| e.into_inner());
        if !matches!(&*current, Some((chunk, used)) if chunk.len - used >= need) {
            *current = Some((std::sync::Arc::new(Chunk::new(CHUNK)?), 0));
        }
        let (chunk, used) = current.as_mut().expect("a current chunk");
        let start = *used;
        *used += need;
        // Anonymous memory comes zeroed and no buffer has used this range before.
        Ok(Self { chunk: chunk.clone(), start, len })
    }

    /// A copy of `src`, calling `done(range)` after each chunk of it is copied (so that a memory
    /// map can drop those pages: the peak holds about one copy).
    pub fn copy_of(src: &[u8], done: &dyn Fn(std::ops::Range<usize>)) -> std::io::Result<Self> {
        let mut buf = Self::zeroed(src.len())?;
        for (i, (dst, from)) in buf.bytes_mut().chunks_mut(COPY_CHUNK).zip(src.chunks(COPY_CHUNK)).enumerate() {
            dst.copy_from_slice(from);
            done(i * COPY_CHUNK..i * COPY_CHUNK + from.len());
        }
        Ok(buf)
    }

    pub fn bytes(&self) -> &[u8] {
        // SAFETY: this buffer's range lies inside the chunk's mapping and no `&mut` to it exists
        // while `&self` is borrowed.
        unsafe { std::slice::from_raw_parts(self.chunk.base.add(self.start), self.len) }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for `bytes`; buffers never overlap, so this is the only access to the range.
        unsafe { std::slice::from_raw_parts_mut(self.chunk.base.add(self.start), self.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn huge_buf_is_aligned_and_copies_in_chunks() {
        let src: Vec<u8> = (0..(9 << 20) + 123).map(|i| (i * 7 % 251) as u8).collect();
        let released = std::cell::RefCell::new(Vec::new());
        let buf = HugeBuf::copy_of(&src, &|r| released.borrow_mut().push(r)).unwrap();
        assert_eq!(buf.bytes().as_ptr() as usize % 64, 0);
        assert_eq!(buf.bytes(), &src[..]);
        // Small buffers share a chunk and do not overlap.
        let (mut a, mut b) = (HugeBuf::zeroed(100).unwrap(), HugeBuf::zeroed(100).unwrap());
        a.bytes_mut().fill(1);
        b.bytes_mut().fill(2);
        assert!(a.bytes().iter().all(|&x| x == 1) && b.bytes().iter().all(|&x| x == 2));
        let released = released.into_inner();
        assert_eq!(released.len(), 3);
        assert_eq!(released.last().unwrap().end, src.len());
    }
}
