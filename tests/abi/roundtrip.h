/* One engine round trip through a function table, shared by the tests that reach the library in
 * different ways (runtime loader, static linking): whichever way in, the same calls must give the
 * same answers. */
#ifndef PKV_ROUNDTRIP_H
#define PKV_ROUNDTRIP_H

#include "pagedkv.h"

/* On a CPU context made through `api`: a pool with random shape and K/V formats, a few sequences
 * appended in two steps, random K/V rows written to every layer, one decode checked against a float64
 * reference, and one failing call whose status and last-error text must come back. cmocka asserts. */
void rt_round_trip(const pkv_api *api);

#endif
