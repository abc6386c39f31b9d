//! Which rank this process is, read from the variables the launchers people already use set:
//!
//! | launcher | rank | ranks | rank on this machine |
//! |---|---|---|---|
//! | Open MPI's `mpirun` | `OMPI_COMM_WORLD_RANK` | `OMPI_COMM_WORLD_SIZE` | `OMPI_COMM_WORLD_LOCAL_RANK` |
//! | MPICH / Intel MPI (hydra) | `PMI_RANK` | `PMI_SIZE` | `MPI_LOCALRANKID` |
//! | `torchrun`, `tallow train --nproc` | `RANK` | `WORLD_SIZE` | `LOCAL_RANK` |
//! | Slurm's `srun` | `SLURM_PROCID` | `SLURM_NTASKS` | `SLURM_LOCALID` |
//!
//! The first row whose rank variable is set wins (mpirun inside a Slurm allocation is an MPI
//! launch). Slurm's variables count only inside a job step (`SLURM_STEP_ID` set): a batch
//! script's own shell also has `SLURM_PROCID=0`. A world of one is no launch.

use crate::{DistError, Result};

/// Who started this process.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Launcher {
    /// `mpirun` / `mpiexec` (Open MPI, MPICH, Intel MPI): MPI is initialized by its runtime.
    Mpi,
    /// `torchrun`-style variables (also what `tallow train --nproc` sets for its ranks).
    Torchrun,
    /// `srun` in a Slurm job.
    Slurm,
}

impl Launcher {
    pub fn name(self) -> &'static str {
        match self {
            Launcher::Mpi => "mpirun",
            Launcher::Torchrun => "torchrun-style variables (RANK, WORLD_SIZE)",
            Launcher::Slurm => "srun",
        }
    }
}

/// This process's rank in a job of more than one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Launch {
    pub launcher: Launcher,
    pub rank: usize,
    pub world: usize,
    /// Rank among this machine's ranks (its GPU index); 0 when the launcher does not say.
    pub local_rank: usize,
    /// Ranks on this machine, when the launcher says.
    pub local_world: Option<usize>,
}

/// (launcher, rank, world, local rank, local world) variable names, in precedence order.
const SCHEMES: [(Launcher, &str, &str, &str, &str); 4] = [
    (
        Launcher::Mpi,
        "OMPI_COMM_WORLD_RANK",
        "OMPI_COMM_WORLD_SIZE",
        "OMPI_COMM_WORLD_LOCAL_RANK",
        "OMPI_COMM_WORLD_LOCAL_SIZE",
    ),
    (
        Launcher::Mpi,
        "PMI_RANK",
        "PMI_SIZE",
        "MPI_LOCALRANKID",
        "MPI_LOCALNRANKS",
    ),
    (
        Launcher::Torchrun,
        "RANK",
        "WORLD_SIZE",
        "LOCAL_RANK",
        "LOCAL_WORLD_SIZE",
    ),
    (
        Launcher::Slurm,
        "SLURM_PROCID",
        "SLURM_NTASKS",
        "SLURM_LOCALID",
        "SLURM_NTASKS_PER_NODE",
    ),
];

/// Reads the launch from the process environment.
pub fn from_env() -> Result<Option<Launch>> {
    detect(&|k| std::env::var(k).ok())
}

