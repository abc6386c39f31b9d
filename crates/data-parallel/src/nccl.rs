//! NCCL collectives for CUDA ranks: one communicator per rank, on the rank's own GPU, whose
//! collectives run on the Candle device's stream (a cudarc stream, the cudarc candle-core uses), so they queue behind the backward pass that made the gradients and ahead of the
//! optimizer step that reads them, with no host synchronisation of their own.
//!
//! Start-up: every rank needs rank 0's NCCL unique id before `ncclCommInitRank`; how it travels
//! is [`crate::bootstrap`]'s (`TALLOW_NCCL_ID` from `tallow train --nproc`, an MPI broadcast under
//! mpirun with the `mpi` feature, else TCP through `MASTER_ADDR`:`MASTER_PORT`). The process that
//! made the id hosts NCCL's own bootstrap root (a thread `ncclGetUniqueId` starts), so it must
//! live until every rank has joined: rank 0, or the `tallow train --nproc` parent.
//!
//! The stream: Candle opens a device on CUDA's per-thread default stream, and NCCL, handed that
//! stream, launches on the calling thread's one (its blocking `ncclCommInitRank` mode does; see
//! NVIDIA/nccl#1976 for the non-blocking mode, which would not). So the collectives must be
//! called from the thread that runs the training step's tensor ops, as the trainer does.
//! [`all_reduce_sum_over_gpus`], one thread driving every GPU (`tallow doctor`'s check), makes a
//! stream of its own per GPU instead (cupy#4322: `ncclCommInitAll` with the per-thread stream
//! fails).
//!
//! NCCL itself is loaded at run time ([`crate::libnccl`]), not linked, so one GPU needs no NCCL;
//! tallow calls only functions every NCCL 2.x has (`ncclGetUniqueId`, `ncclCommInitRank`,
//! `ncclCommInitAll`, `ncclAllReduce`, `ncclAllGather`, `ncclGroupStart/End`, `ncclCommAbort`),
//! so any libnccl.so.2 serves (the `nvidia-nccl-cu13` wheel is 2.27, `-cu12` 2.21 for CUDA 12.4).

use std::ffi::c_void;
use std::sync::Arc;
use std::time::Duration;

use candle_core::op::BackpropOp;
use candle_core::{CudaDevice, CudaStorage, DType, Device, Storage, Tensor};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};

use crate::bootstrap::{self, ID_BYTES, ID_ENV};
use crate::libnccl::{self, Lib};
use crate::rank::{Launch, Launcher};
use crate::{Collective, Dist, DistError, Result};

/// One NCCL communicator (`ncclComm_t`) and the stream its collectives are queued on; aborted
/// when dropped.
struct Comm {
    lib: &'static Lib,
    comm: libnccl::Comm,
    stream: Arc<CudaStream>,
    rank: usize,
    world: usize,
}

impl Drop for Comm {
    fn drop(&mut self) {
        // SAFETY: the communicator was made by ncclCommInitRank/All and is not used after this.
        // ncclCommAbort, not ncclCommDestroy: it does not wait for peers that may be gone.
        unsafe { (self.lib.comm_abort)(self.comm) };
    }
}

impl Comm {
    fn cu_stream(&self) -> libnccl::Stream {
        self.stream.cu_stream() as libnccl::Stream
    }

    /// `ncclAllReduce` (sum) of `src` into `dst`, queued on this communicator's stream.
    fn all_reduce_sum<S: DevicePtr<f32>>(&self, src: &S, dst: &mut CudaSlice<f32>) -> Result<()> {
        let n = src.len();
        let (src, _read) = src.device_ptr(&self.stream);
        let (dst, _written) = dst.device_ptr_mut(&self.stream);
        // SAFETY: both buffers hold n f32 on this communicator's device, and stay alive (the
        // guards) until the call has queued the collective on the stream that later uses them.
        let r = unsafe {
            (self.lib.all_reduce)(
                src as *const c_void,
                dst as *mut c_void,
                n,
                libnccl::FLOAT32,
                libnccl::SUM,
                self.comm,
                self.cu_stream(),
            )
        };
        self.lib.check("ncclAllReduce", r).map_err(nccl_err)
    }

