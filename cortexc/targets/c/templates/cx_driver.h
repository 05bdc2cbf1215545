/* cx_driver.h: the rules of the C driver that no cell shapes: tiles, chunks, staged rows, level windows, who
   shares a launch. Plain C (no template text): driver.j2 pastes it whole into every generated driver, so a
   package's C is still one file and its build key covers it, and tests/targets/c/test_driver_header.py
   compiles it alone and checks what these comments promise. What a cell decides comes in as macros set
   before it (CX_TILE, CX_NUM_ACCS) or as arguments. */
#ifndef CX_DRIVER_H
#define CX_DRIVER_H

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#ifndef CX_MAYBE_UNUSED
#define CX_MAYBE_UNUSED __attribute__((unused)) /* a cell uses some of these */
#endif

#ifndef CX_TILE
#define CX_TILE 32 /* the most rows of a tile (Target.tile_rows: the kernel file defines it first) */
#endif

#ifndef CX_NUM_ACCS
#define CX_NUM_ACCS 1 /* weight-gradient regions of a chunk (the driver: one per accumulated param) */
#endif

/* Determinism: every sum has one order whatever the number of threads.
   - A launch of `count` rows is cut into tiles whose size depends on `count` only (about CX_PARTS of them,
     at most CX_TILE rows, an even number where more than one: cx_tile_rows; two equal ones where that makes
     at most two: cx_team_tile_rows).
   - Weight gradients (AccumOuter) are deferred: the kernels keep their factors' rows, and after the recursion
     one GEMM per term, whose output blocks the threads share, sums each element over the rows in order.
   - What else a tile adds to a param (AccumSum: bias gradients) accumulates per chunk, not per thread: tile t
     of a launch adds into chunk t % CX_CHUNKS, and a chunk's tiles run in order on one thread at a time; the
     chunks are summed in index order at the end.
   - Rows several rows of one launch add to (a DAG child's gradient, an embedding row) are staged per row by
     the kernel, then added after the launch in row order (the threads share the columns: see cx_scatter). */
#define CX_PARTS 8
#define CX_MIN_TILE 16
#ifndef CX_ANY_ORDER
#define CX_CHUNKS 16
#define CX_BY_CHUNKS 1
#else
/* What determinism costs is measured against this build (-DCX_ANY_ORDER; benchmarks/bench_chain.py): the
   usual scheme it replaces, where each thread adds the tiles it happens to get into an accumulator of its
   own (a thread per chunk; at most CX_CHUNKS threads) and the tiles are dealt out like a forward's, so the
   sums depend on the team and, where tiles go dynamically, on the run. Nothing else changes. */
#define CX_CHUNKS 256
#define CX_BY_CHUNKS 0
#endif

/* count / CX_PARTS rows, CX_MIN_TILE..CX_TILE, and then the tiles that makes, if more than one, made an even
   number of (nearly) equal ones: 100 rows are 8 tiles of 12-13 (cx_tile_start), not 7 of 16 (the last 4), so
   two threads, or any even team, get equal shares and each takes the same rows of every level (schedule(static)
   in cx_run_tiles; measured, 2 cores (Sapphire Rapids), chain LSTM H=64, forward at B = 100: 1.15x, 200: 1.16x,
   64 and 128: 1.07x). A count of more than (CX_TILE - 2) * CX_TILE rows (960) may still make an odd number:
   its tiles go dynamic. */
static CX_MAYBE_UNUSED int64_t cx_tile_rows(int64_t count)
{
    int64_t tile = (count + CX_PARTS - 1) / CX_PARTS;
    if (tile < CX_MIN_TILE) tile = CX_MIN_TILE;
    if (tile > CX_TILE) tile = CX_TILE;
    int64_t ntiles = (count + tile - 1) / tile;
    if (ntiles < 2) return tile;
    ntiles += ntiles & 1;
    return (count + ntiles - 1) / ntiles;
}

/* The tiles of a launch the team shares: cx_tile_rows's, but a launch of at most two such tiles is cut into
   two equal ones (10 rows: 5 + 5; 20 rows: 10 + 10, not 16 + 4), so that two threads finish together; a
   launch of no more tiles than threads deals them out in order (schedule(static)), so thread t gets the
   same rows of every such level (see row sharing). Tiles follow the row count only, never the team: a
   forward's values do not depend on the tile a row is in, but the vectorised loops of a tile run some rows'
   elements in vector lanes and the rest as scalars (vector and scalar expf may differ in the last bit), and
   a backward's tiles are its chunks' order of summation. */