/// The launch the variables `get` returns describe (None: one process).
pub fn detect(get: &dyn Fn(&str) -> Option<String>) -> Result<Option<Launch>> {
    for (launcher, rank_var, world_var, local_var, local_world_var) in SCHEMES {
        let Some(rank) = get(rank_var) else {
            continue;
        };
        if launcher == Launcher::Slurm && get("SLURM_STEP_ID").is_none() {
            // A batch script's shell, not a task of an srun step.
            continue;
        }
        let num = |var: &str, value: String| -> Result<usize> {
            value.trim().parse().map_err(|_| {
                DistError::Launch(format!(
                    "{var}={value:?} is not a number (set by {}?)",
                    launcher.name()
                ))
            })
        };
        let rank = num(rank_var, rank)?;
        let world = match get(world_var) {
            Some(v) => num(world_var, v)?,
            None => {
                return Err(DistError::Launch(format!(
                    "{rank_var} is set but {world_var} is not: set both (the number of ranks), \
                     or neither for one process"
                )))
            }
        };
        if world == 0 || rank >= world {
            return Err(DistError::Launch(format!(
                "{rank_var}={rank} with {world_var}={world}: the rank must be below the \
                 number of ranks"
            )));
        }
        if world == 1 {
            return Ok(None);
        }
        let local_rank = get(local_var).map(|v| num(local_var, v)).transpose()?;
        // Slurm writes e.g. `2(x3)`: the count before any repetition suffix.
        let local_world = get(local_world_var)
            .and_then(|v| v.split('(').next().and_then(|n| n.trim().parse().ok()));
        return Ok(Some(Launch {
            launcher,
            rank,
            world,
            local_rank: local_rank.unwrap_or(0),
            local_world,
        }));
    }
    Ok(None)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    fn launch(vars: &[(&str, &str)]) -> Result<Option<Launch>> {
        let map: HashMap<String, String> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        detect(&|k| map.get(k).cloned())
    }

    #[test]
    fn each_launcher_is_read_from_its_own_variables() {
        assert_eq!(launch(&[]).unwrap(), None, "no variables: one process");
        let ompi = launch(&[
            ("OMPI_COMM_WORLD_RANK", "1"),
            ("OMPI_COMM_WORLD_SIZE", "4"),
            ("OMPI_COMM_WORLD_LOCAL_RANK", "1"),
            ("OMPI_COMM_WORLD_LOCAL_SIZE", "2"),
            // Inside a Slurm allocation too: mpirun wins.
            ("SLURM_PROCID", "0"),
            ("SLURM_NTASKS", "1"),
            ("SLURM_STEP_ID", "0"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            ompi,
            Launch {
                launcher: Launcher::Mpi,
                rank: 1,
                world: 4,
                local_rank: 1,
                local_world: Some(2)
            }
        );
        let torch = launch(&[("RANK", "3"), ("WORLD_SIZE", "8"), ("LOCAL_RANK", "3")])
            .unwrap()
            .unwrap();
        assert_eq!(
            (torch.launcher, torch.rank, torch.world, torch.local_rank),
            (Launcher::Torchrun, 3, 8, 3)
        );
        let slurm = launch(&[
            ("SLURM_PROCID", "5"),
            ("SLURM_NTASKS", "8"),
            ("SLURM_LOCALID", "1"),
            ("SLURM_NTASKS_PER_NODE", "4(x2)"),
            ("SLURM_STEP_ID", "0"),
        ])
        .unwrap()
        .unwrap();
        assert_eq!(
            (
                slurm.launcher,
                slurm.rank,
                slurm.local_rank,
                slurm.local_world
            ),
            (Launcher::Slurm, 5, 1, Some(4))
        );
        // A batch script's shell (no step) and a world of one are single processes.
        assert_eq!(
            launch(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "8")]).unwrap(),
            None
        );
        assert_eq!(launch(&[("RANK", "0"), ("WORLD_SIZE", "1")]).unwrap(), None);
    }

    #[test]
    fn inconsistent_variables_are_refused_by_name() {
        let e = launch(&[("RANK", "1")]).unwrap_err().to_string();
        assert!(e.contains("RANK is set but WORLD_SIZE is not"), "{e}");
        let e = launch(&[("RANK", "2"), ("WORLD_SIZE", "2")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("RANK=2 with WORLD_SIZE=2"), "{e}");
        let e = launch(&[("PMI_RANK", "x"), ("PMI_SIZE", "2")])
            .unwrap_err()
            .to_string();
        assert!(e.contains("PMI_RANK=\"x\" is not a number"), "{e}");
    }
}
