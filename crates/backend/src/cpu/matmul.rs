//! y = x Wᵀ for f32 activations x `[t, k]` and a weight W `[n, k]` in a GGML block format,
//! read straight from the model file's memory map.
//!
//! - One token (decode): each thread takes a range of rows; a row's blocks are dequantized in
//!   registers and multiplied into the activations (`gemv`).
//! - Several tokens (prefill): 32- or 16-row panels of W are dequantized once into a transposed
//!   f32 scratch panel, then a register-blocked micro-kernel multiplies it with every token
//!   (`gemm`), so dequantization is paid once per panel, not once per token.
//! - Quantized formats on AVX-512 VNNI, unless exact activations are asked for: 8-bit
//!   activations, `vnni_gemm::gemv` / `gemv_tokens` for decode rows and `vnni_gemm::gemm` for prompts.

use super::formats::{self, Block, Format};
use super::micro::{self, MicroKernel};
pub use super::simd::Level as CpuLevel;
use super::simd::{level, multiversion, Level, MulAdd};
use super::threads::{parallel_ranges, SharedOut};
use std::cell::RefCell;

/// Raw weight bytes the kernels read (usually a slice of the model's memory map).
pub trait WeightBytes: Send + Sync {
    fn bytes(&self) -> &[u8];

    /// Tells the OS that bytes `range` (of `bytes()`) are not needed for now: a memory map drops
    /// those pages from the process (read in again if touched). Nothing for owned buffers.
    fn release_pages(&self, range: std::ops::Range<usize>) {
        let _ = range;
    }
}

impl WeightBytes for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

/// One or more weight matrices with the same format and input width, stacked along the output
/// (e.g. Q, K and V, or gate and up): one parallel region computes all of them.
pub struct CpuMatmul {
    format: Format,
    rows: usize,
    cols: usize,
    parts: Vec<Part>,
    /// Q8_0 rows repacked for 8-bit decode (`head`), used instead of the file's
    /// blocks for one-token products.
    #[cfg(target_arch = "x86_64")]
    packed: Option<super::q8_packed::Q8Rows>,
}

struct Part {
    /// The blocks as the model file has them (usually its memory map).
    data: std::sync::Arc<dyn WeightBytes>,
    /// First output row of this part in the stack.
    start: usize,
    rows: usize,
    placement: Placement,
}

/// Where the kernels read a part's weights.
enum Placement {
    /// In `data` (the file's map): `FERROLM_MMAP_WEIGHTS=1`, or huge pages were refused.
    File,
    /// `data` copied into huge pages (`HugeBuf`).
    Copy(super::alloc::HugeBuf),
    /// Repacked for the 8-bit kernels (`cpu::vnni_packed`); the f32-activation kernels read
    /// `data`, whose pages come back on demand.
    #[cfg(target_arch = "x86_64")]
    Repacked(super::alloc::HugeBuf),
}

impl Part {
    /// The blocks in the file's layout, from the fastest place that has them.
    fn blocks(&self) -> &[u8] {
        match &self.placement {
            Placement::Copy(c) => c.bytes(),
            _ => self.data.bytes(),
        }
    }

    /// The rows repacked for the 8-bit kernels, if they were.
    #[cfg(target_arch = "x86_64")]
    fn repacked(&self) -> Option<&[u8]> {
        match &self.placement {
            Placement::Repacked(r) => Some(r.bytes()),
            _ => None,
        }
    }
}

impl CpuMatmul {
    /// `rows` = output features, `cols` = input features (a multiple of the block size).
    pub fn new(format: Format, rows: usize, cols: usize, data: std::sync::Arc<dyn WeightBytes>) -> Option<Self> {
        Self::stacked(format, cols, vec![(data, rows)])
    }

    /// Whether `stacked` takes these matrices (their sizes match the format and width).
    pub fn accepts(format: Format, cols: usize, parts: &[(std::sync::Arc<dyn WeightBytes>, usize)]) -> bool {
        let row_bytes = cols / format.block() * format.block_bytes();
        cols % format.block() == 0 && parts.iter().all(|(data, rows)| data.bytes().len() == rows * row_bytes)
    }

    /// Matrices `(bytes, rows)` stacked in order; None if a size does not match. The weights
    /// are copied (or repacked) into huge pages here (see `copy_to_huge_pages`).
    pub fn stacked(format: Format, cols: usize, parts: Vec<(std::sync::Arc<dyn WeightBytes>, usize)>) -> Option<Self> {
        let mut m = Self::in_place(format, cols, parts)?;
        m.place();
        Some(m)
    }

    /// An output head (one token per step: logits are computed for the last position only).
    /// Q8_0 with 8-bit activations is repacked for decode (`cpu::q8_packed`: half the
    /// instructions per row, bit-identical results) straight from the file, whose pages are
    /// released as packing goes (an embedding lookup of a tied head reads them again on demand);
    /// the f32 kernels read the file. Other heads are placed as `stacked` places them.
    pub fn head(format: Format, cols: usize, parts: Vec<(std::sync::Arc<dyn WeightBytes>, usize)>) -> Option<Self> {
        let mut m = Self::in_place(format, cols, parts)?;
        #[cfg(target_arch = "x86_64")]
        if format == Format::Q8_0 && m.parts.len() == 1 && super::vnni::available() && !super::exact_activations() {
            let data = &m.parts[0].data;
            m.packed = Some(super::q8_packed::Q8Rows::pack(data.bytes(), m.rows, m.cols, &|r| data.release_pages(r)));
            return Some(m);
        }
        m.place();
        Some(m)
    }

