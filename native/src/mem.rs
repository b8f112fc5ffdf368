//! Memory primitives: a huge-page slab arena, a fixed-capacity raw buffer, a shared file
//! mapping (a disk tier's spill file), and the
//! unsafe helpers of the hot paths (`prefetch`, `SendPtr` for disjoint parallel writes).
//!
//! Full-size slab chunks are bump-allocated from large 2 MiB-aligned anonymous
//! mappings advised with `MADV_HUGEPAGE` (transparent huge pages), so random row
//! accesses over multi-GiB tables do not thrash the TLB. Arena memory is never
//! returned individually (slots are recycled through free lists instead); it is
//! unmapped when the table is dropped (or the capture released: captures use an
//! arena of ordinary pages). Small buffers (the first, growing chunk
//! of each internal shard) live on the ordinary heap. Large hash indexes get
//! their own huge-page mappings.

use std::alloc::{alloc, alloc_zeroed, dealloc, handle_alloc_error, Layout};
use std::ops::{Deref, DerefMut};
use std::ptr::NonNull;

use parking_lot::Mutex;

pub const HUGE: usize = 2 << 20;
const REGION: usize = 64 << 20;
/// Buffers at least this large get their own huge-page mapping.
pub const MMAP_MIN: usize = 2 << 20;

#[inline]
fn round_up(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

/// Map `len` bytes (a multiple of 4 KiB), 2 MiB aligned, advised for huge pages.
fn map_huge(len: usize) -> *mut u8 {
    map_aligned(len, true)
}

/// Map `len` bytes (a multiple of 4 KiB), 2 MiB aligned, advised for huge pages if `huge`.
/// The memory reads as zeros (fresh anonymous pages).
fn map_aligned(len: usize, huge: bool) -> *mut u8 {
    #[cfg(unix)]
    // SAFETY: plain anonymous mapping; we only unmap ranges we mapped.
    unsafe {
        let total = len + HUGE;
        let p = libc::mmap(
            std::ptr::null_mut(),
            total,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        );
        if p == libc::MAP_FAILED {
            return std::ptr::null_mut();
        }
        let start = p as usize;
        let aligned = round_up(start, HUGE);
        if aligned > start {
            libc::munmap(p, aligned - start);
        }
        let tail = start + total - (aligned + len);
        if tail > 0 {
            libc::munmap((aligned + len) as *mut libc::c_void, tail);
        }
        #[cfg(target_os = "linux")]
        if huge {
            libc::madvise(aligned as *mut libc::c_void, len, libc::MADV_HUGEPAGE);
        }
        aligned as *mut u8
    }
    #[cfg(not(unix))]
    // SAFETY: valid non-zero layout.
    unsafe {
        let _ = huge;
        alloc_zeroed(Layout::from_size_align(len, HUGE).expect("layout"))
    }
}

fn unmap_huge(p: *mut u8, len: usize) {
    #[cfg(unix)]
    // SAFETY: (p, len) is exactly a range returned by map_huge.
    unsafe {
        libc::munmap(p as *mut libc::c_void, len);
    }
    #[cfg(not(unix))]
    // SAFETY: allocated by map_huge with this layout.
    unsafe {
        dealloc(p, Layout::from_size_align(len, HUGE).expect("layout"))
    }
}

struct ArenaInner {
    regions: Vec<(usize, usize)>,
    cur: usize,
    end: usize,
    used: usize,
}

/// Bump allocator over huge-page regions (per table).
pub struct Arena {
    inner: Mutex<ArenaInner>,
    huge: bool,
}

// SAFETY: the raw addresses are only handed out, never dereferenced here.
unsafe impl Send for Arena {}
unsafe impl Sync for Arena {}

impl Default for Arena {
    fn default() -> Self {
        Arena::new(true)
    }
}

impl Arena {
    /// An arena of ordinary pages, for short-lived bulk copies (store captures): memory
    /// advised for huge pages is faulted in by compacting memory first, which made a
    /// capture's first copy of 2M rows 7x slower (2.3 s instead of 0.34 s of CPU).
    pub fn small_pages() -> Self {
        Arena::new(false)
    }

    fn new(huge: bool) -> Self {
        Arena { inner: Mutex::new(ArenaInner { regions: Vec::new(), cur: 0, end: 0, used: 0 }), huge }
    }

    /// Allocate `bytes` (64-byte aligned). Never freed individually. A small-page arena
    /// faults the pages in at once (`MADV_POPULATE_WRITE`, outside the lock): a third less
    /// CPU for a capture's copy than a page fault per 4 KiB.
    pub fn alloc(&self, bytes: usize) -> *mut u8 {
        let p = {
            let mut g = self.inner.lock();
            let mut p = round_up(g.cur, 64);
            if g.cur == 0 || p + bytes > g.end {
                let len = REGION.max(round_up(bytes, HUGE));
                let r = map_aligned(len, self.huge);
                if r.is_null() {
                    handle_alloc_error(Layout::from_size_align(bytes.max(1), 64).unwrap_or(Layout::new::<u64>()));
                }
                g.regions.push((r as usize, len));
                g.cur = r as usize;
                g.end = r as usize + len;
                p = g.cur;
            }
            g.cur = p + bytes;
            g.used += bytes;
            p
        };
        #[cfg(target_os = "linux")]
        if !self.huge && bytes > 0 {
            let lo = p & !4095;
            let hi = round_up(p + bytes, 4096);
            // SAFETY: [lo, hi) lies within a region this arena mapped (regions are 2 MiB
            // multiples at 2 MiB-aligned addresses); populating only faults pages in and never
            // changes their contents. Kernels before 5.14 refuse the advice (EINVAL): the
            // pages are then faulted in on first touch.
            unsafe { libc::madvise(lo as *mut libc::c_void, hi - lo, libc::MADV_POPULATE_WRITE) };
        }
        p as *mut u8
    }

    /// Bytes handed out to buffers.
    pub fn used_bytes(&self) -> usize {
        self.inner.lock().used
    }
    /// Bytes of address space mapped (untouched pages use no memory).
    pub fn mapped_bytes(&self) -> usize {
        self.inner.lock().regions.iter().map(|r| r.1).sum()
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        for &(p, len) in &self.inner.lock().regions {
            unmap_huge(p as *mut u8, len);
        }
    }
}

#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Kind {
    Empty,
    Heap,
    Arena,
    Mmap(usize),
}

