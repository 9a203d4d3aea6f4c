/* the native decode step (step_kernel.py says how) */
#include <math.h>
#include <omp.h>
#include <stdlib.h>
#include <string.h>
#include "hsum.h"
#include "step_products.h"


static void rms_norm(const float *x, const float *w, float eps, float *out, int64_t n) {
    float ss = dot(x, x, n);
    const float r = 1.f / sqrtf(ss / (float)n + eps);
    for (int64_t i = 0; i < n; i++) out[i] = x[i] * r * (w ? w[i] : 1.f);
}

/* one query head over positions start..end-1 of its key-value head */
static void attend(const float *q, const float *kb, const float *vb, int64_t pos_stride, int64_t n, int64_t dim,
                   float scale, float *p, float *o) {
    float top = -INFINITY;
    for (int64_t t = 0; t < n; t++) { p[t] = dot(q, kb + t * pos_stride, dim) * scale; if (p[t] > top) top = p[t]; }
    float sum = 0.f;
    for (int64_t t = 0; t < n; t++) { p[t] = expf(p[t] - top); sum += p[t]; }
    const float inv = 1.f / sum;
    int64_t c = 0;
    for (; c + 16 <= dim; c += 16) {
        __m256 a0 = _mm256_setzero_ps(), a1 = a0;
        for (int64_t t = 0; t < n; t++) {
            const float *vr = vb + t * pos_stride + c;
            const __m256 w = _mm256_set1_ps(p[t]);
            a0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr), a0);
            a1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8), a1);
        }
        _mm256_storeu_ps(o + c, _mm256_mul_ps(a0, _mm256_set1_ps(inv)));
        _mm256_storeu_ps(o + c + 8, _mm256_mul_ps(a1, _mm256_set1_ps(inv)));
    }
    for (; c < dim; c++) {
        float a = 0.f;
        for (int64_t t = 0; t < n; t++) a += p[t] * vb[t * pos_stride + c];
        o[c] = a * inv;
    }
}

/* one head of one session's queries and keys normed (where the layer norms them) and rotated; a key head's
   key and value (the session's new ones) written into its cache (c: keys, values, head stride, position
   stride) at length */
static void place(const Model *m, const Layer *L, float *qkv, int64_t h, const float *cos, const float *sin,
                  int64_t length, const int64_t *c) {
    const int64_t dim = m->dim, half = dim / 2;
    float rot[1024];
    float *x = qkv + h * dim;
    if (L->qk_norm) rms_norm(x, L->qk_norm + h * dim, L->qk_eps, x, dim);  /* each head its row of weights */
    for (int64_t i = 0; i < dim; i++) rot[i] = x[i] * cos[i] + (i < half ? x[i + half] : x[i - half]) * sin[i];
    memcpy(x, rot, dim * sizeof(float));
    if (h >= m->heads) {
        const int64_t kvh = h - m->heads;
        memcpy((float *)c[0] + kvh * c[2] + length * c[3], x, dim * sizeof(float));
        memcpy((float *)c[1] + kvh * c[2] + length * c[3], qkv + (m->heads + m->kv_heads + kvh) * dim,
               dim * sizeof(float));
    }
}

/* bytes on whole cache lines, as torch's tensors are: an input row loaded across two lines costs a split load
   eight times a weight vector */
static void *lines(size_t bytes) { return aligned_alloc(64, (bytes + 63) / 64 * 64); }

/* query head hq of a session over its past (a sliding window seen from its start): its output in att's row,
   scores in p */
static void attend_head(const Model *m, const Layer *L, const float *qkv, int64_t hq, int64_t length,
                        const int64_t *c, float *p, float *att) {
    const int64_t g = hq / (m->heads / m->kv_heads), dim = m->dim;
    const int64_t start = L->window && length + 1 > L->window ? length + 1 - L->window : 0;
    attend(qkv + hq * dim, (const float *)c[0] + g * c[2] + start * c[3], (const float *)c[1] + g * c[2] + start * c[3],
           c[3], length + 1 - start, dim, L->scaling, p, att + hq * dim);
}

/* session r's query heads of key-value head g: their key and value normed, rotated and written at the
   session's length, then each query head normed, rotated and attended */
static void attend_group(const Model *m, const Layer *L, float *qkv, int64_t g, const float *cos, const float *sin,
                         int64_t length, const int64_t *c, float *p, float *att) {
    const int64_t groups = m->heads / m->kv_heads;
    place(m, L, qkv, m->heads + g, cos, sin, length, c);
    for (int64_t hq = g * groups; hq < (g + 1) * groups; hq++) {
        place(m, L, qkv, hq, cos, sin, length, c);
        attend_head(m, L, qkv, hq, length, c, p, att);
    }
}

/* tokens, lengths [rows]; caches[r]: session r's [layers][4]; cos, sin [rows, dim]; logits [rows, vocab];
   work: rows * (hidden + heads * dim + width + most) floats (each thread norms into rows of its own) */