    /// The kernels' weights where the kernels read them best: repacked for the 8-bit kernels
    /// (x86), else copied into huge pages.
    fn place(&mut self) {
        #[cfg(target_arch = "x86_64")]
        self.repack_for_int8();
        self.copy_to_huge_pages();
    }

    /// The matrices as they are (read from `parts` in place).
    fn in_place(format: Format, cols: usize, parts: Vec<(std::sync::Arc<dyn WeightBytes>, usize)>) -> Option<Self> {
        if !Self::accepts(format, cols, &parts) {
            return None;
        }
        let mut start = 0;
        let mut out = Vec::new();
        for (data, rows) in parts {
            out.push(Part {
                data,
                start,
                rows,
                placement: Placement::File,
            });
            start += rows;
        }
        Some(Self {
            format,
            rows: start,
            cols,
            parts: out,
            #[cfg(target_arch = "x86_64")]
            packed: None,
        })
    }

    /// Copies the parts that were not repacked into huge pages (`HugeBuf`: the read bandwidth
    /// of decode nearly doubles), releasing the file's pages as it goes. Where memory for the
    /// copy is refused, the kernels keep reading the file.
    fn copy_to_huge_pages(&mut self) {
        if weights_in_place() {
            return;
        }
        for part in &mut self.parts {
            if !matches!(part.placement, Placement::File) {
                continue;
            }
            let data = &part.data;
            if let Ok(copy) = super::alloc::HugeBuf::copy_of(data.bytes(), &|r| data.release_pages(r)) {
                part.placement = Placement::Copy(copy);
            }
        }
    }

    /// Repacks Q5_0 rows for the 8-bit kernels where those will run (`cpu::vnni_packed`: about
    /// half the instructions per row and pair, the same bytes, bit-identical results), dropping
    /// the file's pages as it goes. The f32-activation kernels keep reading the file, whose
    /// pages come back on demand. Q4_K and Q6_K stay in the file's layout: repacked they took
    /// 33% and 52% more bytes, and decode, bound by memory, was 22% slower for it (the default
    /// 1.5B Q4_K_M: 21.7 → 27.5–29.9 tok/s on 2 cores without; `Vnni::block_scales` decodes
    /// their scales once per super-block instead).
    #[cfg(target_arch = "x86_64")]
    fn repack_for_int8(&mut self) {
        use super::vnni_packed::{pack, Q5_0Pairs, Repacked};
        fn each<R: Repacked>(parts: &mut [Part], cols: usize) {
            for part in parts {
                let data = &part.data;
                // SAFETY: VNNI was detected by the caller.
                if let Ok(rows) = unsafe { pack::<R>(data.bytes(), part.rows, cols, &|r| data.release_pages(r)) } {
                    part.placement = Placement::Repacked(rows);
                }
            }
        }
        if !super::vnni::available() || super::exact_activations() || self.cols % 64 != 0 {
            return;
        }
        match self.format {
            Format::Q5_0 => each::<Q5_0Pairs>(&mut self.parts, self.cols),
            _ => {}
        }
    }

