/*
 * mpi_common.c - MPI's bring-up and the max-reduction for the --mpi commands
 * (mpi_common.h).
 */
#include <mpi.h>

#include "common/cli.h"
#include "common/mpi_common.h"

int mpi_common_max(int v)
{
    int worst = v;
    MPI_Allreduce(&v, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    return worst;
}

int mpi_common_main(const char *cmd, int argc, char **argv,
                    int (*run)(const void *o, int rank, int ranks), const void *o)
{
    if (MPI_Init(&argc, &argv) != MPI_SUCCESS)
        return cli_fail(cmd, "MPI_Init failed");
    int rank = 0, R = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &R);
    /* every rank returns the worst exit code, so mpirun's status is the run's */
    const int worst = mpi_common_max(run(o, rank, R));
    MPI_Finalize();
    return worst;
}