static CX_MAYBE_UNUSED int64_t cx_team_tile_rows(int64_t count)
{
    const int64_t tile = cx_tile_rows(count);
    return count <= 2 * tile ? (count + 1) / 2 : tile;
}

static CX_MAYBE_UNUSED int64_t cx_team_size(void)
{
#ifdef _OPENMP
    return omp_get_num_threads();
#else
    return 1;
#endif
}

static CX_MAYBE_UNUSED int64_t cx_team_rank(void)
{
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

/* A launch that fits one tile runs on one thread: a run of such levels goes without any barrier. */
static CX_MAYBE_UNUSED int cx_small(int64_t count) { return count <= cx_tile_rows(count); }

/* Tile t of `ntiles` over `count` rows: rows [t * count / ntiles, (t + 1) * count / ntiles), so the tiles
   differ by at most a row (100 rows in 8: 12, 13, 12, ...; two threads get 50 each, where tiles of 13 with a
   last of 9 gave them 52 and 48) and none has more rows than the tile size they were counted from. */
static CX_MAYBE_UNUSED int64_t cx_tile_start(int64_t count, int64_t ntiles, int64_t t) { return t * count / ntiles; }

/* The weight-gradient accumulators of the chunks: a block per chunk, allocated on the chunk's first use, with
   a region per param that tiles add to (offset, size). A region is zeroed when a launch of a kernel that adds
   to it first uses the chunk, and the sums at the end read only the zeroed regions: a chain's launch over all
   its nodes adds to the input weight's and the biases' regions of 16 chunks, never to the recurrent weight's
   (measured, chain LSTM 1000 x 1 H=64 backward: zeroing and summing every region of every chunk took ~15%). */
typedef struct {
    float *chunk[CX_CHUNKS];
    unsigned char zeroed[CX_CHUNKS][CX_NUM_ACCS];
    const int64_t *offset, *size; /* [CX_NUM_ACCS]: each region's first float in a chunk, and its floats */
    int64_t floats;               /* a chunk's floats */
    int failed;
} cx_accs;

/* What one launch adds to: the chunks, and its kernel's regions (indices into offset, then -1). */
typedef struct {
    cx_accs *chunks;
    const int *regions;
} cx_acc_use;

/* No chunk yet; regions of `size[r]` floats at `offset[r]` (the arrays outlive the accumulators). */
static CX_MAYBE_UNUSED void cx_accs_init(cx_accs *accs, const int64_t *offset, const int64_t *size, int64_t floats)
{
    memset(accs, 0, sizeof *accs);
    accs->offset = offset;
    accs->size = size;
    accs->floats = floats;
}

static CX_MAYBE_UNUSED void cx_accs_free(cx_accs *accs)
{
    for (int c = 0; c < CX_CHUNKS; ++c) free(accs->chunk[c]);
}

/* Chunk c's accumulator, its launch's regions zeroed on first use (NULL: no accumulators, or out of memory,
   which sets `failed`). */
static CX_MAYBE_UNUSED float *cx_chunk_acc(const cx_acc_use *use, int64_t c)
{
    if (!use) return NULL;
    cx_accs *accs = use->chunks;
    if (!accs->chunk[c]) {
        accs->chunk[c] = (float *)malloc(sizeof(float) * ((size_t)accs->floats + 1));
        if (!accs->chunk[c]) {
#pragma omp atomic write
            accs->failed = 1;
            return NULL;
        }
    }
    for (const int *r = use->regions; *r >= 0; ++r)
        if (!accs->zeroed[c][*r]) {
            memset(accs->chunk[c] + accs->offset[*r], 0, sizeof(float) * (size_t)accs->size[*r]);
            accs->zeroed[c][*r] = 1;
        }
    return accs->chunk[c];
}

/* Region r of the chunks that a launch zeroed, summed in chunk order and added to out[0, size[r]); the team
   shares the elements (an orphaned omp for). */
static CX_MAYBE_UNUSED void cx_accs_sum(const cx_accs *accs, int r, float *out)
{
    const float *used[CX_CHUNKS];
    int nused = 0;
    for (int c = 0; c < CX_CHUNKS; ++c)
        if (accs->zeroed[c][r]) used[nused++] = accs->chunk[c] + accs->offset[r];
    const int64_t size = accs->size[r];
#pragma omp for schedule(static)
    for (int64_t j = 0; j < size; ++j) {
        float total = 0.0f;
        for (int c = 0; c < nused; ++c) total += used[c][j];
        out[j] += total;
    }
}

/* One tile of a launch: `rows` rows from position `first`, adding to `acc` (its chunk's accumulator; NULL in a
   launch without). `launch`: what the launch's tiles share (the driver's: a kernel and its arguments). */
typedef void (*cx_tile_fn)(const void *launch, int64_t first, int64_t rows, float *acc);

static CX_MAYBE_UNUSED void cx_tile(cx_tile_fn run, const void *launch, int64_t pos0, int64_t count, int64_t ntiles,
                                    int64_t t, const cx_acc_use *accs)
{
    const int64_t start = cx_tile_start(count, ntiles, t);
    const int64_t rows = cx_tile_start(count, ntiles, t + 1) - start;
#if CX_BY_CHUNKS
    float *acc = cx_chunk_acc(accs, t % CX_CHUNKS);
#else
    float *acc = cx_chunk_acc(accs, cx_team_rank());
#endif
    if (accs && !acc) return;
    run(launch, pos0 + start, rows, acc);
}

/* Rows [pos0, pos0 + count) of a launch. `team`: the threads share the tiles (an orphaned omp for, whose
   barrier orders one launch after the next); else the calling thread runs them all, in order. With
   accumulators the work items are the chunks (each runs its tiles in order), else the tiles. `wait`: 0 lets
   a thread go on without the barrier where the tiles are dealt out statically (each thread the same rows
   of every launch of this count; see cx_aligned for when the next launch reads no other thread's rows);
   dynamically dealt tiles always end in the barrier. */
static CX_MAYBE_UNUSED void cx_run_tiles(cx_tile_fn run, const void *launch, int64_t pos0, int64_t count, int team,
                                         int wait, const cx_acc_use *accs)
{
    /* whether a launch runs alone is the count's and the kernel's, so its tiles follow the row count only */
    const int64_t tile = team ? cx_team_tile_rows(count) : cx_tile_rows(count);
    const int64_t ntiles = count > 0 ? (count + tile - 1) / tile : 0;
    if (!team) {
        for (int64_t t = 0; t < ntiles; ++t) cx_tile(run, launch, pos0, count, ntiles, t, accs);
    } else if (accs && CX_BY_CHUNKS) {
        const int64_t nchunks = ntiles < CX_CHUNKS ? ntiles : CX_CHUNKS;
        /* as below (a chunk is a tile here), but where some chunks have more tiles than others, dynamic */
        if (nchunks <= cx_team_size() || (ntiles == nchunks && nchunks % cx_team_size() == 0)) {
#pragma omp for schedule(static) nowait
            for (int64_t c = 0; c < nchunks; ++c)
                for (int64_t t = c; t < ntiles; t += CX_CHUNKS) cx_tile(run, launch, pos0, count, ntiles, t, accs);
            if (wait) {
#pragma omp barrier
            }
        } else {
#pragma omp for schedule(dynamic, 1)
            for (int64_t c = 0; c < nchunks; ++c)
                for (int64_t t = c; t < ntiles; t += CX_CHUNKS) cx_tile(run, launch, pos0, count, ntiles, t, accs);
        }
    } else if (ntiles <= cx_team_size() || ntiles % cx_team_size() == 0) {
        /* a tile each, or equal shares of them, in order: each thread the same rows of every level */
#pragma omp for schedule(static) nowait
        for (int64_t t = 0; t < ntiles; ++t) cx_tile(run, launch, pos0, count, ntiles, t, accs);
        if (wait) {
#pragma omp barrier
        }
    } else {
#pragma omp for schedule(dynamic, 1)
        for (int64_t t = 0; t < ntiles; ++t) cx_tile(run, launch, pos0, count, ntiles, t, accs);
    }
}

/* Whether level `level` (2 or more) reads, of the level below, only the rows that the same thread wrote when
   the two are shared by the team: as many rows as that level, each with one child, the row at its own
   index below (B chains of equal length: chain b is row b of every level). The tiles and chunks follow the
   row count only and are dealt out statically, so the threads can go from one such level to the next
   without a barrier (measured, 2 cores, chain LSTM H=64: 1000 x 10 forward 1.08x, training 1.12x). The
   arrays are cx_call's of the same names. */
static CX_MAYBE_UNUSED int cx_aligned(const int64_t *level_ptr, const int64_t *level_order, const int64_t *edge_ptr,
                                      const int64_t *edge_child, int64_t level)
{
    const int64_t *lp = level_ptr;
    const int64_t first = lp[level], count = lp[level + 1] - first, below = lp[level - 1];
    if (lp[level] - below != count) return 0;
    for (int64_t i = 0; i < count; ++i) {
        const int64_t e = edge_ptr[first + i];
        if (edge_ptr[first + i + 1] - e != 1 || edge_child[e] != level_order[below + i]) return 0;
    }
    return 1;
}

/* Row sharing: a launch of one tile (a level of a batch of chains) of a level kernel whose GEMMs multiply-add
   at least CX_ROWS_MIN_MACS times in all, over at least CX_ROWS_MIN rows, is shared by the team by rows in
   order, in two tiles (cx_team_tile_rows; a backward's are two chunks). Thread t gets the same rows of
   every such level, so where a node's child sits at its own row of the level below (chains of equal
   length: chain b is row b of every level) each thread reads only states it wrote, and the level costs one
   barrier (measured, 2 cores, chain
   LSTM H=64, forward: 1000 x 10 0.63-0.68x the time on one thread, 1000 x 8 0.69-0.71x; at 2-6 rows no
   gain). `row_macs` is the kernel's multiply-adds per row (0: never). */
#define CX_ROWS_MIN 8
#define CX_ROWS_MIN_MACS 131072

static CX_MAYBE_UNUSED int cx_rows_shared(int64_t count, int64_t row_macs)
{
    return row_macs > 0 && count >= CX_ROWS_MIN && count * row_macs >= CX_ROWS_MIN_MACS;
}

/* Column sharing (the CPU form of Cortex's model persistence): a small level, one tile of rows, is not run
   by one thread while the others wait, but by every thread of the team for the columns it owns (whole GEMM
   panels of each period of the kernel's columns; see passes/columns.py), so each core reads only its
   slice of the weights, and the level ends in one barrier. A level whose split GEMMs multiply-add fewer than
   CX_SPLIT_MIN_MACS times still runs alone: its work would not pay for the barrier and for reading the other
   cores' columns of the states (measured, 2 cores: SST batch 10 at H=256, 655360 per row, 1.3x faster; a
   chain LSTM at H=64, 16384 per row, no faster at 8-10 rows, slower at 4). Larger levels go by rows (by
   columns, 2-4 tiles at H=64 were 1.2-1.4x slower, at H=256 no faster). A column is the same expression on
   the same vector lanes, and the same GEMM sum over k, whoever computes it (a kernel called without columns
   runs its whole-width loops), so results do not depend on it. */
#define CX_SPLIT_MIN_MACS 1048576
#define CX_SPLIT_MAX_TILES 1

/* This thread's columns in its team: residues [u0, u0 + nu) of the period, whole granules (GEMM panels), the
   team's in rank order; whether the team shares small levels by columns. */
static CX_MAYBE_UNUSED int cx_own_columns(int period, int granule, int *u0, int *nu)
{
    const int granules = period / granule;
    const int team = (int)cx_team_size(), me = (int)cx_team_rank();
    const int g0 = me * granules / team, g1 = (me + 1) * granules / team;
    *u0 = g0 * granule;
    *nu = (g1 - g0) * granule;
    return team > 1 && granules > 1;
}

/* Whether a launch goes by columns: `macs`, its kernel's multiply-adds per row where the team shares
   columns (0: it does not), at least CX_SPLIT_MIN_MACS in all, and at most CX_SPLIT_MAX_TILES tiles. */
static CX_MAYBE_UNUSED int cx_columns(int64_t count, int64_t macs)
{
    const int64_t tile = cx_tile_rows(count);
    return macs > 0 && count * macs >= CX_SPLIT_MIN_MACS && (count + tile - 1) / tile <= CX_SPLIT_MAX_TILES;
}

/* A launch that runs alone (one thread, no barrier): one tile of rows, unless the team shares it by columns
   or (a forward's) by rows. */
static CX_MAYBE_UNUSED int cx_alone(int64_t count, int64_t macs, int64_t row_macs)
{
    return cx_small(count) && !cx_columns(count, macs) && !cx_rows_shared(count, row_macs);
}

/* The `rows` staged rows of one launch (by row, or by edge for rows per child: values [rows][width], `dst`
   the destination row of each) added to their destinations in row order; `team`: the team shares the
   columns (an orphaned omp for). */
static CX_MAYBE_UNUSED void cx_scatter(float *const *dst, const float *val, int64_t rows, int64_t width, int team)
{
    /* a row's destination never overlaps the staged values, so each row's adds vectorise (restrict): every
       element still gets its rows' values in row order */
    const int64_t blocks = (width + 15) / 16;
    if (team) {
#pragma omp for schedule(static)
        for (int64_t b = 0; b < blocks; ++b) {
            const int64_t lo = 16 * b, hi = width < lo + 16 ? width : lo + 16;
            for (int64_t r = 0; r < rows; ++r) {
                float *restrict out = dst[r];
                const float *restrict src = val + r * width;
#pragma omp simd
                for (int64_t j = lo; j < hi; ++j) out[j] += src[j];
            }
        }
    } else {
        for (int64_t r = 0; r < rows; ++r) {
            float *restrict out = dst[r];
            const float *restrict src = val + r * width;
#pragma omp simd
            for (int64_t j = 0; j < width; ++j) out[j] += src[j];
        }
    }
}

/* Windowed hoisting (Target.hoist_window_bytes; the driver's cx_windowed says when): the level after the last
   of the window that starts at `level`, as many levels as fit `rows` rows (at least one). */
static CX_MAYBE_UNUSED int64_t cx_window_end(const int64_t *level_ptr, int64_t num_levels, int64_t rows, int64_t level)
{
    const int64_t *lp = level_ptr;
    int64_t end = level + 1;
    while (end < num_levels && lp[end + 1] - lp[level] <= rows) ++end;
    return end;
}

/* Whether every level above the leaves fits a window of `rows` rows (else the call fails: the caller sized it
   wrong). */
static CX_MAYBE_UNUSED int cx_window_fits(const int64_t *level_ptr, int64_t num_levels, int64_t rows)
{
    for (int64_t level = 1; level < num_levels; ++level)
        if (level_ptr[level + 1] - level_ptr[level] > rows) return 0;
    return 1;
}

/* The threads of one call, chosen from the forest's shape: the rows its launches can share (levels of
   more than one tile, the phases over all nodes) against the rows that run alone (levels of one tile, run
   in `omp single` while the other threads wait). A call with little to share, or dominated by its run-alone
   levels (a few long chains, one small tree), runs on one thread: a second one would only wait at barriers,
   and on a machine where another process takes a core every barrier can cost a time slice. Results do not
   depend on it (tiles and chunks follow the row counts only). */
#define CX_SHARE_MIN_ROWS 256
#define CX_SHARE_RATIO 2

static CX_MAYBE_UNUSED void cx_count_rows(int64_t count, int64_t macs, int64_t row_macs, int64_t *shared,
                                          int64_t *alone)
{
    if (cx_alone(count, macs, row_macs))
        *alone += count;
    else
        *shared += count;
}

/* The team of a call of `shared` and `alone` rows (cx_count_rows), of at most `most` threads. */
static CX_MAYBE_UNUSED int cx_call_team(int most, int64_t shared, int64_t alone)
{
    if (shared < CX_SHARE_MIN_ROWS || shared < CX_SHARE_RATIO * alone) return 1;
    return CX_BY_CHUNKS || most <= CX_CHUNKS ? most : CX_CHUNKS; /* -DCX_ANY_ORDER: a chunk per thread */
}

#endif /* CX_DRIVER_H */
