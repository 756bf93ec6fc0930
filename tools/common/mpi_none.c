/*
 * mpi_none.c - `--mpi` in a build without MPI: the entry points of mpi_tools.h say
 * that MPI was not found when this `pagedkv` was built, and exit 2.
 */
#include <stdio.h>

#include "common/cli.h"
#include "common/mpi_tools.h"

static int no_mpi(const char *cmd)
{
    fprintf(stderr, "pagedkv %s: --mpi: this pagedkv was built without MPI (meson found "
                    "no 'mpi' dependency; install libopenmpi-dev openmpi-bin or MPICH and "
                    "reconfigure)\n", cmd);
    return CLI_USAGE;
}

int mpi_stress(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    return no_mpi("stress");
}

int mpi_generate(int argc, char **argv)
{
    (void)argc;
    (void)argv;
    return no_mpi("generate");
}
