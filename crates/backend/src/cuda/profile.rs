//! Kernel timing without a profiler (the GPU machine has no nsys): with `FERROLM_CUDA_PROFILE=1`
//! every `launch!` outside a graph capture is bracketed by two timing events, and [`report`]
//! sums the device time per kernel. The time between one of our kernels ending and the next
//! one starting is booked as "between": candle's own kernels (cuBLAS, copies) plus any wait
//! for the host to queue work. Only eager steps are timed; a captured graph holds no events.

use candle_core::cuda_backend::cudarc::driver::{sys, CudaEvent};
use candle_core::cuda_backend::{CudaDevice, WrapErr};
use candle_core::Result;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::sync::OnceLock;

struct Span {
    name: String,
    start: CudaEvent,
    end: CudaEvent,
}

thread_local! {
    static SPANS: RefCell<Vec<Span>> = const { RefCell::new(Vec::new()) };
}

pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("FERROLM_CUDA_PROFILE").is_ok_and(|v| v == "1"))
}

/// Records the start event of a launch (None when profiling is off or the stream is capturing).
pub fn begin(dev: &CudaDevice) -> Option<CudaEvent> {
    if !enabled() {
        return None;
    }
    let stream = dev.cuda_stream();
    let idle = sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE;
    if stream.capture_status().ok()? != idle {
        return None;
    }
    let ev = stream.context().new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)).ok()?;
    ev.record(&stream).ok()?;
    Some(ev)
}

/// Records the end event of a launch started with [`begin`]; spans are keyed by kernel name and
/// grid (which tells the shapes of one kernel apart).
pub fn end(dev: &CudaDevice, start: Option<CudaEvent>, name: &str, grid: (u32, u32, u32)) {
    let Some(start) = start else { return };
    let stream = dev.cuda_stream();
    let Ok(end) = stream.context().new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT)) else { return };
    if end.record(&stream).is_ok() {
        let name = format!("{name} {}x{}", grid.0, grid.1);
        SPANS.with(|s| s.borrow_mut().push(Span { name, start, end }));
    }
}

/// Times `f` as one span named `name` (candle compositions: cuBLAS products, prefill attention).
/// Kernels of ours inside it are counted twice: in the region and on their own.
pub fn region<T>(dev: &candle_core::Device, name: impl FnOnce() -> String, f: impl FnOnce() -> Result<T>) -> Result<T> {
    let candle_core::Device::Cuda(d) = dev else { return f() };
    let start = begin(d);
    let out = f()?;
    if start.is_some() {
        end(d, start, &format!("[{}]", name()), (0, 0, 0));
    }
    Ok(out)
}

/// Forgets the spans recorded so far on this thread.
pub fn reset() {
    SPANS.with(|s| s.borrow_mut().clear());
}

/// Waits for the device, then tabulates the spans recorded on this thread since the last
/// [`reset`] (per kernel: launches, total and mean µs; plus the time between kernels and the
/// wall time from the first start to the last end), divided by `steps`. Clears the spans.
pub fn report(dev: &CudaDevice, steps: usize) -> Result<String> {
    dev.cuda_stream().synchronize().w()?;
    let spans = SPANS.with(|s| std::mem::take(&mut *s.borrow_mut()));
    let (Some(first), Some(last)) = (spans.first(), spans.last()) else { return Ok("no kernels timed".into()) };
    let us = |a: &CudaEvent, b: &CudaEvent| a.elapsed_ms(b).map(|ms| ms as f64 * 1e3).w();
    let mut per: BTreeMap<&str, (usize, f64)> = BTreeMap::new();
    let mut between = 0.0;
    for (i, s) in spans.iter().enumerate() {
        let e = per.entry(&s.name).or_default();
        e.0 += 1;
        e.1 += us(&s.start, &s.end)?;
        if let Some(next) = spans.get(i + 1) {
            between += us(&s.end, &next.start)?.max(0.0);
        }
    }
    let wall = us(&first.start, &last.end)?;
    let n = steps.max(1) as f64;
    let mut rows: Vec<_> = per.into_iter().collect();
    rows.sort_by(|a, b| b.1 .1.total_cmp(&a.1 .1));
    let mut out = format!("kernel profile, per step of {steps}: wall {:.1} µs\n", wall / n);
    for (name, (count, total)) in rows {
        out += &format!(
            "  {name:<36} {:>6.1} launches {:>9.1} µs {:>7.2} µs each\n",
            count as f64 / n,
            total / n,
            total / count as f64
        );
    }
    out += &format!("  {:<36} {:>16} {:>9.1} µs\n", "between (candle ops, host)", "", between / n);
    Ok(out)
}

/// Node counts of a captured graph by type (kernel, memset, alloc, free, …), for the profile.
pub fn graph_nodes(graph: sys::CUgraph) -> String {
    let mut count: usize = 0;
    // SAFETY: a null node array asks only for the count.
    if unsafe { sys::cuGraphGetNodes(graph, std::ptr::null_mut(), &mut count) } != sys::CUresult::CUDA_SUCCESS {
        return "graph nodes: unknown".into();
    }
    let mut nodes = vec![std::ptr::null_mut(); count];
    // SAFETY: `nodes` has room for `count` handles.
    unsafe { sys::cuGraphGetNodes(graph, nodes.as_mut_ptr(), &mut count) };
    let mut kinds: BTreeMap<String, usize> = BTreeMap::new();
    for node in nodes {
        let mut t = sys::CUgraphNodeType::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: a node handle of this graph.
        unsafe { sys::cuGraphNodeGetType(node, &mut t) };
        *kinds.entry(format!("{t:?}").replace("CU_GRAPH_NODE_TYPE_", "").to_lowercase()).or_default() += 1;
    }
    format!("graph nodes: {count} {kinds:?}")
}
