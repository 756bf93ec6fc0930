/*
 * mpi_common.h - what `stress --mpi` (stress/mpi.c) and `generate --mpi`
 * (generate/mpi.c) share of MPI: bringing it up around a command's run, and the
 * "worst of every rank" reduction both use to agree on failure. Built only with MPI
 * (tools/meson.build); the library never sees it.
 *
 * Owns: MPI_Init / MPI_Finalize for a tools command. Does not own: the commands'
 * options (each parses its own before MPI starts, so --help and usage errors need
 * no mpirun) nor their wire traffic.
 */
#ifndef PKV_TOOLS_MPI_COMMON_H
#define PKV_TOOLS_MPI_COMMON_H

/* The largest v over every rank of MPI_COMM_WORLD (an MPI_Allreduce with MPI_MAX):
 * a status or exit code where any rank's failure must become every rank's. */
int mpi_common_max(int v);

/* MPI_Init, then run(o, rank, ranks) on every rank, then MPI_Finalize. Returns the
 * worst exit code over all ranks, so that mpirun's status is the run's; CLI_FAIL
 * (after `pagedkv CMD: MPI_Init failed` on stderr) when MPI does not start. */
int mpi_common_main(const char *cmd, int argc, char **argv,
                    int (*run)(const void *o, int rank, int ranks), const void *o);

#endif