    /// `ncclAllGather` of `send`'s bytes into `recv` (world x its length), rank by rank.
    fn all_gather(&self, send: &CudaSlice<u8>, recv: &mut CudaSlice<u8>) -> Result<()> {
        let n = send.len();
        let (send, _read) = send.device_ptr(&self.stream);
        let (recv, _written) = recv.device_ptr_mut(&self.stream);
        // SAFETY: send holds n bytes and recv world * n, on this communicator's device.
        let r = unsafe {
            (self.lib.all_gather)(
                send as *const c_void,
                recv as *mut c_void,
                n,
                libnccl::UINT8,
                self.comm,
                self.cu_stream(),
            )
        };
        self.lib.check("ncclAllGather", r).map_err(nccl_err)
    }
}

/// A rank's NCCL communicator and the Candle device whose stream it runs on.
pub struct Nccl {
    comm: Comm,
    device: CudaDevice,
    /// Under mpirun, MPI carried the id; it stays initialized (and is finalized when this
    /// drops) so that mpirun sees a rank that ends normally.
    _carrier: IdCarrier,
}

fn nccl_err(what: String) -> DistError {
    DistError::Backend {
        backend: "nccl",
        what,
    }
}

/// The process's NCCL, or the error that says how to get it.
fn lib() -> Result<&'static Lib> {
    libnccl::get().map_err(nccl_err)
}

/// A new NCCL unique id as hex, for `tallow train --nproc` to set as `TALLOW_NCCL_ID` in its
/// ranks' environment. This process then hosts NCCL's bootstrap root: it must outlive the ranks'
/// start-up (the parent waits for its children, so it does).
pub fn new_id_hex() -> Result<String> {
    Ok(bootstrap::id_to_hex(&new_id()?))
}

fn new_id() -> Result<[u8; ID_BYTES]> {
    lib()?.unique_id().map_err(nccl_err)
}

/// This rank's NCCL communicator, on `device` (this rank's GPU: `cuda:LOCAL_RANK`, or `cuda:0`
/// where the launcher shows each rank one GPU), wrapped in a [`Dist`] whose collectives give up
/// after `timeout` ([`crate::watchdog`]; the start-up too).
pub fn init_dist(launch: &Launch, device: &Device, timeout: Duration) -> Result<Dist> {
    let cuda = cuda_device(device, "the NCCL backend")?;
    // Before the id exchange: a rank without NCCL says so rather than leave the others waiting.
    let lib = lib()?;
    let stream = cuda.cuda_stream();
    let ordinal = stream.context().ordinal();
    let visible = CudaContext::device_count().unwrap_or(0);
    if ordinal != launch.local_rank && visible > 1 {
        return Err(DistError::Launch(format!(
            "rank {} (local rank {}) opened cuda:{ordinal}, but each rank must use its own GPU: \
             cuda:{} (the local rank; `--device cuda` picks it), or one GPU per rank shown by \
             CUDA_VISIBLE_DEVICES",
            launch.rank, launch.local_rank, launch.local_rank
        )));
    }
    // The id exchange and ncclCommInitRank both wait for the other ranks: one that never comes
    // ends this rank after `timeout`, as a hung collective would.
    let watchdog = crate::watchdog::Watchdog::start(launch.rank, launch.world, timeout);
    let starting = watchdog.guard("NCCL start-up (the unique id and ncclCommInitRank)");
    let (id, carrier) = unique_id(launch, timeout)?;
    // ncclCommInitRank works on the calling thread's current device.
    stream
        .context()
        .bind_to_thread()
        .map_err(|e| nccl_err(format!("binding cuda:{ordinal} to this thread: {e}")))?;
    let mut comm: libnccl::Comm = std::ptr::null_mut();
    // SAFETY: writes one communicator handle; rank < world (the launcher's numbers).
    let r = unsafe {
        (lib.comm_init_rank)(
            &mut comm,
            launch.world as i32,
            libnccl::id_of(id),
            launch.rank as i32,
        )
    };
    lib.check("ncclCommInitRank", r).map_err(nccl_err)?;
    let comm = Comm {
        lib,
        comm,
        stream,
        rank: launch.rank,
        world: launch.world,
    };
    drop(starting);
    let nccl = Nccl {
        comm,
        device: cuda.clone(),
        _carrier: carrier,
    };
    Ok(Dist::new(Box::new(nccl), launch.local_rank, timeout))
}

/// What carried the id: under mpirun with the `mpi` feature, MPI (kept alive), else nothing.
#[cfg(feature = "mpi")]
type IdCarrier = Option<crate::mpi::Mpi>;
#[cfg(not(feature = "mpi"))]
type IdCarrier = ();

