/*
 * A white-box probe of an exported cell's folding (tests/test_export_fold.py), compiled with the cell's
 * own .c included, so that it sees the model's folded tables:
 *   probe poison PARAMS INPUTS   load, fill every built table with NaN, run a forward on INPUTS: prints
 *                                "tables T nodes N nan_nodes K" (K > 0 only if the forward read a table)
 *   probe fail PARAMS I          load with the I-th table allocation failing: prints the load's message
 *                                and its return code (exit 1), or "loaded folded_bytes B" when it did not fail
 * Build: cc -DCELL=<Cell> -DCELL_C='"<Cell>.c"' -DCELL_IO='"<Cell>_io.h"' -I<export dir> ... -fopenmp -lm
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

static int probe_allocs = 0, probe_fail_at = -1;

static void *probe_alloc(size_t bytes)
{
    return probe_allocs++ == probe_fail_at ? NULL : malloc(bytes);
}

#define CX_FOLD_ALLOC(bytes) probe_alloc(bytes)
#include CELL_C
#include CELL_IO

#define PROBE_CAT2(a, b) a##b
#define PROBE_CAT(a, b) PROBE_CAT2(a, b)
#define API(x) PROBE_CAT(CELL, x)

int main(int argc, char **argv)
{
    char error[512];
    API(_model) *model = NULL;
    if (argc == 4 && strcmp(argv[1], "fail") == 0) {
        probe_fail_at = atoi(argv[3]);
        const int rc = API(_load)(argv[2], &model, error, sizeof error);
        if (rc) {
            printf("%s (%d)\n", error, rc);
            return model == NULL ? 1 : 2; /* 2: a failed load left a model */
        }
        printf("loaded folded_bytes %lld\n", (long long)API(_folded_bytes)(model));
        API(_free)(model);
        return 0;
    }
    if (argc != 4 || strcmp(argv[1], "poison") != 0) return 3;
    if (API(_load)(argv[2], &model, error, sizeof error)) {
        printf("%s\n", error);
        return 1;
    }
    int tables = 0;
    for (int f = 0; f < CX_NUM_FOLDS; ++f)
        if (model->folded[f]) {
            ++tables;
            for (int64_t k = 0; k < cx_fold_bytes[f] / 4; ++k) model->folded[f][k] = NAN;
        }
    cx_st_file file;
    API(_forest) forest;
    API(_inputs) inputs;
    API(_result) result;
    if (cx_st_read(argv[3], &file, error, sizeof error) || API(_io_read)(&file, &forest, &inputs, error, sizeof error) ||
        API(_forward)(model, &forest, &inputs, &result, error, sizeof error)) {
        printf("%s\n", error);
        return 1;
    }
    int64_t nan_nodes = 0;
    for (int64_t i = 0; i < result.num_nodes; ++i) {
        int bad = 0;
        for (int64_t j = 0; j < PROBE_WIDTH; ++j) bad |= isnan(result.h[i * PROBE_WIDTH + j]);
        nan_nodes += bad;
    }
    printf("tables %d nodes %lld nan_nodes %lld\n", tables, (long long)result.num_nodes, (long long)nan_nodes);
    API(_result_free)(&result);
    cx_st_free(&file);
    API(_free)(model);
    return 0;
}
