/*
 * mpi_common.h - what `stress --mpi` (stress/mpi.c) and `generate --mpi`
 * (generate/mpi.c) share of MPI: bringing it up around a command's run, the "worst of
 * every rank" reduction both use to agree on failure, and the one way they wait for
 * each other. Built only with MPI (tools/meson.build); the library never sees it.
 *
 * Owns: MPI_Init / MPI_Finalize for a tools command; every exchange between ranks
 * (mpi_* below). Does not own: the commands' options (each parses its own before MPI
 * starts, so --help and usage errors need no mpirun) nor what they send.
 *
 * Waiting. MPI's blocking calls poll inside the library: a rank that waits for a
 * stopped or dead peer (a frozen node) spins at 100% CPU forever. So every exchange
 * here is posted nonblocking and waited for by mpi_common_wait: MPI_Test in a short
 * busy loop (WAIT_SPIN_NS: a step of the token loop keeps its latency), then sleeps
 * that double up to WAIT_SLEEP_MAX_NS, and after --timeout seconds without an answer
 * a message on stderr that names the rank and the exchange, and MPI_Abort: mpirun
 * ends every rank (the stopped one too) and exits non-zero.
 *
 * Invariant: a rank never waits longer than the timeout for one exchange, and never
 * spins longer than WAIT_SPIN_NS at a time.
 */
#ifndef PKV_TOOLS_MPI_COMMON_H
#define PKV_TOOLS_MPI_COMMON_H

#include <mpi.h>
#include <stdint.h>

/* --timeout's default, seconds: longer than any one wait of a healthy run (a rank's
 * appends between two decode points, the checking engine's prefix on rank 0), far
 * shorter than "forever". */
#define MPI_COMMON_TIMEOUT_DEFAULT 120.0

/* The largest v over every rank of MPI_COMM_WORLD (an MPI_Allreduce with MPI_MAX):
 * a status or exit code where any rank's failure must become every rank's. */
int mpi_common_max(int v);

/* MPI_Init, then run(o, rank, ranks) on every rank, then MPI_Finalize. Returns the
 * worst exit code over all ranks, so that mpirun's status is the run's; CLI_FAIL
 * (after `pagedkv CMD: MPI_Init failed` on stderr) when MPI does not start.
 * timeout_s: mpi_common_wait's limit (seconds, > 0). */
int mpi_common_main(const char *cmd, int argc, char **argv, double timeout_s,
                    int (*run)(const void *o, int rank, int ranks), const void *o);

/* Wait for r to complete (see above); `what` names the exchange in the message of a
 * timeout, after which this does not return. */
void mpi_common_wait(MPI_Request *r, const char *what);

/* The exchanges of the two commands, each a nonblocking call and mpi_common_wait. */
void mpi_barrier(const char *what);
void mpi_send(const void *buf, int n, MPI_Datatype t, int to, int tag, const char *what);
void mpi_recv(void *buf, int n, MPI_Datatype t, int from, int tag, const char *what);
void mpi_bcast(void *buf, int n, MPI_Datatype t, int root, const char *what);
void mpi_gather(const void *s, int sn, MPI_Datatype st, void *r, int rn, MPI_Datatype rt,
                int root, const char *what);
void mpi_gatherv(const void *s, int sn, MPI_Datatype st, void *r, const int *counts,
                 const int *displs, MPI_Datatype rt, int root, const char *what);
void mpi_allgatherv(const void *s, int sn, MPI_Datatype st, void *r, const int *counts,
                    const int *displs, MPI_Datatype rt, const char *what);
void mpi_reduce_sum_u64(const uint64_t *s, uint64_t *r, int n, int root, const char *what);

#endif
