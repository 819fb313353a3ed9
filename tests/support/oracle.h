/* The float64 attention oracle the decode tests compare every backend with, and the error it allows.
 * It is written here, independently of the library: it sees only the values the pages hold (the
 * tests keep their own copy, rounded by tu_round_trip) and q as its format stores it. */
#ifndef PKV_ORACLE_H
#define PKV_ORACLE_H

#include <stddef.h>
#include <stdint.h>

#include "pagedkv.h"

/* softmax(scale q.k) v over keys [0, n): k and v hold row t at t * stride. out[d] is the attention
 * output, mag[d] = sum_t p_t |v_td| (the size of what was summed: an error is judged against
 * max(|out|, mag), so cancellation between tokens is forgiven), *lse the natural-log sum of
 * exp(scale q.k). n = 0 gives out = mag = 0 and lse = -infinity. */
void oracle_attend(const double *q, const float *k, const float *v, size_t stride, uint32_t n, uint32_t head_dim,
                   double scale, double *out, double *mag, double *lse);

/* oracle_attend over the keys [0, n) that seen[t] (nonzero) marks; seen NULL: every one. A causal or
 * masked attention is this with the query's visible positions marked. */
void oracle_attend_seen(const double *q, const float *k, const float *v, size_t stride, uint32_t n,
                        const uint8_t *seen, uint32_t head_dim, double scale, double *out, double *mag, double *lse);

/* The attention variants of pagedkv.h, section 7a, for one query head; each off at its zero value. */
typedef struct oracle_variants {
  uint32_t window; /* the query at position P sees (P - window, P] */
  double softcap;
  double slope;    /* ALiBi: slope * (P - position) is taken off each logit */
  int has_sink;
  double sink;     /* with has_sink: a logit in the denominator that adds no value */
} oracle_variants;

/* oracle_attend_seen for a query at position `query` (key t is position t) with the variants var
 * (NULL: none): logits scaled, then soft-capped, then ALiBi-biased; the window hides positions
 * <= query - window; the sink joins the softmax's denominator. *lse is the log of that denominator,
 * the sink's term included: a query that sees nothing gets lse = sink (or -infinity) and out = 0. */
void oracle_attend_variants(const double *q, const float *k, const float *v, size_t stride, uint32_t n,
                            const uint8_t *seen, uint32_t query, const oracle_variants *var, uint32_t head_dim,
                            double scale, double *out, double *mag, double *lse);

/* logit[t] = scale q.k_t over keys [0, n) (k holds row t at t * stride); returns their maximum
 * (-infinity for n = 0). oracle_attend's first step, for a check that needs the logits themselves. */
double oracle_logits(const double *q, const float *k, size_t stride, uint32_t n, uint32_t head_dim, double scale,
                     double *logit);

/* max_t scale sum_d |q_d k_td| over keys [0, n): the size of the logits' terms, against which float32
 * arithmetic errs (0 for n = 0). */
double oracle_logit_magnitude(const double *q, const float *k, size_t stride, uint32_t n, uint32_t head_dim,
                              double scale);

/* The error a backend may make, by K page format (V's format does not matter: the oracle holds the
 * values the pages store, and V is only accumulated); docs/testing.md gives the reasons. */
typedef struct oracle_tolerance {
  double out_rel; /* error of an output row relative to its size, before rounding to the output format */
  double lse_abs; /* |lse - ref| */
} oracle_tolerance;
oracle_tolerance oracle_tolerance_for(pkv_format k_format);

/* Rounding an output to `format` adds at most half an ulp, relative (F32: 0). */
double oracle_out_rounding(pkv_format format);

/* Half an ulp of `format` at x, absolute: what storing x in the format may lose, subnormals included;
 * at least 2^-126, which float32 arithmetic may flush to zero. */
double oracle_half_ulp(pkv_format format, double x);

#endif
