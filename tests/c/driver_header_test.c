/*
 * Unit tests of the C driver's rules, cortexc/targets/c/templates/cx_driver.h (run by
 * tests/targets/c/test_driver_header.py). Each check is a program argument; a failed check prints where and
 * why and exits 1. Built without -ffast-math, so each reference sum below has the order it is written in.
 * Build: cc -std=c11 -O2 -fopenmp -I cortexc/targets/c/templates tests/c/driver_header_test.c
 */
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define CX_NUM_ACCS 3 /* as a driver sets it, before the header: three regions a chunk */
#include "cx_driver.h"

#define CHECK(cond, ...)                                                        \
    do {                                                                        \
        if (!(cond)) {                                                          \
            fprintf(stderr, "%s:%d: failed: %s: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                       \
            fputc('\n', stderr);                                                \
            exit(1);                                                            \
        }                                                                       \
    } while (0)

#define MAX_TEAM 4
#define MAX_ROWS 6000
#define MAX_TILES (MAX_ROWS / 4)

/* Floats of very different sizes, so that sums in another order give other bits. */
static uint64_t rng_state = 88172645463325252ull;

static float random_float(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    const float unit = (float)(rng_state >> 40) / (float)(1 << 24) - 0.5f;
    static const float scales[] = {1e-3f, 1.0f, 1e3f, 1e6f};
    return unit * scales[(rng_state >> 20) & 3];
}

static int64_t ntiles_of(int64_t count, int64_t tile) { return count > 0 ? (count + tile - 1) / tile : 0; }

/* cx_tile_rows: at most CX_TILE rows; one tile exactly for counts of at most CX_MIN_TILE; else an even number
   of tiles up to (CX_TILE - 2) * CX_TILE rows (the header's bound; 961 rows make 31 tiles of 32), at least CX_PARTS of them from CX_PARTS * CX_MIN_TILE rows;
   cx_tile_start's tiles cover the rows in order and differ by at most a row. */
static void check_tiles(void)
{
    for (int64_t count = 1; count <= MAX_ROWS; ++count) {
        const int64_t tile = cx_tile_rows(count), ntiles = ntiles_of(count, tile);
        CHECK(tile <= CX_TILE, "count %lld: tile %lld", (long long)count, (long long)tile);
        CHECK(2 * tile >= CX_MIN_TILE, "count %lld: tile %lld (evening the tiles at most halves one)",
              (long long)count, (long long)tile);
        CHECK((ntiles == 1) == (count <= CX_MIN_TILE), "count %lld: %lld tiles", (long long)count, (long long)ntiles);
        CHECK(cx_small(count) == (ntiles == 1), "count %lld", (long long)count);
        if (ntiles > 1 && count <= (CX_TILE - 2) * CX_TILE)
            CHECK(ntiles % 2 == 0, "count %lld: %lld tiles of %lld", (long long)count, (long long)ntiles, (long long)tile);
        if (count >= CX_PARTS * CX_MIN_TILE) CHECK(ntiles >= CX_PARTS, "count %lld: %lld tiles", (long long)count, (long long)ntiles);
        int64_t least = count, most = 0;
        for (int64_t t = 0; t < ntiles; ++t) {
            const int64_t rows = cx_tile_start(count, ntiles, t + 1) - cx_tile_start(count, ntiles, t);
            least = rows < least ? rows : least;
            most = rows > most ? rows : most;
        }
        CHECK(cx_tile_start(count, ntiles, 0) == 0 && cx_tile_start(count, ntiles, ntiles) == count, "count %lld",
              (long long)count);
        CHECK(least >= 1 && most - least <= 1 && most <= tile, "count %lld: tiles of %lld..%lld rows, tile %lld",
              (long long)count, (long long)least, (long long)most, (long long)tile);
    }
    /* the header's example: 100 rows are 8 tiles of 12-13, not 7 of 16 and one of 4 */
    CHECK(ntiles_of(100, cx_tile_rows(100)) == 8, "100 rows: %lld tiles", (long long)ntiles_of(100, cx_tile_rows(100)));
    CHECK(cx_tile_start(100, 8, 1) == 12 && cx_tile_start(100, 8, 2) == 25, "100 rows in 8 tiles");
}

/* cx_team_tile_rows: two equal tiles where cx_tile_rows makes at most two, else cx_tile_rows's. */
static void check_team_tiles(void)
{
    CHECK(cx_team_tile_rows(10) == 5 && cx_team_tile_rows(20) == 10, "10 rows: %lld, 20 rows: %lld",
          (long long)cx_team_tile_rows(10), (long long)cx_team_tile_rows(20));
    for (int64_t count = 1; count <= MAX_ROWS; ++count) {
        const int64_t tile = cx_tile_rows(count), team = cx_team_tile_rows(count);
        if (ntiles_of(count, tile) <= 2)
            CHECK(team == (count + 1) / 2 && ntiles_of(count, team) == (count > 1 ? 2 : 1), "count %lld: %lld",
                  (long long)count, (long long)team);
        else
            CHECK(team == tile, "count %lld: %lld, not %lld", (long long)count, (long long)team, (long long)tile);
    }
}

/* What a test launch records of its tiles, and adds: row r adds value(r, j) to element j of its region. */
typedef struct {
    const cx_accs *accs;
    int region;
    int64_t width;
    const float *values; /* [MAX_ROWS][width] */
    int64_t tiles, first[MAX_TILES], rows[MAX_TILES], chunk[MAX_TILES];
    int64_t last[CX_CHUNKS]; /* the first row of each chunk's latest tile */
} launch_log;

static void record_tile(const void *launch, int64_t first, int64_t rows, float *acc)
{
    launch_log *log = (launch_log *)launch; /* the test's own: written under `critical` */
    int64_t chunk = -1;
    for (int c = 0; c < CX_CHUNKS && log->accs; ++c) /* allocated before the launch (allocate_chunks) */
        if (acc && acc == log->accs->chunk[c]) chunk = c;
    CHECK(!log->accs || chunk >= 0, "a tile of a launch with accumulators got none");
    if (acc) {
        float *region = acc + log->accs->offset[log->region];
        for (int64_t r = first; r < first + rows; ++r)
            for (int64_t j = 0; j < log->width; ++j) region[j] += log->values[r * log->width + j];
    }
#pragma omp critical(cx_test_log)
    {
        CHECK(log->tiles < MAX_TILES, "too many tiles");
        if (chunk >= 0) {
            CHECK(first > log->last[chunk], "chunk %lld ran the tile at %lld after the one at %lld", (long long)chunk,
                  (long long)first, (long long)log->last[chunk]);
            log->last[chunk] = first;
        }
        log->first[log->tiles] = first;
        log->rows[log->tiles] = rows;
        log->chunk[log->tiles] = chunk;
        ++log->tiles;
    }
}

/* Every chunk allocated before a team's launches, so that no thread writes a chunk pointer while another's tile
   looks for its own (record_tile), and filled with NaN, so that a region a launch reads without zeroing it
   shows. */
static void allocate_chunks(cx_accs *accs)
{
    for (int c = 0; c < CX_CHUNKS; ++c) {
        accs->chunk[c] = (float *)malloc(sizeof(float) * (size_t)accs->floats);
        CHECK(accs->chunk[c], "out of memory");
        for (int64_t j = 0; j < accs->floats; ++j) accs->chunk[c][j] = NAN;
    }
}

static void run_launch(launch_log *log, const cx_acc_use *use, int64_t pos0, int64_t count, int team, int threads)
{
    log->tiles = 0;
    for (int c = 0; c < CX_CHUNKS; ++c) log->last[c] = -1;
#pragma omp parallel num_threads(threads)
    {
        CHECK(omp_get_num_threads() == threads, "a team of %d, not %d", omp_get_num_threads(), threads);
        if (team) {
            cx_run_tiles(record_tile, log, pos0, count, 1, 0, use);
        } else {
#pragma omp single
            cx_run_tiles(record_tile, log, pos0, count, 0, 1, use);
        }
    }
}

/* A launch's tiles, sorted by first row: the partition of cx_tile_rows (cx_team_tile_rows for a team), each
   tile in chunk t % CX_CHUNKS, whatever the team. */
static void check_launch_tiles(launch_log *log, int64_t pos0, int64_t count, int team)
{
    const int64_t tile = team ? cx_team_tile_rows(count) : cx_tile_rows(count), ntiles = ntiles_of(count, tile);
    CHECK(log->tiles == ntiles, "count %lld: %lld tiles ran, not %lld", (long long)count, (long long)log->tiles,
          (long long)ntiles);
    for (int64_t t = 0; t < ntiles; ++t) {
        int64_t found = -1;
        for (int64_t i = 0; i < log->tiles; ++i)
            if (log->first[i] == pos0 + cx_tile_start(count, ntiles, t)) found = i;
        CHECK(found >= 0, "count %lld: no tile at %lld", (long long)count, (long long)cx_tile_start(count, ntiles, t));
        CHECK(log->rows[found] == cx_tile_start(count, ntiles, t + 1) - cx_tile_start(count, ntiles, t),
              "count %lld: tile %lld of %lld rows", (long long)count, (long long)t, (long long)log->rows[found]);
        CHECK(log->chunk[found] == (log->accs ? t % CX_CHUNKS : -1), "count %lld: tile %lld in chunk %lld",
              (long long)count, (long long)t, (long long)log->chunk[found]);
    }
}

/* cx_run_tiles: by one thread or a team of 1-4, with or without accumulators, the same tiles and chunks. */
static void check_dispatch(void)
{
    static const int64_t counts[] = {0, 1, 5, 16, 17, 20, 33, 100, 257, 999, 1000, 5000};
    static const int64_t offset[1] = {0}, size[1] = {1};
    static const int region[] = {0, -1};
    static launch_log log;
    for (size_t i = 0; i < sizeof counts / sizeof counts[0]; ++i)
        for (int with_accs = 0; with_accs < 2; ++with_accs)
            for (int team = 0; team < 2; ++team)
                for (int threads = 1; threads <= MAX_TEAM; ++threads) {
                    cx_accs accs;
                    cx_accs_init(&accs, offset, size, 1);
                    allocate_chunks(&accs);
                    const cx_acc_use use = {&accs, region};
                    memset(&log, 0, sizeof log);
                    log.accs = with_accs ? &accs : NULL;
                    run_launch(&log, with_accs ? &use : NULL, 7, counts[i], team, threads);
                    check_launch_tiles(&log, 7, counts[i], team);
                    cx_accs_free(&accs);
                }
}

/* The chunked accumulation: every element the sum the header describes (chunk c adds its tiles, t = c mod
   CX_CHUNKS, in order, over launches in order, from zero; the used chunks summed in index order from zero and
   added to the result), bitwise, whatever the team (1-4 threads). Two kernels add to regions of their own:
   a region no launch used adds nothing. */
#define WIDTH 5
#define REGIONS CX_NUM_ACCS
static void chunked_sums(int threads, const float *values, float *out)
{
    static const int64_t offset[REGIONS] = {0, WIDTH, 2 * WIDTH}, size[REGIONS] = {WIDTH, WIDTH, WIDTH};
    static const int first_kernel[] = {0, -1}, second_kernel[] = {2, -1};
    static launch_log log;
    cx_accs accs;
    cx_accs_init(&accs, offset, size, REGIONS * WIDTH);
    allocate_chunks(&accs);
    const cx_acc_use launches[] = {{&accs, first_kernel}, {&accs, second_kernel}, {&accs, first_kernel}};
    static const int64_t pos0[] = {0, 1000, 3000}, count[] = {1000, 2000, 37}, region[] = {0, 2, 0};
    for (int l = 0; l < 3; ++l) {
        memset(&log, 0, sizeof log);
        log.accs = &accs;
        log.region = (int)region[l];
        log.width = WIDTH;
        log.values = values;
        run_launch(&log, &launches[l], pos0[l], count[l], 1, threads);
        check_launch_tiles(&log, pos0[l], count[l], 1);
    }
    CHECK(!accs.failed, "out of memory");
    for (int c = 0; c < CX_CHUNKS; ++c) CHECK(!accs.zeroed[c][1], "chunk %d: region 1 zeroed, no launch used it", c);
#pragma omp parallel num_threads(threads)
    for (int r = 0; r < REGIONS; ++r) cx_accs_sum(&accs, r, out + r * WIDTH);
    cx_accs_free(&accs);
}

static void check_chunks(void)
{
    /* a chunk is allocated on first use, and only its launch's regions are zeroed */
    static const int64_t offset[REGIONS] = {0, WIDTH, 2 * WIDTH}, size[REGIONS] = {WIDTH, WIDTH, WIDTH};
    static const int regions[] = {0, 2, -1};
    static launch_log log;
    cx_accs fresh;
    cx_accs_init(&fresh, offset, size, REGIONS * WIDTH);
    const cx_acc_use use = {&fresh, regions};
    log.accs = &fresh;
    run_launch(&log, &use, 0, 2 * CX_MIN_TILE, 0, 1);
    for (int c = 0; c < CX_CHUNKS; ++c) {
        CHECK((fresh.chunk[c] != NULL) == (c < 2), "chunk %d of a launch of two tiles", c);
        CHECK(fresh.zeroed[c][0] == (c < 2) && !fresh.zeroed[c][1] && fresh.zeroed[c][2] == (c < 2), "chunk %d", c);
    }
    cx_accs_free(&fresh);

    static float values[MAX_ROWS * WIDTH];
    for (int64_t i = 0; i < MAX_ROWS * WIDTH; ++i) values[i] = random_float();
    float start[REGIONS * WIDTH];
    for (int j = 0; j < REGIONS * WIDTH; ++j) start[j] = random_float();
    /* the reference, in the order the header promises */
    static const int64_t pos0[] = {0, 1000, 3000}, count[] = {1000, 2000, 37}, region[] = {0, 2, 0};
    float chunk[CX_CHUNKS][REGIONS][WIDTH];
    int used[CX_CHUNKS][REGIONS];
    memset(chunk, 0, sizeof chunk);
    memset(used, 0, sizeof used);
    for (int l = 0; l < 3; ++l) {
        const int64_t tile = cx_team_tile_rows(count[l]), ntiles = ntiles_of(count[l], tile);
        for (int64_t t = 0; t < ntiles; ++t)
            for (int64_t r = cx_tile_start(count[l], ntiles, t); r < cx_tile_start(count[l], ntiles, t + 1); ++r)
                for (int j = 0; j < WIDTH; ++j) {
                    chunk[t % CX_CHUNKS][region[l]][j] += values[(pos0[l] + r) * WIDTH + j];
                    used[t % CX_CHUNKS][region[l]] = 1;
                }
    }
    float expected[REGIONS * WIDTH];
    for (int r = 0; r < REGIONS; ++r)
        for (int j = 0; j < WIDTH; ++j) {
            float total = 0.0f;
            for (int c = 0; c < CX_CHUNKS; ++c)
                if (used[c][r]) total += chunk[c][r][j];
            expected[r * WIDTH + j] = start[r * WIDTH + j] + total;
        }
    CHECK(memcmp(expected + WIDTH, start + WIDTH, sizeof(float) * WIDTH) == 0, "region 1 changed");
    /* the values tell orders apart: the rows summed in plain order give other bits */
    float plain[WIDTH] = {0};
    for (int64_t r = 0; r < 1000; ++r)
        for (int j = 0; j < WIDTH; ++j) plain[j] += values[r * WIDTH + j];
    for (int64_t r = 0; r < 37; ++r)
        for (int j = 0; j < WIDTH; ++j) plain[j] += values[(3000 + r) * WIDTH + j];
    int differs = 0;
    for (int j = 0; j < WIDTH; ++j) differs |= start[j] + plain[j] != expected[j];
    CHECK(differs, "the test's values do not tell the summation orders apart");
    for (int threads = 1; threads <= MAX_TEAM; ++threads) {
        float out[REGIONS * WIDTH];
        memcpy(out, start, sizeof out);
        chunked_sums(threads, values, out);
        for (int j = 0; j < REGIONS * WIDTH; ++j)
            CHECK(memcmp(&out[j], &expected[j], sizeof(float)) == 0, "%d threads: element %d is %.9g, not %.9g",
                  threads, j, out[j], expected[j]);
    }
}

/* cx_scatter: each destination row gets its staged rows' values in row order, bitwise, by one thread or with
   the columns shared by a team (a width that is not a multiple of the 16-float blocks). */
#define STAGED 60
#define SCATTER_WIDTH 37
#define DESTINATIONS 4
static void check_scatter(void)
{
    static float val[STAGED * SCATTER_WIDTH], base[DESTINATIONS][SCATTER_WIDTH];
    static float expected[DESTINATIONS][SCATTER_WIDTH], reversed[DESTINATIONS][SCATTER_WIDTH];
    static float out[DESTINATIONS][SCATTER_WIDTH];
    float *dst[STAGED];
    int target[STAGED];
    for (int r = 0; r < STAGED; ++r) target[r] = (int)((r * 7 + r / 5) % DESTINATIONS);
    for (int i = 0; i < STAGED * SCATTER_WIDTH; ++i) val[i] = random_float();
    for (int d = 0; d < DESTINATIONS; ++d)
        for (int j = 0; j < SCATTER_WIDTH; ++j) base[d][j] = random_float();
    memcpy(expected, base, sizeof base);
    memcpy(reversed, base, sizeof base);
    for (int r = 0; r < STAGED; ++r)
        for (int j = 0; j < SCATTER_WIDTH; ++j) {
            expected[target[r]][j] += val[r * SCATTER_WIDTH + j];
            reversed[target[STAGED - 1 - r]][j] += val[(STAGED - 1 - r) * SCATTER_WIDTH + j];
        }
    CHECK(memcmp(expected, reversed, sizeof expected) != 0, "the test's values do not tell the row orders apart");
    for (int team = 0; team < 2; ++team)
        for (int threads = 1; threads <= MAX_TEAM; ++threads) {
            memcpy(out, base, sizeof base);
            for (int r = 0; r < STAGED; ++r) dst[r] = out[target[r]];
            if (team) {
#pragma omp parallel num_threads(threads)
                cx_scatter(dst, val, STAGED, SCATTER_WIDTH, 1);
            } else {
                cx_scatter(dst, val, STAGED, SCATTER_WIDTH, 0);
            }
            CHECK(memcmp(out, expected, sizeof out) == 0, "team %d, %d threads: not the sums in row order", team,
                  threads);
        }
}

/* A forest of `chains` chains of `length` nodes in the kernels' layout: level l holds every chain's node l,
   chain b at row b, each node's one child the node below in its chain. Node ids are chain-major. */
#define CHAINS 5
#define LENGTH 6
typedef struct {
    int64_t level_ptr[LENGTH + 1], level_order[CHAINS * LENGTH], edge_ptr[CHAINS * LENGTH + 1],
        edge_child[CHAINS * LENGTH];
} chain_forest;

static void make_chains(chain_forest *f, const int *order3)
{
    int64_t edges = 0;
    for (int l = 0; l <= LENGTH; ++l) f->level_ptr[l] = (int64_t)l * CHAINS;
    for (int l = 0; l < LENGTH; ++l)
        for (int i = 0; i < CHAINS; ++i) {
            const int b = l == 3 ? order3[i] : i; /* level 3's rows in another order */
            const int64_t pos = (int64_t)l * CHAINS + i;
            f->level_order[pos] = (int64_t)b * LENGTH + l;
            f->edge_ptr[pos] = edges;
            if (l > 0) f->edge_child[edges++] = (int64_t)b * LENGTH + l - 1;
        }
    f->edge_ptr[CHAINS * LENGTH] = edges;
}

/* cx_aligned: a level whose row i reads row i of the level below, one child each. */
static void check_aligned(void)
{
    static const int same[CHAINS] = {0, 1, 2, 3, 4}, swapped[CHAINS] = {1, 0, 2, 3, 4};
    chain_forest f;
    make_chains(&f, same);
    for (int l = 1; l < LENGTH; ++l)
        CHECK(cx_aligned(f.level_ptr, f.level_order, f.edge_ptr, f.edge_child, l), "level %d of equal chains", l);
    make_chains(&f, swapped); /* level 3 reads rows 1, 0 below; level 4 reads level 3's rows 0, 1 in turn */
    for (int l = 1; l < LENGTH; ++l)
        CHECK(cx_aligned(f.level_ptr, f.level_order, f.edge_ptr, f.edge_child, l) == (l != 3 && l != 4),
              "level %d with level 3 reordered", l);
    make_chains(&f, same);
    f.edge_ptr[2 * CHAINS + 1] = f.edge_ptr[2 * CHAINS]; /* level 2's row 0 with no child, row 1 two */
    CHECK(!cx_aligned(f.level_ptr, f.level_order, f.edge_ptr, f.edge_child, 2), "a row of two children");
    make_chains(&f, same);
    f.level_ptr[2] -= 1; /* level 1 one row fewer than level 2 */
    CHECK(!cx_aligned(f.level_ptr, f.level_order, f.edge_ptr, f.edge_child, 2), "levels of other sizes");
}

/* cx_window_end / cx_window_fits: windows of whole levels, in order, each as many as fit (at least one). */
static void check_windows(void)
{
    static const int64_t sizes[] = {40, 5, 17, 3, 30, 12, 1, 25, 30, 2};
    const int64_t levels = (int64_t)(sizeof sizes / sizeof sizes[0]);
    int64_t lp[sizeof sizes / sizeof sizes[0] + 1];
    lp[0] = 0;
    for (int64_t l = 0; l < levels; ++l) lp[l + 1] = lp[l] + sizes[l];
    CHECK(cx_window_fits(lp, levels, 30) && !cx_window_fits(lp, levels, 29), "the widest level above the leaves: 30");
    CHECK(cx_window_fits(lp, 1, 1), "leaves only: no window");
    for (int64_t rows = 1; rows <= 100; ++rows) {
        int64_t level = 1;
        while (level < levels) {
            const int64_t end = cx_window_end(lp, levels, rows, level);
            CHECK(end > level && end <= levels, "rows %lld: window [%lld, %lld)", (long long)rows, (long long)level,
                  (long long)end);
            if (end > level + 1 || cx_window_fits(lp, levels, rows))
                CHECK(lp[end] - lp[level] <= rows, "rows %lld: window [%lld, %lld) of %lld rows", (long long)rows,
                      (long long)level, (long long)end, (long long)(lp[end] - lp[level]));
            CHECK(end == levels || lp[end + 1] - lp[level] > rows, "rows %lld: window [%lld, %lld) could take more",
                  (long long)rows, (long long)level, (long long)end);
            level = end;
        }
    }
}

/* cx_own_columns: the team's columns, whole granules in rank order, cover the period once, nearly equal. */
static void check_columns(void)
{
    static const int periods[][2] = {{208, 16}, {64, 16}, {16, 16}, {256, 16}};
    for (size_t p = 0; p < sizeof periods / sizeof periods[0]; ++p)
        for (int threads = 1; threads <= MAX_TEAM + 1; ++threads) {
            const int period = periods[p][0], granule = periods[p][1];
            int u0[MAX_TEAM + 1], nu[MAX_TEAM + 1], shares[MAX_TEAM + 1];
#pragma omp parallel num_threads(threads)
            {
                const int me = omp_get_thread_num();
                CHECK(omp_get_num_threads() == threads, "a team of %d, not %d", omp_get_num_threads(), threads);
                shares[me] = cx_own_columns(period, granule, &u0[me], &nu[me]);
            }
            int next = 0, least = period, most = 0;
            for (int t = 0; t < threads; ++t) {
                CHECK(u0[t] == next && nu[t] % granule == 0, "period %d, %d threads: thread %d owns [%d, +%d)", period,
                      threads, t, u0[t], nu[t]);
                CHECK(shares[t] == (threads > 1 && period / granule > 1), "period %d, %d threads", period, threads);
                next += nu[t];
                least = nu[t] < least ? nu[t] : least;
                most = nu[t] > most ? nu[t] : most;
            }
            CHECK(next == period && most - least <= granule, "period %d, %d threads", period, threads);
        }
    /* tests/targets/c/test_determinism.py's example: 13 panels, 2 threads own 6 and 7 */
    int u0[2], nu[2];
#pragma omp parallel num_threads(2)
    cx_own_columns(208, 16, &u0[omp_get_thread_num()], &nu[omp_get_thread_num()]);
    CHECK(nu[0] == 6 * 16 && nu[1] == 7 * 16, "208 columns: %d and %d", nu[0], nu[1]);
}

/* Who shares a launch, and a call's team: the thresholds the header names. */
static void check_sharing(void)
{
    CHECK(cx_rows_shared(CX_ROWS_MIN, CX_ROWS_MIN_MACS / CX_ROWS_MIN), "8 rows of 16384");
    CHECK(!cx_rows_shared(CX_ROWS_MIN - 1, 1 << 30) && !cx_rows_shared(CX_ROWS_MIN, CX_ROWS_MIN_MACS / CX_ROWS_MIN - 1),
          "too few rows or multiply-adds");
    CHECK(!cx_rows_shared(1000, 0), "row_macs 0: never");
    CHECK(cx_columns(CX_MIN_TILE, CX_SPLIT_MIN_MACS / CX_MIN_TILE), "one tile of 2^20 multiply-adds");
    CHECK(!cx_columns(CX_MIN_TILE, CX_SPLIT_MIN_MACS / CX_MIN_TILE - 1), "too few multiply-adds");
    CHECK(!cx_columns(CX_MIN_TILE + 1, 1 << 30), "two tiles");
    CHECK(!cx_columns(4, 0), "macs 0: never");
    CHECK(cx_alone(CX_MIN_TILE, 0, 0) && !cx_alone(CX_MIN_TILE + 1, 0, 0), "one tile alone, two shared");
    CHECK(!cx_alone(10, 1 << 17, 0) && !cx_alone(8, 0, 1 << 14), "shared by columns, by rows");
    int64_t shared = 0, alone = 0;
    cx_count_rows(10, 0, 0, &shared, &alone);
    cx_count_rows(300, 0, 0, &shared, &alone);
    CHECK(shared == 300 && alone == 10, "shared %lld, alone %lld", (long long)shared, (long long)alone);
    CHECK(cx_call_team(4, CX_SHARE_MIN_ROWS - 1, 0) == 1, "too little to share");
    CHECK(cx_call_team(4, CX_SHARE_MIN_ROWS, CX_SHARE_MIN_ROWS / CX_SHARE_RATIO) == 4, "enough to share");
    CHECK(cx_call_team(4, CX_SHARE_MIN_ROWS, CX_SHARE_MIN_ROWS / CX_SHARE_RATIO + 1) == 1, "mostly alone");
    CHECK(cx_call_team(40, 100000, 0) == 40, "any team: chunks never depend on it");
}

int main(int argc, char **argv)
{
    static const struct {
        const char *name;
        void (*run)(void);
    } checks[] = {{"tiles", check_tiles},       {"team_tiles", check_team_tiles}, {"dispatch", check_dispatch},
                  {"chunks", check_chunks},     {"scatter", check_scatter},       {"aligned", check_aligned},
                  {"windows", check_windows},   {"columns", check_columns},       {"sharing", check_sharing}};
    if (argc != 2) {
        fprintf(stderr, "usage: %s CHECK\n", argv[0]);
        return 2;
    }
    for (size_t i = 0; i < sizeof checks / sizeof checks[0]; ++i)
        if (strcmp(argv[1], checks[i].name) == 0) {
            checks[i].run();
            printf("%s: ok\n", argv[1]);
            return 0;
        }
    fprintf(stderr, "no check %s\n", argv[1]);
    return 2;
}