void swarm_step(const Model *m, const Layer *layers, int64_t rows, const int64_t *tokens, const int64_t *lengths,
                const int64_t *const *caches, const float *cos, const float *sin, float *logits, float *work) {
    const int64_t hidden = m->hidden, dim = m->dim, qdim = m->heads * dim, kv = m->kv_heads;
    const int64_t width = m->width, most = m->most;
    float *h = work, *att = h + rows * hidden, *act = att + rows * qdim;
    float *big = act + rows * width;
    const Rows hx = {hidden, width, 2 * width + 64, 2 * (width / 32) + 1};  /* h rows in, x rows out */
    const Rows xb = {width, most, hx.qs, hx.ds}, xh = {width, hidden, hx.qs, hx.ds};
    const Rows ah = {qdim, hidden, hx.qs, hx.ds}, xl = {width, m->head.n, hx.qs, hx.ds};
    int64_t longest = 0;
    for (int64_t r = 0; r < rows; r++) {
        const int64_t token = tokens[r];
        if (lengths[r] > longest) longest = lengths[r];
        if (m->embed_scale) {
            const int8_t *row = (const int8_t *)m->embed + token * hidden;
            for (int64_t i = 0; i < hidden; i++) h[r * hidden + i] = (float)row[i] * m->embed_scale[token];
        } else {
            memcpy(h + r * hidden, (const float *)m->embed + token * hidden, hidden * sizeof(float));
        }
    }
    #pragma omp parallel if(m->parallel)
    {
        /* this thread's own: the normed rows and every product's quantized input (each thread makes them all,
           rather than wait at a barrier for a share), the attention's scores */
        float *x = lines(rows * width * sizeof(float)), *xd = lines(rows * hx.ds * sizeof(float));
        int8_t *xq = lines(rows * hx.qs);
        float *p = lines((longest + 1) * sizeof(float));
        /* each (session, key-value head) at once where there are enough for every thread, else every head's
           rotation and cache write, then each (session, query head)'s attention */
        const int grouped = rows * kv >= omp_get_num_threads();
        int64_t a, b;
        for (int64_t l = 0; l < m->layers; l++) {
            const Layer *L = layers + l;
            const int64_t inter = L->gate_up.n / 2, qk_heads = m->heads + kv;
            for (int64_t r = 0; r < rows; r++) rms_norm(h + r * hidden, L->in_norm, L->in_eps, x + r * width, hidden);
            prepare(&L->qkv, x, xq, xd, rows, xb);
            product_all(&L->qkv, x, xq, xd, big, 0, rows, xb);
            if (grouped) {
                span(rows * kv, 1, &a, &b);
                for (int64_t t = a; t < b; t++)
                    attend_group(m, L, big + t / kv * most, t % kv, cos + t / kv * dim, sin + t / kv * dim,
                                 lengths[t / kv], caches[t / kv] + 4 * l, p, att + t / kv * qdim);
            } else {
                span(rows * qk_heads, 1, &a, &b);
                for (int64_t t = a; t < b; t++) {
                    const int64_t r = t / qk_heads;
                    place(m, L, big + r * most, t % qk_heads, cos + r * dim, sin + r * dim, lengths[r],
                          caches[r] + 4 * l);
                }
                #pragma omp barrier
                span(rows * m->heads, 1, &a, &b);
                for (int64_t t = a; t < b; t++) {
                    const int64_t r = t / m->heads;
                    attend_head(m, L, big + r * most, t % m->heads, lengths[r], caches[r] + 4 * l, p, att + r * qdim);
                }
            }
            #pragma omp barrier
            prepare(&L->o, att, xq, xd, rows, ah);
            product_all(&L->o, att, xq, xd, h, 1, rows, ah);
            for (int64_t r = 0; r < rows; r++)
                rms_norm(h + r * hidden, L->post_norm, L->post_eps, x + r * width, hidden);
            prepare(&L->gate_up, x, xq, xd, rows, xb);
            /* this thread's gate rows and the same up rows, then SiLU of its gates times its ups */
            span(inter, 8, &a, &b);
            product(&L->gate_up, x, xq, xd, big, 0, rows, xb, a, b);
            product(&L->gate_up, x, xq, xd, big, 0, rows, xb, inter + a, inter + b);
            for (int64_t r = 0; r < rows; r++) {
                const float *gate = big + r * most;
                for (int64_t i = a; i < b; i++)
                    act[r * width + i] = gate[i] / (1.f + expf(-gate[i])) * gate[inter + i];
            }
            #pragma omp barrier
            prepare(&L->down, act, xq, xd, rows, xh);
            product_all(&L->down, act, xq, xd, h, 1, rows, xh);
        }
        for (int64_t r = 0; r < rows; r++) rms_norm(h + r * hidden, m->norm, m->norm_eps, x + r * width, hidden);
        prepare(&m->head, x, xq, xd, rows, xl);
        product_all(&m->head, x, xq, xd, logits, 0, rows, xl);
        free(p);
        free(x);
        free(xq);
        free(xd);
    }
}