/// Rank 0's NCCL id on this rank, by the first way that applies (module docs).
fn unique_id(launch: &Launch, timeout: Duration) -> Result<([u8; ID_BYTES], IdCarrier)> {
    if let Ok(hex) = std::env::var(ID_ENV) {
        return Ok((bootstrap::id_from_hex(&hex)?, IdCarrier::default()));
    }
    #[cfg(feature = "mpi")]
    if launch.launcher == Launcher::Mpi {
        let mpi = crate::mpi::Mpi::init()?;
        let mut id = [0u8; ID_BYTES];
        if launch.rank == 0 {
            id = new_id()?;
        }
        mpi.broadcast_bytes(0, &mut id);
        return Ok((id, Some(mpi)));
    }
    let launcher = match launch.launcher {
        // Without the mpi feature, mpirun's ranks take the TCP path too.
        Launcher::Mpi => "mpirun (this build has no `mpi` feature to carry the id)",
        other => other.name(),
    };
    let master = bootstrap::master_from(&|k| std::env::var(k).ok(), launcher)?;
    let id = bootstrap::share_id(&master, launch.rank, launch.world, timeout, new_id)?;
    Ok((id, IdCarrier::default()))
}

/// The CUDA device of `device`, or an error naming the fix.
fn cuda_device<'a>(device: &'a Device, what: &str) -> Result<&'a CudaDevice> {
    let on = match device {
        Device::Cuda(d) => return Ok(d),
        Device::Cpu => "the CPU",
        _ => "another device",
    };
    Err(DistError::Launch(format!(
        "{what} sums CUDA tensors, and this one is on {on}: train with `--device cuda` (each \
         rank on cuda:LOCAL_RANK), or run CPU ranks under mpirun with a build that has the \
         `mpi` feature"
    )))
}

impl Nccl {
    fn stream(&self) -> Arc<CudaStream> {
        self.comm.stream.clone()
    }
}

impl Collective for Nccl {
    fn backend(&self) -> &'static str {
        "nccl"
    }

    fn rank(&self) -> usize {
        self.comm.rank
    }

    fn world(&self) -> usize {
        self.comm.world
    }

    /// `ncclAllReduce` (sum) of `t`'s elements into a new buffer on the same device and stream;
    /// returns without waiting for it (the device's later work queues behind it).
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        cuda_device(t.device(), "the NCCL all-reduce")?;
        if !t.device().same_device(&Device::Cuda(self.device.clone())) {
            return Err(nccl_err(format!(
                "the tensor is on {:?}, not on this rank's communicator's device cuda:{} (one \
                 Candle device per rank)",
                t.device().location(),
                self.stream().context().ordinal()
            )));
        }
        if t.dtype() != DType::F32 || t.rank() != 1 {
            return Err(nccl_err(format!(
                "all_reduce_sum takes a 1-D f32 tensor, got {:?} of shape {:?}",
                t.dtype(),
                t.dims()
            )));
        }
        let n = t.elem_count();
        if n == 0 {
            return Ok(Tensor::zeros(0, DType::F32, t.device())?);
        }
        let (storage, layout) = t.storage_and_layout();
        // A narrowed tensor starts inside its buffer: the view from its offset.
        let Some((start, end)) = layout.contiguous_offsets() else {
            return Err(nccl_err(
                "all_reduce_sum takes a contiguous tensor (call .contiguous() first)".into(),
            ));
        };
        let Storage::Cuda(cuda) = &*storage else {
            unreachable!("a CUDA device's tensor has CUDA storage")
        };
        let src = cuda.as_cuda_slice::<f32>()?.slice(start..end);
        // SAFETY: every element is written by the all-reduce before anything reads it (it is
        // queued on the same stream as any later reader).
        let mut dst = unsafe { self.device.alloc::<f32>(n) }?;
        self.comm.all_reduce_sum(&src, &mut dst)?;
        drop(src);
        drop(storage);
        let out = CudaStorage::wrap_cuda_slice(dst, self.device.clone());
        Ok(Tensor::from_storage(
            Storage::Cuda(out),
            n,
            BackpropOp::none(),
            false,
        ))
    }

    /// Each rank's length first (one `ncclAllGather` of a u64), then the bytes padded to the
    /// longest (a second), on this rank's device; the two copies back to the host wait for them.
    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let world = self.world();
        let stream = self.stream();
        let gather = |send: &[u8], per_rank: usize| -> Result<Vec<u8>> {
            let send = stream
                .clone_htod(send)
                .map_err(|e| nccl_err(format!("copying to the device: {e}")))?;
            let mut recv = stream
                .alloc_zeros::<u8>(per_rank * world)
                .map_err(|e| nccl_err(format!("allocating {} bytes: {e}", per_rank * world)))?;
            self.comm.all_gather(&send, &mut recv)?;
            stream
                .clone_dtoh(&recv)
                .map_err(|e| nccl_err(format!("copying to the host: {e}")))
        };
        let lens: Vec<usize> = gather(&(mine.len() as u64).to_le_bytes(), 8)?
            .chunks_exact(8)
            .map(|b| u64::from_le_bytes(b.try_into().unwrap()) as usize)
            .collect();
        let longest = lens.iter().copied().max().unwrap_or(0);
        if longest == 0 {
            return Ok(vec![Vec::new(); world]);
        }
        let mut padded = mine.to_vec();
        padded.resize(longest, 0);
        let all = gather(&padded, longest)?;
        Ok(lens
            .iter()
            .enumerate()
            .map(|(r, &len)| all[r * longest..r * longest + len].to_vec())
            .collect())
    }
}