    /// Whether the 8-bit kernels read repacked rows (`repack_for_int8`).
    #[cfg(target_arch = "x86_64")]
    fn repacked(&self) -> bool {
        self.parts.iter().all(|p| p.repacked().is_some())
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    pub fn cols(&self) -> usize {
        self.cols
    }

    pub fn format(&self) -> Format {
        self.format
    }

    /// x `[t, cols]` → y `[t, rows]`.
    pub fn forward(&self, x: &[f32], t: usize, y: &mut [f32]) {
        self.forward_at(level(), x, t, y)
    }

    /// `forward` with the kernels of a given feature level (at most the CPU's).
    pub fn forward_at(&self, level: Level, x: &[f32], t: usize, y: &mut [f32]) {
        self.forward_with(level, super::exact_activations(), x, t, y)
    }

    /// `forward_at`, choosing exact (f32) or 8-bit activations for this call only (tests and
    /// comparisons; others follow the process-wide `set_exact_activations`).
    pub fn forward_with(&self, level: Level, exact: bool, x: &[f32], t: usize, y: &mut [f32]) {
        self.forward_kind(level, exact, x, t, t == 1, SharedOut::new(y))
    }

    /// x `[t, cols]` → y `[t, rows]` where the first `decode_rows` tokens are decode rows (one
    /// token of each of several sequences): they go through the decode kernels, so that each
    /// one's result is bit-identical to that token's product alone; the other tokens (prompt
    /// rows) through the prefill kernels, even one alone, so that a prompt's results do not
    /// depend on how it was cut into chunks.
    pub fn forward_rows(&self, x: &[f32], t: usize, decode_rows: usize, y: &mut [f32]) {
        self.forward_rows_into(x, t, decode_rows, SharedOut::new(y))
    }

    /// `forward_rows` into a buffer that threads write (`threads::filled_vec`): every element
    /// of `y` is written.
    pub fn forward_rows_into(&self, x: &[f32], t: usize, decode_rows: usize, y: SharedOut) {
        self.rows_with(level(), super::exact_activations(), x, t, decode_rows, y)
    }

    /// `forward_rows` with a given feature level and choice of activations (see `forward_with`).
    pub fn forward_rows_with(&self, level: Level, exact: bool, x: &[f32], t: usize, decode_rows: usize, y: &mut [f32]) {
        self.rows_with(level, exact, x, t, decode_rows, SharedOut::new(y))
    }

    fn rows_with(&self, level: Level, exact: bool, x: &[f32], t: usize, decode_rows: usize, y: SharedOut) {
        let d = decode_rows.min(t);
        let (xd, xp) = x.split_at(d * self.cols);
        let split = d * self.rows;
        if d > 0 {
            self.forward_kind(level, exact, xd, d, true, y.part(0, split));
        }
        if t > d {
            self.forward_kind(level, exact, xp, t - d, false, y.part(split, y.len() - split));
        }
    }

    /// The product of `t` tokens, all decode rows (`decode`) or all prompt rows.
    fn forward_kind(&self, level: Level, exact: bool, x: &[f32], t: usize, decode: bool, y: SharedOut) {
        assert_eq!(x.len(), t * self.cols);
        assert_eq!(y.len(), t * self.rows);
        let a = Args { level, exact, decode, m: self, x, t, y };
        match self.format {
            Format::F32 => run::<formats::F32>(&a),
            Format::F16 => run::<formats::F16>(&a),
            Format::BF16 => run::<formats::BF16>(&a),
            Format::Q4_0 => run::<formats::Q4_0>(&a),
            Format::Q4_1 => run::<formats::Q4_1>(&a),
            Format::Q5_0 => run::<formats::Q5_0>(&a),
            Format::Q5_1 => run::<formats::Q5_1>(&a),
            Format::Q8_0 => run::<formats::Q8_0>(&a),
            Format::Q4K => run::<formats::Q4K>(&a),
            Format::Q6K => run::<formats::Q6K>(&a),
        }
    }
}

struct Args<'a> {
    level: Level,
    /// f32 activations even where an 8-bit kernel exists.
    exact: bool,
    /// Every token is a decode row (decode kernels), else every token is a prompt row.
    decode: bool,
    m: &'a CpuMatmul,
    x: &'a [f32],
    t: usize,
    y: SharedOut,
}

/// What a kernel sees: one part's rows, writing into the stacked output.
#[derive(Clone, Copy)]
struct PartArgs<'a> {
    level: Level,
    w: &'a [u8],
    cols: usize,
    x: &'a [f32],
    t: usize,
    /// Output row stride (all parts) and this part's first output row.
    out_rows: usize,
    out_start: usize,
    y: SharedOut,
}

impl Args<'_> {
    /// Calls `f` for each part overlapping the stacked rows `rows`, with local row ranges.
    fn for_parts(&self, rows: std::ops::Range<usize>, f: impl FnMut(&PartArgs, std::ops::Range<usize>)) {
        self.for_parts_of(rows, false, f)
    }

    /// `for_parts`, with the parts' repacked rows (`CpuMatmul::repack_for_int8`) if `repacked`.
    fn for_parts_of(&self, rows: std::ops::Range<usize>, repacked: bool, mut f: impl FnMut(&PartArgs, std::ops::Range<usize>)) {
        for part in &self.m.parts {
            let lo = rows.start.max(part.start);
            let hi = rows.end.min(part.start + part.rows);
            if lo < hi {
                let pa = PartArgs {
                    level: self.level,
                    w: part_bytes(part, repacked),
                    cols: self.m.cols,
                    x: self.x,
                    t: self.t,
                    out_rows: self.m.rows,
                    out_start: part.start,
                    y: self.y,
                };
                f(&pa, lo - part.start..hi - part.start);
            }
        }
    }
}

/// `FERROLM_MMAP_WEIGHTS=1`: the kernels read the model file's memory map in place instead of a
/// copy in huge pages (less memory while the page cache also holds the file; slower decode).
fn weights_in_place() -> bool {
    static IN_PLACE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *IN_PLACE.get_or_init(|| std::env::var("FERROLM_MMAP_WEIGHTS").is_ok_and(|v| v == "1"))
}

/// The bytes a kernel reads for `part`: its repacked rows (8-bit kernels of repacked formats)
/// or its blocks.
fn part_bytes(part: &Part, repacked: bool) -> &[u8] {
    #[cfg(target_arch = "x86_64")]
    if repacked {
        return part.repacked().expect("repacked rows");
    }
    let _ = repacked;
    part.blocks()
}

/// A format with every kernel: portable, and on x86 the AVX-512 register dequantizer.
#[cfg(target_arch = "x86_64")]
pub trait KernelBlock: Block + super::x86::Dq16 {}
#[cfg(target_arch = "x86_64")]
impl<T: Block + super::x86::Dq16> KernelBlock for T {}
#[cfg(not(target_arch = "x86_64"))]
pub trait KernelBlock: Block {}
#[cfg(not(target_arch = "x86_64"))]
impl<T: Block> KernelBlock for T {}

