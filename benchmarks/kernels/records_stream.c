/* One batch-1 decode step's kernel records streamed by the per-row kernel, without the
 * engine: how close q4q8_gemv.c's linear_group gets to the memory's read rate, and what
 * transparent huge pages, the activation bits and the prefetch distance change.
 *
 * The records of a model's linears (random bytes of the right sizes and formats: Q4
 * 320 bytes, Q6 448 bytes a record of 16 rows x 32 inputs, Q4K 2,304 a super-block of 256) sit in one private anonymous
 * mapping advised MADV_HUGEPAGE (--huge 1, as tokenmill/quant/huge_pages.py keeps them)
 * or MADV_NOHUGEPAGE (--huge 0: 4 KiB pages). A step runs in one OpenMP region as
 * decode_step.c's does: per op (qkv, o, gate_up, down; then the LM head) each thread
 * takes its run of the row groups (runs.h), then a barrier. Beside it, the same threads
 * read the same bytes with plain 64-byte loads (the floor: what the memory gives two
 * threads), and the records' AnonHugePages from /proc/self/smaps_rollup.
 *
 * Built and run by records_stream.py (python -m benchmarks run records-stream); by hand:
 *   cc -O3 -march=native -ffast-math -fopenmp -Itokenmill/kernels [-DPF_RECORDS=N] \
 *      benchmarks/kernels/records_stream.c -o /tmp/rs -lm
 *   /tmp/rs MODEL HUGE BITS THREADS STEPS [Q4K]  (MODEL: llama-1b or smollm2; Q4K 1: the
 *                                                Q4_K tensors in FMT_Q4K records, 0: Q4)
 */
#include "q4q8_gemv.c"

#include <stdio.h>
#include <sys/mman.h>
#include <time.h>

typedef struct {
    int64_t K, N, fmt;
    const uint8_t *w;
} seg_t;

#define MAX_SEGS 8
typedef struct {
    int n;
    seg_t s[MAX_SEGS];
} op_t;

static size_t seg_bytes(const seg_t *s) {
    return (size_t)((s->N + ROWS - 1) / ROWS) * (size_t)(s->K / QK) *
           (size_t)record_bytes(s->fmt);
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + 1e-9 * t.tv_nsec;
}