/// The GPUs this process sees (after `CUDA_VISIBLE_DEVICES`).
pub fn visible_gpus() -> Result<usize> {
    CudaContext::device_count()
        .map(|n| n as usize)
        .map_err(|e| nccl_err(format!("counting GPUs: {e}")))
}

/// One all-reduce (sum) over GPUs `0..inputs.len()`, driven from this one process
/// (`ncclCommInitAll`, one grouped `ncclAllReduce` per GPU, each GPU on a stream of its own):
/// GPU i contributes `inputs[i]` (all of one length). Returns every GPU's result, copied back, in
/// GPU order. A check of the links between the GPUs of one host; training runs one process per
/// GPU ([`init_dist`]).
pub fn all_reduce_sum_over_gpus(inputs: &[Vec<f32>]) -> Result<Vec<Vec<f32>>> {
    let cuda = |what: &str, e: cudarc::driver::DriverError| nccl_err(format!("{what}: {e}"));
    let gpus = inputs.len();
    let lib = lib()?;
    let streams = (0..gpus)
        .map(|i| {
            CudaContext::new(i)
                .and_then(|c| c.new_stream())
                .map_err(|e| cuda(&format!("opening cuda:{i}"), e))
        })
        .collect::<Result<Vec<_>>>()?;
    let mut sends = Vec::with_capacity(gpus);
    let mut recvs = Vec::with_capacity(gpus);
    for (s, host) in streams.iter().zip(inputs) {
        sends.push(
            s.clone_htod(host)
                .map_err(|e| cuda("copying to the GPU", e))?,
        );
        recvs.push(
            s.alloc_zeros::<f32>(host.len())
                .map_err(|e| cuda("allocating", e))?,
        );
    }
    let ordinals: Vec<i32> = streams
        .iter()
        .map(|s| s.context().ordinal() as i32)
        .collect();
    let mut handles: Vec<libnccl::Comm> = vec![std::ptr::null_mut(); gpus];
    // SAFETY: writes one communicator per listed GPU.
    let r = unsafe { (lib.comm_init_all)(handles.as_mut_ptr(), gpus as i32, ordinals.as_ptr()) };
    lib.check("ncclCommInitAll", r).map_err(nccl_err)?;
    let comms: Vec<Comm> = handles
        .into_iter()
        .zip(&streams)
        .enumerate()
        .map(|(rank, (comm, stream))| Comm {
            lib,
            comm,
            stream: stream.clone(),
            rank,
            world: gpus,
        })
        .collect();
    // One thread drives every GPU: the calls must be grouped, or the first would wait for the
    // others forever.
    // SAFETY: no arguments; paired with the ncclGroupEnd below.
    lib.check("ncclGroupStart", unsafe { (lib.group_start)() })
        .map_err(nccl_err)?;
    let queued: Vec<_> = comms
        .iter()
        .zip(sends.iter().zip(recvs.iter_mut()))
        .map(|(comm, (send, recv))| comm.all_reduce_sum(send, recv))
        .collect();
    // SAFETY: closes the group opened above (also when a call in it failed).
    lib.check("ncclGroupEnd", unsafe { (lib.group_end)() })
        .map_err(nccl_err)?;
    for q in queued {
        q?;
    }
    streams
        .iter()
        .zip(&recvs)
        .map(|(s, recv)| {
            s.clone_dtoh(recv)
                .map_err(|e| cuda("copying from the GPU", e))
        })
        .collect()
}