fn run<B: KernelBlock + 'static>(a: &Args) {
    let (rows, cols) = (a.m.rows, a.m.cols);
    let worth = rows * cols * a.t >= 1 << 15;
    let int8 = match (a.decode, a.t) {
        (true, 1) => Int8::Gemv,
        (true, _) => Int8::GemvTokens,
        (false, _) => Int8::Gemm,
    };
    if int8_product(a, worth, int8) {
        return;
    }
    if a.decode && a.t == 1 {
        parallel_ranges(rows, 4, worth, |rows| a.for_parts(rows, |p, rows| gemv_part::<B>(p, rows)));
    } else if a.decode {
        parallel_ranges(rows, 4, worth, |rows| a.for_parts(rows, |p, rows| gemv_tokens_part::<B>(p, rows)));
    } else {
        let nr = panel_width(a.level);
        let xp = pack_activations(a.x, a.t, cols, tile_height(a.level));
        parallel_ranges(rows, nr, worth, |rows| {
            // Scratch is taken here, outside the multiversioned kernel: closures do not inherit
            // the kernel's target features.
            SCRATCH.with(|s| {
                let (row_buf, panel) = &mut *s.borrow_mut();
                row_buf.resize(16 * cols, 0.0);
                panel.resize(cols * nr, 0.0);
                a.for_parts(rows, |p, rows| gemm::<B>(p.level, p, &xp, rows, row_buf, panel))
            })
        });
    }
}

/// The 8-bit products (AVX-512 VNNI, used where the format has a kernel and exact activations
/// were not asked for): decode of one token, of several, and prefill, all `vnni_gemm`'s (one
/// arithmetic, so each output has the same bits whichever ran it).
#[derive(Clone, Copy)]
enum Int8 {
    Gemv,
    GemvTokens,
    Gemm,
}

/// Runs the 8-bit product `kind` for the weights' format; false where it does not apply.
fn int8_product(a: &Args, worth: bool, kind: Int8) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use super::vnni_packed as packed;
        fn run<V: super::vnni::Vnni>(a: &Args, worth: bool, kind: Int8, repacked: bool) {
            match kind {
                Int8::Gemv => int8_gemv_with::<V>(a, worth, repacked),
                Int8::GemvTokens => int8_gemv_tokens_with::<V>(a, worth, repacked),
                Int8::Gemm => int8_gemm_with::<V>(a, worth, repacked),
            }
        }
        if !int8_allowed(a) {
            return false;
        }
        match (a.m.format, a.m.repacked()) {
            (Format::Q5_0, true) => run::<packed::Q5_0Pairs>(a, worth, kind, true),
            (Format::Q4_0, _) => run::<formats::Q4_0>(a, worth, kind, false),
            (Format::Q4_1, _) => run::<formats::Q4_1>(a, worth, kind, false),
            (Format::Q5_0, _) => run::<formats::Q5_0>(a, worth, kind, false),
            (Format::Q5_1, _) => run::<formats::Q5_1>(a, worth, kind, false),
            (Format::Q8_0, _) => run::<formats::Q8_0>(a, worth, kind, false),
            (Format::Q4K, _) => run::<formats::Q4K>(a, worth, kind, false),
            (Format::Q6K, _) => run::<formats::Q6K>(a, worth, kind, false),
            _ => return false,
        }
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (a, worth, kind);
        false
    }
}

#[cfg(target_arch = "x86_64")]
fn int8_allowed(a: &Args) -> bool {
    a.level == Level::Avx512 && super::vnni::available() && !a.exact
}

/// A pointer to quantized activation rows that threads fill disjointly.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct QRows(*mut super::vnni::QPair);
// SAFETY: each thread writes only the rows of its own tokens.
#[cfg(target_arch = "x86_64")]
unsafe impl Send for QRows {}
#[cfg(target_arch = "x86_64")]
unsafe impl Sync for QRows {}

/// Quantizes every token's activations (threads split the tokens), then every thread
/// multiplies its weight rows with all of them.
#[cfg(target_arch = "x86_64")]
fn int8_gemm_with<V: super::vnni::Vnni>(a: &Args, worth: bool, repacked: bool) {
    use super::{vnni, vnni_gemm};
    let (cols, pairs) = (a.m.cols, a.m.cols.div_ceil(64));
    let len = vnni_gemm::pairs_len(a.t, pairs);
    QX.with(|buf| {
        let mut buf = buf.borrow_mut();
        if buf.len() < len {
            buf.resize(len, vnni::QPair::ZERO);
        }
        let q = QRows(buf.as_mut_ptr());
        parallel_ranges(a.t, 1, worth, |toks| {
            let q = q;
            for tok in toks {
                // SAFETY: VNNI was detected; tokens' pairs are disjoint and inside `buf`.
                unsafe {
                    let at = q.0.add(vnni_gemm::pair_index(tok, 0, pairs));
                    vnni::quantize_strided::<V>(&a.x[tok * cols..(tok + 1) * cols], at, vnni_gemm::TOKENS)
                }
            }
        });
        let xq: &[vnni::QPair] = &buf[..len];
        parallel_ranges(a.m.rows, 4, worth, |rows| {
            a.for_parts_of(rows, repacked, |p, rows| {
                // SAFETY: VNNI was detected; `xq` holds x for this format; each thread writes
                // only its own rows (columns of y) of every token.
                unsafe { vnni_gemm::gemm::<V>(p.w, p.cols, xq, p.t, rows, p.y.ptr().add(p.out_start), p.out_rows) }
            })
        });
    });
}

