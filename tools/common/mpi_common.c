/*
 * mpi_common.c - MPI's bring-up, the max-reduction and the waits that neither spin
 * nor hang of the --mpi commands (mpi_common.h).
 *
 * Process-wide state: the command's name, this rank and the timeout, set once by
 * mpi_common_main before the run; a wait reads them for its message.
 */
#include <mpi.h>
#include <stdio.h>
#include <time.h>

#include "common/cli.h"
#include "common/mpi_common.h"

/* Busy polling before the first sleep: a decode step's exchange completes within it
 * on a healthy run, so the sleeps cost no latency there. */
#define WAIT_SPIN_NS 2000000L
/* The longest sleep between two MPI_Test calls, once a wait has lasted: what a frozen
 * peer costs the others is one wake-up per this much time. */
#define WAIT_SLEEP_MAX_NS 20000000L

static const char *wait_cmd = "?";
static int wait_rank;
static double wait_timeout = MPI_COMMON_TIMEOUT_DEFAULT;

void mpi_common_wait(MPI_Request *r, const char *what)
{
    const double t0 = cli_now();
    long sleep_ns = 50000;
    for (;;) {
        int done = 0;
        MPI_Test(r, &done, MPI_STATUS_IGNORE);
        if (done)
            return;
        const double waited = cli_now() - t0;
        if (waited > wait_timeout) {
            fprintf(stderr, "pagedkv %s: rank %d: no answer from the other ranks for %.0f s "
                            "while %s: a rank has stopped, hung or died (--timeout %g); "
                            "ending the run\n", wait_cmd, wait_rank, waited, what,
                    wait_timeout);
            fflush(stderr);
            MPI_Abort(MPI_COMM_WORLD, CLI_FAIL);
            return;   /* MPI_Abort does not return; if it did, the caller goes on */
        }
        if (waited * 1e9 < (double)WAIT_SPIN_NS)
            continue;
        nanosleep(&(struct timespec){0, sleep_ns}, NULL);
        sleep_ns = sleep_ns * 2 > WAIT_SLEEP_MAX_NS ? WAIT_SLEEP_MAX_NS : sleep_ns * 2;
    }
}

void mpi_barrier(const char *what)
{
    MPI_Request r;
    MPI_Ibarrier(MPI_COMM_WORLD, &r);
    mpi_common_wait(&r, what);
}

void mpi_send(const void *buf, int n, MPI_Datatype t, int to, int tag, const char *what)
{
    MPI_Request r;
    MPI_Isend(buf, n, t, to, tag, MPI_COMM_WORLD, &r);
    mpi_common_wait(&r, what);
}

void mpi_recv(void *buf, int n, MPI_Datatype t, int from, int tag, const char *what)
{
    MPI_Request r;
    MPI_Irecv(buf, n, t, from, tag, MPI_COMM_WORLD, &r);
    mpi_common_wait(&r, what);
}

void mpi_bcast(void *buf, int n, MPI_Datatype t, int root, const char *what)
{
    MPI_Request r;
    MPI_Ibcast(buf, n, t, root, MPI_COMM_WORLD, &r);
    mpi_common_wait(&r, what);
}

void mpi_gather(const void *s, int sn, MPI_Datatype st, void *r, int rn, MPI_Datatype rt,
                int root, const char *what)
{
    MPI_Request q;
    MPI_Igather(s, sn, st, r, rn, rt, root, MPI_COMM_WORLD, &q);
    mpi_common_wait(&q, what);
}

void mpi_gatherv(const void *s, int sn, MPI_Datatype st, void *r, const int *counts,
                 const int *displs, MPI_Datatype rt, int root, const char *what)
{
    MPI_Request q;
    MPI_Igatherv(s, sn, st, r, counts, displs, rt, root, MPI_COMM_WORLD, &q);
    mpi_common_wait(&q, what);
}

void mpi_allgatherv(const void *s, int sn, MPI_Datatype st, void *r, const int *counts,
                    const int *displs, MPI_Datatype rt, const char *what)
{
    MPI_Request q;
    MPI_Iallgatherv(s, sn, st, r, counts, displs, rt, MPI_COMM_WORLD, &q);
    mpi_common_wait(&q, what);
}

void mpi_reduce_sum_u64(const uint64_t *s, uint64_t *r, int n, int root, const char *what)
{
    MPI_Request q;
    MPI_Ireduce(s, r, n, MPI_UINT64_T, MPI_SUM, root, MPI_COMM_WORLD, &q);
    mpi_common_wait(&q, what);
}

int mpi_common_max(int v)
{
    int worst = v;
    MPI_Request q;
    MPI_Iallreduce(&v, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD, &q);
    mpi_common_wait(&q, "agreeing on the exit status");
    return worst;
}

int mpi_common_main(const char *cmd, int argc, char **argv, double timeout_s,
                    int (*run)(const void *o, int rank, int ranks), const void *o)
{
    if (MPI_Init(&argc, &argv) != MPI_SUCCESS)
        return cli_fail(cmd, "MPI_Init failed");
    int rank = 0, R = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &R);
    wait_cmd = cmd;
    wait_rank = rank;
    wait_timeout = timeout_s;
    /* every rank returns the worst exit code, so mpirun's status is the run's */
    const int worst = mpi_common_max(run(o, rank, R));
    MPI_Finalize();
    return worst;
}
