//! NCCL across the GPUs of one host, for tensor parallelism. The communicators of all ranks are
//! made together (`ncclCommInitAll`) and driven from the one thread that runs the ranks in
//! lockstep; each collective is one NCCL group covering every rank, queued on each rank's
//! stream behind the work that produced its part. libnccl is loaded when the first
//! communicator is made (the machine needs it only for `--tensor-parallel` above 1).

use super::ptr;
use candle_core::cuda_backend::cudarc::nccl::{result, sys};
use candle_core::cuda_backend::CudaDevice;
use candle_core::{DType, Device, Result, Tensor};

pub struct Nccl {
    comms: Vec<sys::ncclComm_t>,
    devices: Vec<CudaDevice>,
}

// SAFETY: the communicators are used only through &self by the single driver thread at a time
// (the model is behind the engine's lock); NCCL communicators may move between threads.
unsafe impl Send for Nccl {}
unsafe impl Sync for Nccl {}

fn nccl_err(e: result::NcclError) -> candle_core::Error {
    candle_core::Error::Msg(format!("nccl: {e:?}"))
}

impl Nccl {
    /// One communicator per device, rank i on `devices[i]` (all CUDA, distinct GPUs).
    pub fn new(devices: &[Device]) -> Result<Self> {
        let devices = devices
            .iter()
            .map(|d| match d {
                Device::Cuda(c) => Ok(c.clone()),
                other => candle_core::bail!("nccl: {other:?} is not a CUDA device"),
            })
            .collect::<Result<Vec<_>>>()?;
        let ordinals: Vec<i32> = devices.iter().map(|d| d.cuda_stream().context().ordinal() as i32).collect();
        let mut comms = vec![std::ptr::null_mut(); devices.len()];
        // SAFETY: room for one communicator per listed device.
        unsafe { result::comm_init_all(comms.as_mut_ptr(), comms.len() as i32, ordinals.as_ptr()) }
            .map_err(nccl_err)?;
        Ok(Self { comms, devices })
    }

    pub fn world(&self) -> usize {
        self.comms.len()
    }

    /// `parts[0]` ← the sum of `parts` (one per rank, on the rank's device, same shape and
    /// dtype, contiguous), in place: an NCCL reduce to rank 0.
    pub fn reduce_to_first(&self, parts: &[Tensor]) -> Result<()> {
        if parts.len() != self.comms.len() {
            candle_core::bail!("nccl: {} parts for {} ranks", parts.len(), self.comms.len())
        }
        let dtype = match parts[0].dtype() {
            DType::BF16 => sys::ncclDataType_t::ncclBfloat16,
            DType::F16 => sys::ncclDataType_t::ncclFloat16,
            DType::F32 => sys::ncclDataType_t::ncclFloat32,
            d => candle_core::bail!("nccl: no reduction for {d:?}"),
        };
        let count = parts[0].elem_count();
        for p in parts {
            if !p.is_contiguous() || p.dtype() != parts[0].dtype() || p.elem_count() != count {
                candle_core::bail!("nccl: parts must be contiguous and of one shape and dtype")
            }
        }
        result::group_start().map_err(nccl_err)?;
        for ((part, comm), dev) in parts.iter().zip(&self.comms).zip(&self.devices) {
            let buf = ptr(part)? as *mut std::ffi::c_void;
            let stream = dev.cuda_stream().cu_stream() as sys::cudaStream_t;
            // SAFETY: `buf` is a live contiguous buffer of `count` elements on this rank's
            // device; rank 0 reduces in place (send = receive), the others only send.
            let queued = unsafe { result::reduce(buf, buf, count, dtype, sys::ncclRedOp_t::ncclSum, 0, *comm, stream) };
            if let Err(e) = queued {
                let _ = result::group_end();
                return Err(nccl_err(e));
            }
        }
        result::group_end().map_err(nccl_err)?;
        Ok(())
    }
}

impl Drop for Nccl {
    fn drop(&mut self) {
        for c in &self.comms {
            // SAFETY: made by comm_init_all in new, destroyed once.
            let _ = unsafe { result::comm_destroy(*c) };
        }
    }
}