#[cfg(target_arch = "x86_64")]
thread_local! {
    /// The quantized activation row of the current product, reused across calls.
    static QX: RefCell<Vec<super::vnni::QPair>> = const { RefCell::new(Vec::new()) };
}

/// Quantizes x once on the calling thread, then every thread multiplies its rows with it.
#[cfg(target_arch = "x86_64")]
fn int8_gemv_with<V: super::vnni::Vnni>(a: &Args, worth: bool, repacked: bool) {
    use super::vnni;
    QX.with(|buf| {
        let mut buf = buf.borrow_mut();
        // SAFETY: `vnni::available()` was checked by the caller.
        unsafe { vnni::quantize::<V>(a.x, &mut buf) };
        let xq: &[vnni::QPair] = &buf;
        if let Some(packed) = &a.m.packed {
            // Only Q8_0 is packed, and `V` is the matrix's format: xq is Q8_0's.
            parallel_ranges(a.m.rows, 4, worth, |rows| {
                // SAFETY: VNNI was detected; ranges start at multiples of 4; each thread
                // writes only its own rows.
                unsafe { packed.gemv(xq, rows, &mut |r, v| a.y.write(r, v)) }
            });
            return;
        }
        parallel_ranges(a.m.rows, 4, worth, |rows| {
            a.for_parts_of(rows, repacked, |p, rows| {
                // SAFETY: VNNI was detected; `xq` holds x for this format; each thread writes
                // only its own rows.
                unsafe { super::vnni_gemm::gemv::<V>(p.w, p.cols, xq, rows, &mut |r, v| p.y.write(p.out_start + r, v)) }
            })
        });
    });
}

/// Decode of several tokens with 8-bit activations: each token quantized once (token-major),
/// then every thread multiplies its rows with all of them (`vnni_gemm::gemv_tokens`,
/// bit-identical to `int8_gemv_with` per token).
#[cfg(target_arch = "x86_64")]
fn int8_gemv_tokens_with<V: super::vnni::Vnni>(a: &Args, worth: bool, repacked: bool) {
    use super::vnni;
    let (cols, pairs, t) = (a.m.cols, a.m.cols.div_ceil(64), a.t);
    QX.with(|buf| {
        let mut buf = buf.borrow_mut();
        // Grown, never cleared: quantizing writes every field of every pair. The tokens are
        // quantized over the threads (on the calling thread alone this was ~3% of a
        // 16-sequence step, the workers waiting).
        if buf.len() < t * pairs {
            buf.resize(t * pairs, vnni::QPair::ZERO);
        }
        let q = QRows(buf.as_mut_ptr());
        parallel_ranges(t, 1, worth && t >= 4, |toks| {
            let q = q;
            for tok in toks {
                // SAFETY: VNNI was checked by the caller; tokens' pairs are disjoint and inside `buf`.
                unsafe { vnni::quantize_strided::<V>(&a.x[tok * cols..(tok + 1) * cols], q.0.add(tok * pairs), 1) };
            }
        });
        let xq: &[vnni::QPair] = &buf[..t * pairs];
        let out_rows = a.m.rows;
        if let Some(packed) = &a.m.packed {
            parallel_ranges(out_rows, 4, worth, |rows| {
                // SAFETY: VNNI was detected; ranges start at multiples of 4; each thread
                // writes only its own rows of every token.
                unsafe { packed.gemv_tokens(xq, t, rows, &mut |j, r, v| a.y.write(j * out_rows + r, v)) }
            });
            return;
        }
        parallel_ranges(out_rows, 4, worth, |rows| {
            a.for_parts_of(rows, repacked, |p, rows| {
                // SAFETY (both): VNNI was detected; `xq` holds the tokens for this format; each
                // thread writes only its own rows of every token.
                let mut y = |j: usize, r: usize, v: f32| unsafe { p.y.write(j * p.out_rows + p.out_start + r, v) };
                unsafe { super::vnni_gemm::gemv_tokens::<V>(p.w, p.cols, xq, t, rows, &mut y) }
            })
        });
    });
}

/// Decode of several tokens with f32 activations: `decode_batch` on AVX-512, else the
/// one-token kernel once per token; either way each token's bits are its own `gemv_part`'s.
fn gemv_tokens_part<B: KernelBlock>(p: &PartArgs, rows: std::ops::Range<usize>) {
    #[cfg(target_arch = "x86_64")]
    if p.level == Level::Avx512 {
        // SAFETY (both): AVX-512 was detected; each thread writes only its own rows of every token.
        let mut y = |j: usize, r: usize, v: f32| unsafe { p.y.write(j * p.out_rows + p.out_start + r, v) };
        return unsafe { super::decode_batch::gemv_tokens_f32::<B>(p.w, p.cols, p.x, p.t, rows, &mut y) };
    }
    for j in 0..p.t {
        let one = PartArgs { x: &p.x[j * p.cols..(j + 1) * p.cols], t: 1, out_start: j * p.out_rows + p.out_start, ..*p };
        gemv_part::<B>(&one, rows.clone());
    }
}

fn gemv_part<B: KernelBlock>(p: &PartArgs, rows: std::ops::Range<usize>) {
    #[cfg(target_arch = "x86_64")]
    if p.level == Level::Avx512 {
        // SAFETY: AVX-512 was detected; each thread writes only its own rows.
        return unsafe { super::x86::gemv::<B>(p.w, p.cols, p.x, rows, &mut |r, v| p.y.write(p.out_start + r, v)) };
    }
    gemv::<B>(p.level, p, rows)
}

