#include "oracle.h"

#include <math.h>
#include <stdlib.h>

void oracle_attend(const double *q, const float *k, const float *v, size_t stride, uint32_t n, uint32_t head_dim,
                   double scale, double *out, double *mag, double *lse) {
  oracle_attend_seen(q, k, v, stride, n, NULL, head_dim, scale, out, mag, lse);
}

void oracle_attend_seen(const double *q, const float *k, const float *v, size_t stride, uint32_t n,
                        const uint8_t *seen, uint32_t head_dim, double scale, double *out, double *mag, double *lse) {
  oracle_attend_variants(q, k, v, stride, n, seen, n ? n - 1 : 0, NULL, head_dim, scale, out, mag, lse);
}

void oracle_attend_variants(const double *q, const float *k, const float *v, size_t stride, uint32_t n,
                            const uint8_t *seen, uint32_t query, const oracle_variants *var, uint32_t head_dim,
                            double scale, double *out, double *mag, double *lse) {
  const oracle_variants none = {0, 0.0, 0.0, 0, 0.0};
  if (!var) var = &none;
  for (uint32_t d = 0; d < head_dim; d++) out[d] = mag[d] = 0.0;
  double *logit = malloc((n ? n : 1) * sizeof *logit), z = 0.0, mx = var->has_sink ? var->sink : -INFINITY;
  uint8_t *use = malloc(n ? n : 1);
  if (!logit || !use) abort();
  oracle_logits(q, k, stride, n, head_dim, scale, logit);
  for (uint32_t t = 0; t < n; t++) {
    if (var->softcap > 0.0) logit[t] = var->softcap * tanh(logit[t] / var->softcap);
    logit[t] -= var->slope * ((double)query - t);
    use[t] = (!seen || seen[t]) && !(var->window && (uint64_t)t + var->window <= query);
    if (use[t]) mx = fmax(mx, logit[t]);
  }
  for (uint32_t t = 0; t < n && mx > -INFINITY; t++) {
    if (!use[t]) continue;
    const double p = exp(logit[t] - mx);
    z += p;
    for (uint32_t d = 0; d < head_dim; d++) {
      out[d] += p * v[t * stride + d];
      mag[d] += p * fabs((double)v[t * stride + d]);
    }
  }
  if (var->has_sink) z += exp(var->sink - mx);
  if (z > 0.0) {
    for (uint32_t d = 0; d < head_dim; d++) out[d] /= z, mag[d] /= z;
    *lse = mx + log(z);
  } else {
    *lse = -INFINITY;
  }
  free(logit);
  free(use);
}

double oracle_logits(const double *q, const float *k, size_t stride, uint32_t n, uint32_t head_dim, double scale,
                     double *logit) {
  double mx = -INFINITY;
  for (uint32_t t = 0; t < n; t++) {
    double s = 0.0;
    for (uint32_t d = 0; d < head_dim; d++) s += q[d] * k[t * stride + d];
    logit[t] = scale * s;
    mx = fmax(mx, logit[t]);
  }
  return mx;
}

double oracle_logit_magnitude(const double *q, const float *k, size_t stride, uint32_t n, uint32_t head_dim,
                              double scale) {
  double most = 0.0;
  for (uint32_t t = 0; t < n; t++) {
    double s = 0.0;
    for (uint32_t d = 0; d < head_dim; d++) s += fabs(q[d] * k[t * stride + d]);
    most = fmax(most, fabs(scale) * s);
  }
  return most;
}

oracle_tolerance oracle_tolerance_for(pkv_format k_format) {
  /* Float K: float32 accumulation of q.k, of exp and of the weighted sum over up to ~5000 tokens
   * gives a few 1e-6; one missed, repeated or misplaced token shows as 1e-3 or more. Quantized K: a
   * GPU backend may round q to int8 per 32-group (or q and K's scaled values to f16), which moves each
   * logit by ~0.4% of the logits' spread (the tests keep it <= ~1 for quantized K), hence ~1e-2. */
  const oracle_tolerance floats = {1e-4, 1e-4}, quantized = {1e-2, 1e-2};
  return k_format == PKV_FORMAT_Q8_0 || k_format == PKV_FORMAT_Q4_0 ? quantized : floats;
}

double oracle_out_rounding(pkv_format format) {
  return format == PKV_FORMAT_F16 ? ldexp(1.0, -11) : format == PKV_FORMAT_BF16 ? ldexp(1.0, -8) : 0.0;
}

double oracle_half_ulp(pkv_format format, double x) {
  const int mantissa = format == PKV_FORMAT_F16 ? 10 : format == PKV_FORMAT_BF16 ? 7 : 23;
  const int min_exp = format == PKV_FORMAT_F16 ? -14 : -126; /* of the smallest normal */
  int e = 0;
  frexp(fabs(x), &e); /* |x| in [2^(e-1), 2^e) */
  const int exp = e - 1 < min_exp ? min_exp : e - 1;
  return fmax(ldexp(1.0, exp - mantissa - 1), ldexp(1.0, -126)); /* below 2^-126: float32's flush to zero */
}