static int cmp(const void *a, const void *b) {
    const double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static long smaps_kb(const char *key) {
    FILE *f = fopen("/proc/self/smaps_rollup", "r");
    char line[256];
    long v = -1;
    if (!f) return -1;
    while (fgets(line, sizeof line, f))
        if (!strncmp(line, key, strlen(key))) sscanf(line + strlen(key), "%ld", &v);
    fclose(f);
    return v;
}

/* the ops of one step: Llama-shaped, `layers` layers; v and down in Q6 on the layers
 * llama-quantize's Q4_K_M gives Q6_K (here: every other), the LM head in `head_fmt` */
static int model_ops(const char *name, int q4k, op_t *ops, int64_t *hidden, int64_t *inter) {
    int64_t H, I, Q, KV, L, vocab = 49152, head_fmt, q4 = FMT_Q4;
    if (!strcmp(name, "llama-1b")) {
        H = 2048, I = 8192, Q = 2048, KV = 512, L = 16, head_fmt = FMT_Q6;
#ifdef Q4K_RECORD
        if (q4k) q4 = FMT_Q4K; /* Q4_K's own super-blocks, as tokenmill loads them */
#else
        if (q4k) return -1;    /* a kernel from before FMT_Q4K (--kernels) */
#endif
    } else if (!strcmp(name, "smollm2")) {
        H = 576, I = 1536, Q = 576, KV = 192, L = 30, head_fmt = FMT_Q8;
    } else {
        return -1;
    }
    int n = 0;
    for (int64_t l = 0; l < L; l++) {
        const int64_t big = (!strcmp(name, "llama-1b") && l % 2 == 0) ? FMT_Q6 : q4;
        ops[n++] = (op_t){2, {{H, Q + KV, q4, 0}, {H, KV, big, 0}}};
        ops[n++] = (op_t){1, {{Q, H, q4, 0}}};
        ops[n++] = (op_t){1, {{H, 2 * I, q4, 0}}};
        ops[n++] = (op_t){1, {{I, H, big, 0}}};
    }
    ops[n++] = (op_t){1, {{H, vocab, head_fmt, 0}}};
    *hidden = H;
    *inter = I;
    return n;
}

/* segment and group of the op's global group index gi */
static inline const seg_t *seg_of(const op_t *op, int64_t *gi) {
    for (int i = 0; i < op->n; i++) {
        const int64_t groups = (op->s[i].N + ROWS - 1) / ROWS;
        if (*gi < groups) return op->s + i;
        *gi -= groups;
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: %s MODEL HUGE BITS THREADS STEPS [Q4K]\n", argv[0]);
        return 2;
    }
    const int huge = atoi(argv[2]), bits = atoi(argv[3]), threads = atoi(argv[4]),
              steps = atoi(argv[5]), q4k = argc > 6 && atoi(argv[6]);
    static op_t ops[256];
    int64_t H, I;
    const int nops = model_ops(argv[1], q4k, ops, &H, &I);
    if (nops < 0 || (bits != 8 && bits != 16) || threads < 1 || steps < 1) return 2;
    size_t total = 0;
    for (int o = 0; o < nops; o++)
        for (int i = 0; i < ops[o].n; i++) total += (seg_bytes(ops[o].s + i) + 63) & ~(size_t)63;
    const size_t HP = 2u << 20;
    uint8_t *map = mmap(NULL, total + HP, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                        -1, 0);
    if (map == MAP_FAILED) return 1;
    madvise(map, total + HP, huge ? MADV_HUGEPAGE : MADV_NOHUGEPAGE);
    uint8_t *base = map + ((HP - (uintptr_t)map % HP) % HP), *at = base;
    uint64_t seed = 88172645463325252ull;
    for (size_t i = 0; i < total; i += 8) { /* finite fp16 scales, any nibbles */
        seed ^= seed << 13, seed ^= seed >> 7, seed ^= seed << 17;
        const uint64_t v = seed & 0x3b3b3b3b3b3b3b3bull;
        memcpy(base + i, &v, total - i < 8 ? total - i : 8);
    }
    for (int o = 0; o < nops; o++)
        for (int i = 0; i < ops[o].n; i++) {
            ops[o].s[i].w = at;
            at += (seg_bytes(ops[o].s + i) + 63) & ~(size_t)63;
        }
    /* activations: one row of H and one of I, quantized as the step does */
    const int64_t KM = I > H ? I : H;
    uint16_t *x = malloc(2 * KM);
    for (int64_t i = 0; i < KM; i++) x[i] = f32_to_bf16(sinf(0.37f * i));
    int8_t *q[2];
    float *d[2], *s[2];
    int32_t *sum[2];
    for (int k = 0; k < 2; k++) {
        const int64_t K = k ? I : H;
        q[k] = aligned_alloc(64, 2 * K + 64);
        d[k] = malloc(4 * K / QK), s[k] = malloc(4 * K / QK);
        sum[k] = malloc(4 * K / QK);
        tm_q8_quantize_bf16(x, 1, K, bits, q[k], d[k], s[k], sum[k]);
    }
    float *y = aligned_alloc(64, 4 * 65536 + 64);
    uint64_t *runs = runs_new(threads);
    double *t_kernel = malloc(sizeof(double) * steps), *t_read = malloc(sizeof(double) * steps);
    volatile int64_t sink = 0;
    for (int rep = -2; rep < steps; rep++) { /* two warm-up steps */
        const double t0 = now();
#pragma omp parallel num_threads(threads)
        {
            const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
            for (int o = 0; o < nops; o++) {
                const op_t *op = ops + o;
                int64_t groups = 0;
                for (int i = 0; i < op->n; i++) groups += (op->s[i].N + ROWS - 1) / ROWS;
                own_run(runs, groups, tid, nth);
                int from = 0;
                for (int64_t g; (g = next_group(runs, tid, nth, &from)) >= 0;) {
                    int64_t gi = g;
                    const seg_t *sg = seg_of(op, &gi);
                    const int k = sg->K == H ? 0 : 1;
                    linear_group(sg->w, gi, 1, sg->K, sg->N, sg->fmt, bits, q[k], d[k], s[k],
                                 sum[k], y, 1);
                }
#pragma omp barrier
            }
        }
        const double t1 = now();
        int64_t acc = 0;
#pragma omp parallel num_threads(threads) reduction(^ : acc)
        { /* the floor: the same bytes, each thread its contiguous half, plain loads */
            const int tid = omp_get_thread_num(), nth = omp_get_num_threads();
            const size_t lines = total / 64, l0 = lines * tid / nth, l1 = lines * (tid + 1) / nth;
#if TM_VNNI
            __m512i a0 = _mm512_setzero_si512(), a1 = a0;
            for (size_t l = l0; l + 1 < l1; l += 2) {
                a0 = _mm512_xor_si512(a0, _mm512_load_si512((const void *)(base + 64 * l)));
                a1 = _mm512_xor_si512(a1, _mm512_load_si512((const void *)(base + 64 * l + 64)));
            }
            acc ^= _mm512_reduce_add_epi64(_mm512_xor_si512(a0, a1));
#else
            for (size_t l = l0; l < l1; l++) acc ^= *(const int64_t *)(base + 64 * l);
#endif
        }
        const double t2 = now();
        sink ^= acc;
        if (rep >= 0) t_kernel[rep] = t1 - t0, t_read[rep] = t2 - t1;
    }
    qsort(t_kernel, steps, sizeof(double), cmp);
    qsort(t_read, steps, sizeof(double), cmp);
    const double mk = t_kernel[steps / 2], mr = t_read[steps / 2];
    printf("{\"model\": \"%s\", \"huge\": %d, \"bits\": %d, \"threads\": %d, \"pf_records\": %d, "
           "\"pf_hint\": %d, \"isa\": %d, \"record_mib\": %.1f, \"anon_huge_mib\": %.1f, "
           "\"step_ms\": %.3f, \"step_ms_min\": %.3f, \"kernel_gb_s\": %.2f, "
           "\"read_ms\": %.3f, \"read_gb_s\": %.2f, \"kernel_vs_read\": %.3f}\n",
           argv[1], huge, bits, threads, PF_RECORDS, (int)PF_HINT, (int)tm_q4q8_isa(), total / 1048576.0,
           smaps_kb("AnonHugePages:") / 1024.0, 1e3 * mk, 1e3 * t_kernel[0], total / mk / 1e9,
           1e3 * mr, total / mr / 1e9, mr / mk);
    return (int)(sink & 0) ;
}