multiversion!(fn gemv<B: Block>(a: &PartArgs, rows: std::ops::Range<usize>) => gemv_impl);
multiversion!(fn gemm<B: KernelBlock>(a: &PartArgs, xp: &[f32], rows: std::ops::Range<usize>, row_buf: &mut [f32], panel: &mut [f32]) => gemm_impl);

const LANES: usize = 16;

/// Decode: one token against rows `rows`, four rows at a time for instruction-level parallelism.
#[inline(always)]
fn gemv_impl<B: Block, F: MulAdd>(_level: Level, a: &PartArgs, rows: std::ops::Range<usize>) {
    let row_bytes = a.cols / B::N * B::BYTES;
    let mut r = rows.start;
    while r < rows.end {
        let n = (rows.end - r).min(4);
        let mut acc = [[0f32; LANES]; 4];
        let mut buf = [[0f32; 256]; 4];
        for blk in 0..a.cols / B::N {
            let xs = &a.x[blk * B::N..(blk + 1) * B::N];
            for i in 0..n {
                let off = (r + i) * row_bytes + blk * B::BYTES;
                B::dequant(&a.w[off..off + B::BYTES], &mut buf[i][..B::N]);
                for (wc, xc) in buf[i][..B::N].chunks_exact(LANES).zip(xs.chunks_exact(LANES)) {
                    for l in 0..LANES {
                        acc[i][l] = F::mul_add(wc[l], xc[l], acc[i][l]);
                    }
                }
            }
        }
        for i in 0..n {
            // SAFETY: each thread owns a distinct row range.
            unsafe { a.y.write(a.out_start + r + i, acc[i].iter().sum()) };
        }
        r += n;
    }
}

/// Width of a weight panel (output features per micro-kernel tile).
fn panel_width(level: Level) -> usize {
    match level {
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => micro::Avx512::NR,
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => micro::Avx2::NR,
        _ => micro::Portable::NR,
    }
}

/// Tokens per micro-kernel tile.
fn tile_height(level: Level) -> usize {
    match level {
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => micro::Avx512::MR,
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => micro::Avx2::MR,
        _ => micro::Portable::MR,
    }
}

/// Activations regrouped into tiles of `mr` tokens, `[tiles][k][mr]`, zero-padded, so the
/// micro-kernel reads the `mr` values of one k from one cache line.
fn pack_activations(x: &[f32], t: usize, k: usize, mr: usize) -> Vec<f32> {
    let tiles = t.div_ceil(mr);
    let mut xp = vec![0f32; tiles * k * mr];
    let out = SharedOut::new(&mut xp);
    // Split over the threads by tiles: for a long prompt this is a few hundred µs per product.
    parallel_ranges(tiles, 1, t * k >= 1 << 16, |tiles| {
        for tok in tiles.start * mr..(tiles.end * mr).min(t) {
            let (tile, lane) = (tok / mr, tok % mr);
            for (kk, v) in x[tok * k..(tok + 1) * k].iter().enumerate() {
                // SAFETY: each thread writes only its own tiles.
                unsafe { out.write((tile * k + kk) * mr + lane, *v) };
            }
        }
    });
    xp
}

thread_local! {
    /// Per-thread scratch: up to 16 dequantized rows and one transposed panel.
    static SCRATCH: RefCell<(Vec<f32>, Vec<f32>)> = const { RefCell::new((Vec::new(), Vec::new())) };
}

#[inline(always)]
fn gemm_impl<B: KernelBlock, F: MulAdd>(
    level: Level,
    a: &PartArgs,
    xp: &[f32],
    rows: std::ops::Range<usize>,
    row_buf: &mut [f32],
    panel: &mut [f32],
) {
    let _ = std::marker::PhantomData::<F>;
    match level {
        #[cfg(target_arch = "x86_64")]
        Level::Avx512 => gemm_tiles::<B, micro::Avx512>(a, xp, rows, row_buf, panel),
        #[cfg(target_arch = "x86_64")]
        Level::Avx2 => gemm_tiles::<B, micro::Avx2>(a, xp, rows, row_buf, panel),
        _ => gemm_tiles::<B, micro::Portable>(a, xp, rows, row_buf, panel),
    }
}

#[inline(always)]
fn gemm_tiles<B: KernelBlock, K: MicroKernel>(
    a: &PartArgs,
    xp: &[f32],
    rows: std::ops::Range<usize>,
    row_buf: &mut [f32],
    panel: &mut [f32],
) {
    let (mr, nr) = (K::MR, K::NR);
    let mut acc = [0f32; 256];
    let mut p = rows.start;
    while p < rows.end {
        let width = (rows.end - p).min(nr);
        pack_panel::<B>(a, p, width, nr, row_buf, panel);
        for tile in 0..a.t.div_ceil(mr) {
            let xt = &xp[tile * a.cols * mr..(tile + 1) * a.cols * mr];
            // SAFETY: the level (hence the kernel's features) was detected; sizes match.
            unsafe { K::run(a.cols, xt, panel, &mut acc) };
            for i in 0..(a.t - tile * mr).min(mr) {
                let tok = tile * mr + i;
                for j in 0..width {
                    // SAFETY: each thread owns a distinct range of output columns.
                    unsafe { a.y.write(tok * a.out_rows + a.out_start + p + j, acc[i * nr + j]) };
                }
            }
        }
        p += width;
    }
}