/// Plain numbers: every bit pattern, all-zero included, is a valid value (see `RawBuf::zeroed`).
pub trait Pod: Copy {}
impl Pod for u8 {}
impl Pod for u16 {}
impl Pod for u32 {}
impl Pod for u64 {}
impl Pod for f32 {}
impl Pod for half::f16 {}
impl Pod for half::bf16 {}

/// A fixed-capacity buffer of plain numbers (no per-element drop).
pub struct RawBuf<T: Copy> {
    ptr: NonNull<T>,
    len: usize,
    cap: usize,
    kind: Kind,
}

// SAFETY: RawBuf owns (or exclusively borrows from its arena) its memory like a Vec<T>.
unsafe impl<T: Copy + Send> Send for RawBuf<T> {}
unsafe impl<T: Copy + Sync> Sync for RawBuf<T> {}

impl<T: Copy> Default for RawBuf<T> {
    fn default() -> Self {
        RawBuf { ptr: NonNull::dangling(), len: 0, cap: 0, kind: Kind::Empty }
    }
}

impl<T: Copy> RawBuf<T> {
    pub fn capacity(&self) -> usize {
        self.cap
    }
    pub fn is_heap(&self) -> bool {
        self.kind == Kind::Heap
    }

    fn allocate(cap: usize, arena: Option<&Arena>, big: bool) -> (NonNull<T>, usize, Kind) {
        let elem = std::mem::size_of::<T>().max(1);
        let bytes = cap * elem;
        if cap == 0 {
            return (NonNull::dangling(), 0, Kind::Empty);
        }
        if let Some(a) = arena {
            let p = a.alloc(bytes) as *mut T;
            // SAFETY: arena never returns null (aborts on failure).
            return (unsafe { NonNull::new_unchecked(p) }, cap, Kind::Arena);
        }
        // A dedicated 2 MiB-aligned mapping advised for huge pages, rounded up
        // only to 4 KiB: full 2 MiB extents get huge pages, the tail small ones.
        if big && bytes >= MMAP_MIN {
            let len = round_up(bytes, 4096);
            let p = map_huge(len) as *mut T;
            match NonNull::new(p) {
                Some(p) => return (p, len / elem, Kind::Mmap(len)),
                None => handle_alloc_error(Layout::from_size_align(bytes, 64).unwrap_or(Layout::new::<u64>())),
            }
        }
        let layout = Layout::array::<T>(cap).unwrap_or_else(|_| handle_alloc_error(Layout::new::<u64>()));
        // SAFETY: non-zero size.
        let p = unsafe { alloc(layout) } as *mut T;
        match NonNull::new(p) {
            Some(p) => (p, cap, Kind::Heap),
            None => handle_alloc_error(layout),
        }
    }

