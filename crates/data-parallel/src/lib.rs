//! Data parallelism's plumbing for `tallow train`: which rank this process is
//! ([`rank`]: mpirun, torchrun, Slurm or `tallow train --nproc`), the collectives between the
//! ranks ([`Collective`]: MPI on CPU ranks with the `mpi` feature, NCCL on CUDA ranks with the
//! `nccl` feature), and a [`watchdog`] that ends a rank left waiting for a dead or hung peer.
//!
//! The trainer sees one [`Dist`]: its rank and world size, and two operations. Gradients are
//! summed with [`Dist::all_reduce_sum`]: every tensor flattened into one f32 buffer, reduced in
//! buckets of [`BUCKET_BYTES`] (PyTorch DDP's `bucket_cap_mb = 25`), one collective per bucket
//! rather than one per tensor. Bytes (a sharded optimizer's state, for a checkpoint) travel with
//! [`Dist::all_gather_bytes`]. One process is `Dist::single()`: both are the identity and no
//! backend is built.

pub mod bootstrap;
pub mod libnccl;
#[cfg(feature = "mpi")]
pub mod mpi;
#[cfg(feature = "nccl")]
pub mod nccl;
pub mod rank;
pub mod watchdog;

use std::ops::Range;
use std::time::Duration;

use candle_core::{DType, Device, Tensor};

use crate::rank::Launch;
#[cfg(feature = "mpi")]
use crate::rank::Launcher;

/// What can go wrong between ranks.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// The launch environment is inconsistent or names a backend this build lacks.
    #[error("{0}")]
    Launch(String),
    /// A collective failed.
    #[error("{backend}: {what}")]
    Backend { backend: &'static str, what: String },
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
}

pub type Result<T> = std::result::Result<T, DistError>;

/// Bytes of one all-reduce bucket: PyTorch DDP's default `bucket_cap_mb = 25`.
pub const BUCKET_BYTES: usize = 25 << 20;

/// The collectives of one job's ranks, as a backend provides them.
pub trait Collective {
    /// `"mpi"`, `"nccl"`.
    fn backend(&self) -> &'static str;
    /// This process's rank and the number of ranks.
    fn rank(&self) -> usize;
    fn world(&self) -> usize;
    /// Sums a contiguous 1-D f32 tensor over the ranks: every rank gets the sum, on the
    /// tensor's device.
    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor>;
    /// Every rank's bytes, in rank order, on every rank (the lengths may differ).
    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>>;
}

/// The [`Dist`] of this process: one process without a `launch`; a CUDA rank through NCCL
/// (feature `nccl`); a CPU rank through MPI (feature `mpi`, started by mpirun or srun). A
/// collective that waits longer than `timeout` ends the process ([`watchdog`]).
pub fn init(launch: Option<&Launch>, device: &Device, timeout: Duration) -> Result<Dist> {
    let Some(launch) = launch else {
        return Ok(Dist::single());
    };
    #[cfg(feature = "nccl")]
    if device.is_cuda() {
        return nccl::init_dist(launch, device, timeout);
    }
    let what = if device.is_cuda() { "CUDA" } else { "CPU" };
    #[cfg(feature = "mpi")]
    {
        if matches!(launch.launcher, Launcher::Mpi | Launcher::Slurm) {
            let comm = mpi::Mpi::init()?;
            if (comm.rank(), comm.world()) != (launch.rank, launch.world) {
                return Err(DistError::Launch(format!(
                    "{} says rank {} of {}, MPI says rank {} of {}: start the ranks with one \
                     mpirun (or srun --mpi=pmix)",
                    launch.launcher.name(),
                    launch.rank,
                    launch.world,
                    comm.rank(),
                    comm.world()
                )));
            }
            return Ok(Dist::new(Box::new(comm), launch.local_rank, timeout));
        }
        Err(DistError::Launch(format!(
            "rank {} of {} started by {}: {what} ranks talk through MPI, which only mpirun (or \
             srun) can connect; start them with `mpirun -np {} tallow train ...` or \
             `tallow train --nproc {}`",
            launch.rank,
            launch.world,
            launch.launcher.name(),
            launch.world,
            launch.world
        )))
    }
    #[cfg(not(feature = "mpi"))]
    let _ = timeout;
    #[cfg(not(feature = "mpi"))]
    Err(DistError::Launch(format!(
        "rank {} of {} started by {}, but this build of tallow has no collectives for {what} \
         ranks: build it with `--features mpi` (CPU ranks; needs Debian's libopenmpi-dev and \
         libclang-dev) or use the CUDA build with NCCL (scripts/build_cuda.sh); \
         docs/distributed.md",
        launch.rank,
        launch.world,
        launch.launcher.name()
    )))
}

/// This process's place in a data-parallel job (or a job of one).
pub struct Dist {
    pub rank: usize,
    pub world: usize,
    /// The rank among the ranks of this machine (its GPU).
    pub local_rank: usize,
    comm: Option<Box<dyn Collective>>,
    watchdog: Option<watchdog::Watchdog>,
}