#[inline(always)]
fn dequant_row<B: KernelBlock>(level: Level, row: &[u8], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if level == Level::Avx512 {
        // SAFETY: AVX-512 was detected; `row` holds the blocks of `out.len()` values.
        return unsafe { super::x86::dequant_row::<B>(row, out) };
    }
    let _ = level;
    for (blk, o) in row.chunks_exact(B::BYTES).zip(out.chunks_exact_mut(B::N)) {
        B::dequant(blk, o);
    }
}

/// Dequantizes rows p..p+width into `panel` as `[k][nr]` (missing rows stay zero).
#[inline(always)]
fn pack_panel<B: KernelBlock>(a: &PartArgs, p: usize, width: usize, nr: usize, row_buf: &mut [f32], panel: &mut [f32]) {
    let row_bytes = a.cols / B::N * B::BYTES;
    #[cfg(target_arch = "x86_64")]
    if a.level == Level::Avx512 && a.cols % 16 == 0 && nr % 16 == 0 {
        // Sixteen rows at a time, transposed in registers (missing rows as zeros).
        for r0 in (0..nr).step_by(16) {
            let rows = &mut row_buf[..16 * a.cols];
            for (i, out) in rows.chunks_exact_mut(a.cols).enumerate() {
                let r = p + r0 + i;
                if r0 + i < width {
                    dequant_row::<B>(a.level, &a.w[r * row_bytes..(r + 1) * row_bytes], out);
                } else {
                    out.fill(0.0);
                }
            }
            // SAFETY: AVX-512 was detected; the panel holds cols·nr values and r0 + 16 ≤ nr.
            unsafe { super::x86::transpose16(rows, a.cols, panel.as_mut_ptr().add(r0), nr) };
        }
        return;
    }
    if width < nr {
        panel.fill(0.0);
    }
    for r in 0..width {
        let row = &a.w[(p + r) * row_bytes..(p + r + 1) * row_bytes];
        dequant_row::<B>(a.level, row, &mut row_buf[..a.cols]);
        for (k, v) in row_buf[..a.cols].iter().enumerate() {
            panel[k * nr + r] = *v;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};
    use std::sync::Arc;

    /// Against dequantize-then-matmul in candle, for every format, decode and prefill shapes.
    #[test]
    fn matches_dequantized_reference() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let (n, k) = (70, 512);
        let w = Tensor::randn(0f32, 1.0, (n, k), &dev)?;
        for dt in [
            GgmlDType::F32,
            GgmlDType::F16,
            GgmlDType::BF16,
            GgmlDType::Q4_0,
            GgmlDType::Q4_1,
            GgmlDType::Q5_0,
            GgmlDType::Q5_1,
            GgmlDType::Q8_0,
            GgmlDType::Q4K,
            GgmlDType::Q6K,
        ] {
            let q = QTensor::quantize(&w, dt)?;
            let wd = q.dequantize(&dev)?;
            let mm = CpuMatmul::new(Format::from_ggml(dt).unwrap(), n, k, Arc::new(q.data()?.to_vec())).unwrap();
            for t in [1, 3, 8, 13] {
                let x = Tensor::randn(0f32, 1.0, (t, k), &dev)?;
                let want: Vec<f32> = x.matmul(&wd.t()?)?.flatten_all()?.to_vec1()?;
                let mut got = vec![0f32; t * n];
                mm.forward_with(level(), true, &x.flatten_all()?.to_vec1()?, t, &mut got);
                let err = want.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
                assert!(err < 2e-3, "{dt:?} t={t}: max error {err}");
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod int8_tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};
    use std::sync::Arc;

    /// Decode with 8-bit activations against the exact f32 path, through the whole dispatch
    /// (threads, row groups). Each activation is rounded to within amax_b/254 of its value
    /// (amax_b: the largest |x| of its block of 32), plus amax_b/2048 for the f16 scale (see
    /// `vnni::tests`), so a row's product moves by at most Σ_b amax_b·(1/254 + 1/2048)·Σ_{i∈b}
    /// |w_i|; the check is that bound plus f32 slack. With no VNNI both paths are f32 and equal.
    #[test]
    fn int8_decode_and_prefill_within_rounding_bound_of_exact() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let (n, k) = (70, 512);
        let w = Tensor::randn(0f32, 1.0, (n, k), &dev)?;
        for dt in [GgmlDType::Q4_0, GgmlDType::Q4_1, GgmlDType::Q8_0, GgmlDType::Q4K, GgmlDType::Q6K, GgmlDType::Q5_0, GgmlDType::Q5_1, GgmlDType::F16] {
            let q = QTensor::quantize(&w, dt)?;
            let wd: Vec<f32> = q.dequantize(&dev)?.flatten_all()?.to_vec1()?;
            let mm = CpuMatmul::new(Format::from_ggml(dt).unwrap(), n, k, Arc::new(q.data()?.to_vec())).unwrap();
            // One token (decode), and several (prefill, `vnni_gemm`).
            for t in [1, 5, 70] {
                let xs: Vec<f32> = Tensor::randn(0f32, 1.0, (t, k), &dev)?.flatten_all()?.to_vec1()?;
                let (mut exact, mut fast) = (vec![0f32; t * n], vec![0f32; t * n]);
                mm.forward_with(level(), true, &xs, t, &mut exact);
                mm.forward_with(level(), false, &xs, t, &mut fast);
                for tok in 0..t {
                    let x = &xs[tok * k..(tok + 1) * k];
                    for r in 0..n {
                        let row = &wd[r * k..(r + 1) * k];
                        let bound: f32 = (0..k / 32)
                            .map(|b| {
                                let amax = x[b * 32..b * 32 + 32].iter().fold(0f32, |m, v| m.max(v.abs()));
                                amax * (1.0 / 254.0 + 1.0 / 2048.0) * row[b * 32..b * 32 + 32].iter().map(|v| v.abs()).sum::<f32>()
                            })
                            .sum();
                        let err = (exact[tok * n + r] - fast[tok * n + r]).abs();
                        assert!(err <= bound + 1e-2, "{dt:?} t={t} token {tok} row {r}: error {err} > bound {bound}");
                    }
                }
                let int8_kernel = dt != GgmlDType::F16;
                if int8_kernel && level() == Level::Avx512 && super::super::vnni::available() {
                    assert_ne!(exact, fast, "{dt:?} t={t}: the 8-bit path did not run");
                } else {
                    assert_eq!(exact, fast, "{dt:?} t={t}");
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod stacked_tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};
    use std::sync::Arc;

    /// A stack of three matrices equals the three products side by side.
    #[test]
    fn stacked_equals_separate() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let k = 256;
        let sizes = [64, 32, 40];
        let ws: Vec<QTensor> = sizes
            .iter()
            .map(|&n| QTensor::quantize(&Tensor::randn(0f32, 1.0, (n, k), &dev).unwrap(), GgmlDType::Q8_0).unwrap())
            .collect();
        let parts = ws
            .iter()
            .zip(sizes)
            .map(|(q, n)| (Arc::new(q.data().unwrap().to_vec()) as Arc<dyn WeightBytes>, n))
            .collect();
        let stack = CpuMatmul::stacked(Format::Q8_0, k, parts).unwrap();
        for t in [1, 5] {
            let x: Vec<f32> = Tensor::randn(0f32, 1.0, (t, k), &dev)?.flatten_all()?.to_vec1()?;
            let mut y = vec![0f32; t * stack.rows()];
            stack.forward(&x, t, &mut y);
            let mut col = 0;
            for (q, n) in ws.iter().zip(sizes) {
                let single = CpuMatmul::new(Format::Q8_0, n, k, Arc::new(q.data()?.to_vec())).unwrap();
                let mut ys = vec![0f32; t * n];
                single.forward(&x, t, &mut ys);
                for tok in 0..t {
                    assert_eq!(&y[tok * stack.rows() + col..tok * stack.rows() + col + n], &ys[tok * n..(tok + 1) * n]);
                }
                col += n;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod batch_tests {
    use super::*;
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};
    use std::sync::Arc;

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// Through the whole dispatch (threads, repacked formats, the packed head, exact and 8-bit
    /// activations): decode rows of a batch equal each token's product alone, and prompt rows
    /// do not depend on how the prompt was cut (one row alone, or rows among others).
    #[test]
    fn decode_rows_equal_solo_and_prompt_rows_ignore_chunking() -> candle_core::Result<()> {
        let dev = Device::Cpu;
        let (n, k) = (70, 512);
        let w = Tensor::randn(0f32, 1.0, (n, k), &dev)?;
        for dt in [GgmlDType::Q4_1, GgmlDType::Q8_0, GgmlDType::Q4K, GgmlDType::Q6K, GgmlDType::Q5_0, GgmlDType::F16] {
            let q = QTensor::quantize(&w, dt)?;
            let data: Arc<dyn WeightBytes> = Arc::new(q.data()?.to_vec());
            let format = Format::from_ggml(dt).unwrap();
            let mats = [
                CpuMatmul::new(format, n, k, data.clone()).unwrap(),
                CpuMatmul::head(format, k, vec![(data, n)]).unwrap(),
            ];
            for (mm, exact) in mats.iter().flat_map(|m| [(m, false), (m, true)]) {
                let run = |x: &[f32], t, d, y: &mut [f32]| mm.forward_rows_with(level(), exact, x, t, d, y);
                let t = 9;
                let x: Vec<f32> = Tensor::randn(0f32, 1.0, (t, k), &dev)?.flatten_all()?.to_vec1()?;
                let mut y = vec![0f32; t * n];
                run(&x, t, 6, &mut y);
                for tok in 0..6 {
                    let mut one = vec![0f32; n];
                    run(&x[tok * k..(tok + 1) * k], 1, 1, &mut one);
                    assert_eq!(bits(&y[tok * n..(tok + 1) * n]), bits(&one), "{dt:?} exact={exact}: decode row {tok}");
                }
                let mut alone = vec![0f32; n];
                run(&x[8 * k..], 1, 0, &mut alone);
                assert_eq!(bits(&y[8 * n..]), bits(&alone), "{dt:?} exact={exact}: prompt row");
            }
        }
        Ok(())
    }
}