    fn release(&mut self) {
        match self.kind {
            Kind::Heap => {
                if let Ok(layout) = Layout::array::<T>(self.cap) {
                    // SAFETY: allocated with this layout.
                    unsafe { dealloc(self.ptr.as_ptr() as *mut u8, layout) }
                }
            }
            Kind::Mmap(len) => unmap_huge(self.ptr.as_ptr() as *mut u8, len),
            Kind::Arena | Kind::Empty => {}
        }
        self.kind = Kind::Empty;
        self.ptr = NonNull::dangling();
        self.cap = 0;
        self.len = 0;
    }

    /// Grow to exactly `new_cap` elements (from `arena` if given), keeping contents.
    pub fn grow_to(&mut self, new_cap: usize, arena: Option<&Arena>) {
        if new_cap <= self.cap {
            return;
        }
        let (p, cap, kind) = Self::allocate(new_cap, arena, false);
        // SAFETY: both regions are valid for len elements and do not overlap.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.as_ptr(), p.as_ptr(), self.len) };
        let len = self.len;
        self.release();
        self.ptr = p;
        self.cap = cap;
        self.kind = kind;
        self.len = len;
    }

    /// A buffer of `n` copies of `v`; large ones (>= 2 MiB, with `huge`) get a
    /// dedicated 2 MiB-aligned `MADV_HUGEPAGE` mapping whose 4 KiB-rounded size
    /// becomes the capacity (see `capacity()`).
    pub fn filled(n: usize, v: T, huge: bool) -> Self {
        let (p, cap, kind) = Self::allocate(n, None, huge);
        let mut b = RawBuf { ptr: p, len: 0, cap, kind };
        b.extend_fill(cap, v);
        b
    }

    /// A buffer of `n` zeros from memory handed out zeroed (no fill pass: the kernel's fresh
    /// pages, or `alloc_zeroed`); with `huge`, one of >= 2 MiB is a dedicated 2 MiB-aligned
    /// `MADV_HUGEPAGE` mapping (as in `filled`), whose pages are faulted in as they are
    /// first written.
    pub fn zeroed(n: usize, huge: bool) -> Self
    where
        T: Pod,
    {
        let elem = std::mem::size_of::<T>().max(1);
        if n == 0 {
            return RawBuf::default();
        }
        if huge && n * elem >= MMAP_MIN {
            let len = round_up(n * elem, 4096);
            return match NonNull::new(map_huge(len) as *mut T) {
                // The mapping reads as zeros, a valid `T` (Pod).
                Some(p) => RawBuf { ptr: p, len: n, cap: len / elem, kind: Kind::Mmap(len) },
                None => handle_alloc_error(Layout::from_size_align(n * elem, 64).unwrap_or(Layout::new::<u64>())),
            };
        }
        let layout = Layout::array::<T>(n).unwrap_or_else(|_| handle_alloc_error(Layout::new::<u64>()));
        // SAFETY: non-zero size; zeroed memory is a valid `T` (Pod).
        let p = unsafe { alloc_zeroed(layout) } as *mut T;
        match NonNull::new(p) {
            Some(p) => RawBuf { ptr: p, len: n, cap: n, kind: Kind::Heap },
            None => handle_alloc_error(layout),
        }
    }