impl Dist {
    /// One process: no peers, no backend.
    pub fn single() -> Dist {
        Dist {
            rank: 0,
            world: 1,
            local_rank: 0,
            comm: None,
            watchdog: None,
        }
    }

    /// A rank of a job of `comm.world()` ranks; a collective that waits longer than `timeout`
    /// for the others ends this process ([`watchdog`]).
    pub fn new(comm: Box<dyn Collective>, local_rank: usize, timeout: Duration) -> Dist {
        let (rank, world) = (comm.rank(), comm.world());
        Dist {
            rank,
            world,
            local_rank,
            watchdog: Some(watchdog::Watchdog::start(rank, world, timeout)),
            comm: Some(comm),
        }
    }

    /// Marks a wait on the other ranks outside the collectives for the watchdog until the
    /// guard drops: NCCL's all-reduce only queues work on the stream, so a dead peer shows as
    /// the next host read of its result never returning. None on one process.
    pub fn waiting(&self, what: &str) -> Option<watchdog::Guard<'_>> {
        self.watchdog.as_ref().map(|w| w.guard(what))
    }

    /// Rank 0: the one that writes checkpoints, outputs, metrics and the progress bar.
    pub fn is_main(&self) -> bool {
        self.rank == 0
    }

    /// `"mpi"`, `"nccl"`, or `"none"` for one process.
    pub fn backend(&self) -> &'static str {
        self.comm.as_ref().map_or("none", |c| c.backend())
    }

    /// This rank's share of `n` items split into `world` contiguous blocks: rank r gets
    /// `[r*k, (r+1)*k)` with `k = ceil(n / world)`, clipped to `n` (the last ranks may get fewer,
    /// or none).
    pub fn block(&self, n: usize, per_rank: usize) -> Range<usize> {
        let start = (self.rank * per_rank).min(n);
        start..((self.rank + 1) * per_rank).min(n)
    }

    /// Sums each of `tensors` (any shapes, any float dtypes, one device) over the ranks, as
    /// PyTorch DDP buckets them: consecutive tensors grouped up to [`BUCKET_BYTES`] of f32 (a
    /// larger tensor is a bucket of its own), each bucket flattened into one f32 buffer (one
    /// `cat`), reduced by one collective and split back into its tensors' shapes and dtypes.
    /// The inputs are consumed bucket by bucket, so the memory this adds is about two buckets
    /// ([`transient_bytes`]). `what` names the call for the watchdog's message.
    pub fn all_reduce_sum(&self, tensors: Vec<Tensor>, what: &str) -> Result<Vec<Tensor>> {
        let mut out = Vec::with_capacity(tensors.len());
        self.all_reduce_sum_each(tensors, what, |_, t| {
            out.push(t);
            Ok(())
        })?;
        Ok(out)
    }

    /// [`Dist::all_reduce_sum`] handing each sum to `each(index, sum)` as its bucket is done,
    /// so no more than one bucket's sums are held at once.
    pub fn all_reduce_sum_each(
        &self,
        tensors: Vec<Tensor>,
        what: &str,
        mut each: impl FnMut(usize, Tensor) -> Result<()>,
    ) -> Result<()> {
        let Some(comm) = &self.comm else {
            for (i, t) in tensors.into_iter().enumerate() {
                each(i, t)?;
            }
            return Ok(());
        };
        let _waiting = self.watchdog.as_ref().map(|w| w.guard(what));
        let sizes: Vec<usize> = tensors.iter().map(|t| t.elem_count()).collect();
        let mut rest = tensors.into_iter();
        let mut index = 0;
        for n in bucket_lengths(&sizes) {
            let bucket: Vec<Tensor> = rest.by_ref().take(n).collect();
            let flat: Vec<Tensor> = bucket
                .iter()
                .map(|t| t.flatten_all()?.to_dtype(DType::F32))
                .collect::<candle_core::Result<_>>()?;
            let flat = Tensor::cat(&flat, 0)?; // (elements of the bucket)
            let summed = comm.all_reduce_sum(&flat)?;
            drop(flat);
            let mut at = 0;
            for t in bucket {
                let k = t.elem_count();
                let sum = summed
                    .narrow(0, at, k)?
                    .reshape(t.shape())?
                    .to_dtype(t.dtype())?;
                drop(t);
                each(index, sum)?;
                index += 1;
                at += k;
            }
        }
        Ok(())
    }

    /// Every rank's `mine`, in rank order (one process: just `mine`).
    pub fn all_gather_bytes(&self, mine: &[u8], what: &str) -> Result<Vec<Vec<u8>>> {
        let Some(comm) = &self.comm else {
            return Ok(vec![mine.to_vec()]);
        };
        let _waiting = self.watchdog.as_ref().map(|w| w.guard(what));
        comm.all_gather_bytes(mine)
    }
}

