//! MPI collectives (the `mpi` crate over the system's Open MPI / MPICH): the backend of CPU
//! ranks, started by `mpirun` (or `srun` with PMI). Tensors on another device go through the
//! host.

use ::mpi::collective::SystemOperation;
use ::mpi::datatype::PartitionMut;
use ::mpi::environment::Universe;
use ::mpi::topology::SimpleCommunicator;
use ::mpi::traits::*;
use candle_core::Tensor;

use crate::{Collective, DistError, Result};

pub struct Mpi {
    // Finalizes MPI when dropped.
    _universe: Universe,
    world: SimpleCommunicator,
}

impl Mpi {
    /// Initializes MPI (once per process).
    pub fn init() -> Result<Mpi> {
        let universe = ::mpi::initialize().ok_or_else(|| DistError::Backend {
            backend: "mpi",
            what: "MPI was already initialized in this process".into(),
        })?;
        let world = universe.world();
        Ok(Mpi {
            _universe: universe,
            world,
        })
    }

    /// Rank `root`'s bytes on every rank (the NCCL id at start-up).
    pub fn broadcast_bytes(&self, root: usize, bytes: &mut [u8]) {
        self.world
            .process_at_rank(root as i32)
            .broadcast_into(bytes);
    }
}

impl Collective for Mpi {
    fn backend(&self) -> &'static str {
        "mpi"
    }

    fn rank(&self) -> usize {
        self.world.rank() as usize
    }

    fn world(&self) -> usize {
        self.world.size() as usize
    }

    fn all_reduce_sum(&self, t: &Tensor) -> Result<Tensor> {
        let send = t.to_vec1::<f32>()?;
        let mut recv = vec![0f32; send.len()];
        self.world
            .all_reduce_into(&send[..], &mut recv[..], SystemOperation::sum());
        Ok(Tensor::from_vec(recv, send.len(), t.device())?)
    }

    fn all_gather_bytes(&self, mine: &[u8]) -> Result<Vec<Vec<u8>>> {
        let n = self.world.size() as usize;
        let len = i32::try_from(mine.len()).map_err(|_| DistError::Backend {
            backend: "mpi",
            what: format!("{} bytes in one gather (over 2 GiB)", mine.len()),
        })?;
        let mut counts = vec![0i32; n];
        self.world.all_gather_into(&len, &mut counts[..]);
        let displs: Vec<i32> = counts
            .iter()
            .scan(0i32, |at, &c| {
                let d = *at;
                *at += c;
                Some(d)
            })
            .collect();
        let total: usize = counts.iter().map(|&c| c as usize).sum();
        let mut buf = vec![0u8; total];
        {
            let mut part = PartitionMut::new(&mut buf[..], &counts[..], &displs[..]);
            self.world.all_gather_varcount_into(mine, &mut part);
        }
        Ok(counts
            .iter()
            .zip(&displs)
            .map(|(&c, &d)| buf[d as usize..(d + c) as usize].to_vec())
            .collect())
    }
}