    /// A copy of `src` with capacity `src.len()` (from `arena` if given).
    pub fn copy_of(src: &[T], arena: Option<&Arena>) -> Self {
        let (p, cap, kind) = Self::allocate(src.len(), arena, false);
        // SAFETY: `p` is valid for `cap >= src.len()` elements and does not overlap `src`.
        unsafe { std::ptr::copy_nonoverlapping(src.as_ptr(), p.as_ptr(), src.len()) };
        RawBuf { ptr: p, len: src.len(), cap, kind }
    }

    #[inline(always)]
    pub fn push(&mut self, v: T) {
        assert!(self.len < self.cap, "RawBuf overflow");
        // SAFETY: len < cap.
        unsafe { self.ptr.as_ptr().add(self.len).write(v) };
        self.len += 1;
    }

    #[inline]
    pub fn extend_fill(&mut self, n: usize, v: T) {
        assert!(self.len + n <= self.cap, "RawBuf overflow");
        for i in 0..n {
            // SAFETY: len + i < cap.
            unsafe { self.ptr.as_ptr().add(self.len + i).write(v) };
        }
        self.len += n;
    }
}

impl<T: Copy> Drop for RawBuf<T> {
    fn drop(&mut self) {
        self.release();
    }
}

impl<T: Copy> Deref for RawBuf<T> {
    type Target = [T];
    #[inline(always)]
    fn deref(&self) -> &[T] {
        // SAFETY: ptr is valid for len initialized elements (dangling with len 0 is fine).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }
}

impl<T: Copy> DerefMut for RawBuf<T> {
    #[inline(always)]
    fn deref_mut(&mut self) -> &mut [T] {
        // SAFETY: as above, and we own the memory exclusively.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }
}

/// Hint the CPU to bring the cache line at `p` into L1 (a no-op off x86_64).
#[inline(always)]
pub(crate) fn prefetch<T>(p: *const T) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: prefetch is a hint; it never faults, even on invalid addresses.
    unsafe {
        std::arch::x86_64::_mm_prefetch(p as *const i8, std::arch::x86_64::_MM_HINT_T0);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Raw pointer that may be shared between rayon tasks writing disjoint ranges.
#[derive(Clone, Copy)]
pub struct SendPtr<T>(pub *mut T);
// SAFETY: users only write disjoint regions through it (in `table`, each batch position
// belongs to one shard, and one task writes that shard's positions).
unsafe impl<T> Send for SendPtr<T> {}
// SAFETY: as for Send: shared references only lead to writes of disjoint regions.
unsafe impl<T> Sync for SendPtr<T> {}

impl<T> SendPtr<T> {
    /// The raw pointer (a method, so closures capture the whole Sync wrapper).
    #[inline(always)]
    pub fn get(self) -> *mut T {
        self.0
    }
}

/// A file mapped shared, read and written by copying: no syscall per access. `grow`
/// allocates the file's blocks first (`posix_fallocate`), so that a full disk is an error of
/// `grow`, never a SIGBUS on a write into the mapping; a read the device cannot serve (an
/// I/O error) does raise SIGBUS, and ends the process.
pub struct FileMap {
    file: std::fs::File,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: the mapping is owned like a Vec: `&self` only copies out of it, and remapping or
// writing takes `&mut self`.
unsafe impl Send for FileMap {}
unsafe impl Sync for FileMap {}

impl FileMap {
    /// `file`, empty, opened for reading and writing.
    pub fn new(file: std::fs::File) -> Self {
        FileMap { file, ptr: std::ptr::null_mut(), len: 0 }
    }
    pub fn file(&self) -> &std::fs::File {
        &self.file
    }
    /// Bytes mapped (and allocated on disk).
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Make the file (and its mapping) `len` bytes long, `len` past the current length.
    pub fn grow(&mut self, len: usize) -> std::io::Result<()> {
        use std::os::fd::AsRawFd;
        debug_assert!(len > self.len);
        // SAFETY: plain syscalls on our own descriptor and mapping; the old mapping is
        // replaced only on success.
        unsafe {
            let rc = libc::posix_fallocate(self.file.as_raw_fd(), 0, len as libc::off_t);
            if rc != 0 {
                return Err(std::io::Error::from_raw_os_error(rc));
            }
            let p = if self.ptr.is_null() {
                libc::mmap(
                    std::ptr::null_mut(),
                    len,
                    libc::PROT_READ | libc::PROT_WRITE,
                    libc::MAP_SHARED,
                    self.file.as_raw_fd(),
                    0,
                )
            } else {
                libc::mremap(self.ptr as *mut libc::c_void, self.len, len, libc::MREMAP_MAYMOVE)
            };
            if p == libc::MAP_FAILED {
                return Err(std::io::Error::last_os_error());
            }
            // Rows are read one at a time, anywhere in the file: read-ahead would be waste.
            libc::madvise(p, len, libc::MADV_RANDOM);
            self.ptr = p as *mut u8;
        }
        self.len = len;
        Ok(())
    }

    /// Unmap and truncate the file to nothing (its blocks go back to the disk).
    pub fn clear(&mut self) -> std::io::Result<()> {
        self.unmap();
        self.file.set_len(0)
    }

    fn unmap(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: our own mapping of `len` bytes.
            unsafe { libc::munmap(self.ptr as *mut libc::c_void, self.len) };
            self.ptr = std::ptr::null_mut();
            self.len = 0;
        }
    }

    /// Copy `buf.len()` bytes at `at` out of the file. Panics past its end.
    pub fn read(&self, at: usize, buf: &mut [u8]) {
        assert!(at + buf.len() <= self.len, "read past the end of a mapped file");
        // SAFETY: in bounds of the mapping, which `&self` keeps in place.
        unsafe { std::ptr::copy_nonoverlapping(self.ptr.add(at), buf.as_mut_ptr(), buf.len()) };
    }

    /// Copy `buf` into the file at `at`. Panics past its end.
    pub fn write(&mut self, at: usize, buf: &[u8]) {
        assert!(at + buf.len() <= self.len, "write past the end of a mapped file");
        // SAFETY: in bounds of the mapping; `&mut self` excludes readers of this handle (a
        // capture reads pinned records through its own descriptor, never these bytes).
        unsafe { std::ptr::copy_nonoverlapping(buf.as_ptr(), self.ptr.add(at), buf.len()) };
    }
}

impl Drop for FileMap {
    fn drop(&mut self) {
        self.unmap();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rawbuf_grow_and_arena() {
        let a = Arena::default();
        let mut b: RawBuf<u64> = RawBuf::default();
        b.grow_to(4, None);
        for i in 0..4 {
            b.push(i);
        }
        b.grow_to(1000, Some(&a));
        b.extend_fill(996, 7);
        assert_eq!(b.len(), 1000);
        assert_eq!(&b[..5], &[0, 1, 2, 3, 7]);
        assert!(a.used_bytes() >= 8000);
        let big: RawBuf<u32> = RawBuf::filled(1 << 20, u32::MAX, true);
        assert_eq!(big.capacity(), 1 << 20);
        assert!(big.iter().all(|&x| x == u32::MAX));
        let small: RawBuf<u32> = RawBuf::filled(10, 1, true);
        assert_eq!(small.len(), 10);
        for (n, huge) in [(0, true), (7, true), (3 << 20, true), (3 << 20, false)] {
            let mut z: RawBuf<u16> = RawBuf::zeroed(n, huge);
            assert_eq!(z.len(), n);
            assert!(z.capacity() >= n);
            assert!(z.iter().all(|&x| x == 0));
            if n > 0 {
                z[n - 1] = 5;
                assert_eq!(z[n - 1], 5);
            }
        }
    }
}
