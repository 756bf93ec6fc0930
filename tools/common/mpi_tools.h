/*
 * mpi_tools.h - the MPI halves of `pagedkv stress --mpi` (stress/mpi.c) and `pagedkv
 * generate --mpi` (generate/mpi.c), docs/sharding.md. Built only when meson finds MPI; without
 * it mpi_none.c gives the same entry points, which say so and exit 2.
 *
 * Owns: nothing but the entry points. stress/stress.c and generate/generate.c hand the whole
 * command to them when --mpi is on the command line (mpi_tools_requested).
 */
#ifndef PKV_TOOLS_MPI_H
#define PKV_TOOLS_MPI_H

#include <stdbool.h>
#include <string.h>

/* Whether argv names --mpi (before a "--" that ends the options). */
static inline bool mpi_tools_requested(int argc, char **argv)
{
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--") == 0)
            return false;
        if (strcmp(argv[i], "--mpi") == 0)
            return true;
    }
    return false;
}

/* The commands, with argv as cmd_stress / cmd_generate get it (--mpi included).
 * CLI exit codes: 0, 1 (failure, a bitwise mismatch), 2 (usage; or no MPI in this
 * build). */
int mpi_stress(int argc, char **argv);
int mpi_generate(int argc, char **argv);

#endif