/// How many consecutive tensors of `sizes` (elements) go in each bucket of
/// [`Dist::all_reduce_sum`]: as many as fit in [`BUCKET_BYTES`] of f32, at least one.
pub fn bucket_lengths(sizes: &[usize]) -> Vec<usize> {
    let cap = BUCKET_BYTES / 4;
    let mut lengths = Vec::new();
    let (mut n, mut elems) = (0, 0);
    for &s in sizes {
        if n > 0 && elems + s > cap {
            lengths.push(n);
            (n, elems) = (0, 0);
        }
        n += 1;
        elems += s;
    }
    if n > 0 {
        lengths.push(n);
    }
    lengths
}

/// The most bytes [`Dist::all_reduce_sum`] holds besides its inputs and outputs, for tensors
/// of `sizes` elements: a bucket's f32 buffer and its sum (the largest bucket).
pub fn transient_bytes(sizes: &[usize]) -> usize {
    let mut largest = 0;
    let mut at = 0;
    for n in bucket_lengths(sizes) {
        largest = largest.max(sizes[at..at + n].iter().sum::<usize>());
        at += n;
    }
    2 * 4 * largest
}

/// ZeRO stage 1's partition: the rank that owns (keeps the optimizer state of, and updates)
/// each of the tensors of `sizes` elements. Largest first, each to the rank with the fewest
/// elements so far (the lowest rank on a tie): deterministic, so every rank computes the same.
pub fn owners(sizes: &[usize], world: usize) -> Vec<usize> {
    let world = world.max(1);
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(sizes[i]), i));
    let mut load = vec![0usize; world];
    let mut owner = vec![0; sizes.len()];
    for i in order {
        let r = (0..world)
            .min_by_key(|&r| (load[r], r))
            .expect("world >= 1");
        owner[i] = r;
        load[r] += sizes[i];
    }
    owner
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// A job of `world` ranks in one process where every rank holds the same values: the sum is
    /// `world` times the input (what the flattening and bucketing must hand back unchanged).
    struct Replicated {
        world: usize,
    }

    impl Collective for Replicated {
        fn backend(&self) -> &'static str {
            "test"
        }
        fn rank(&self) -> usize {
            0
        }
        fn world(&self) -> usize {
            self.world
        }
        fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
            Ok((t * self.world as f64)?)
        }
        fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
            Ok(vec![mine.to_vec(); self.world])
        }
    }

    #[test]
    fn all_reduce_keeps_shapes_dtypes_and_order_across_buckets() {
        let dev = Device::Cpu;
        let dist = Dist {
            rank: 0,
            world: 3,
            local_rank: 0,
            comm: Some(Box::new(Replicated { world: 3 })),
            watchdog: None,
        };
        // Three buckets' worth (the second tensor straddles a bucket boundary), a bf16 tensor
        // and a scalar.
        let big = Tensor::arange(0f32, (BUCKET_BYTES / 4 + 5) as f32, &dev)
            .unwrap()
            .reshape(((BUCKET_BYTES / 4 + 5) / 5, 5))
            .unwrap();
        let mid = Tensor::ones((BUCKET_BYTES / 4 + 7,), DType::F32, &dev).unwrap();
        let half = Tensor::new(&[1.5f32, -2.0], &dev)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let scalar = Tensor::new(0.25f32, &dev).unwrap();
        let inputs = [big.clone(), mid.clone(), half.clone(), scalar.clone()];
        let out = dist.all_reduce_sum(inputs.to_vec(), "test").unwrap();
        for (i, o) in inputs.iter().zip(&out) {
            assert_eq!(i.shape(), o.shape());
            assert_eq!(i.dtype(), o.dtype());
            let want = (i.to_dtype(DType::F32).unwrap() * 3.0).unwrap();
            let diff = (o.to_dtype(DType::F32).unwrap() - want)
                .unwrap()
                .abs()
                .unwrap()
                .flatten_all()
                .unwrap()
                .max(0)
                .unwrap()
                .to_scalar::<f32>()
                .unwrap();
            assert_eq!(diff, 0.0, "tensor of shape {:?}", i.shape());
        }
    }

    #[test]
    fn buckets_and_owners() {
        let cap = BUCKET_BYTES / 4;
        assert_eq!(
            bucket_lengths(&[cap / 2, cap / 2, 1, cap * 3, 5]),
            vec![2, 1, 1, 1]
        );
        assert_eq!(bucket_lengths(&[]), Vec::<usize>::new());
        assert_eq!(transient_bytes(&[10, cap * 3, 5]), 2 * 4 * cap * 3);
        // Largest first to the least loaded rank.
        assert_eq!(owners(&[4, 10, 3, 3, 1], 2), vec![1, 0, 1, 1, 0]);
        assert_eq!(owners(&[4, 10], 1), vec![0, 0]);
    }

    #[test]
    fn blocks_cover_the_items_in_rank_order() {
        let mut d = Dist::single();
        d.world = 3;
        let blocks: Vec<Range<usize>> = (0..3)
            .map(|r| {
                d.rank = r;
                d.block(7, 3)
            })
            .collect();
        assert_eq!(blocks, vec![0..3, 3..6, 6..7]);
        d.rank = 2;
        assert_eq!(d.block(5, 3), 5..5, "a rank past the end gets none");
    }
}
