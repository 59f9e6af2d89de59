/* Baked tunables per arch. `opgraft tune --inject` rewrites the rows between the markers; each
 * row says why it holds. Rows match like tune-file entries (see tune.c); arch 0 matches any GPU. */
#include "internal.h"

const og_tune_entry opgraft__baked_table[] = {
    /* BEGIN TUNED ROWS */
    {0, NULL, NULL, 0, 0, "moe.max_tokens", 8, "initial guess before measurement"},
    {0, NULL, NULL, 0, 0, "moe.gate_up.warps", 4, "initial guess before measurement"},
    {0, NULL, NULL, 0, 0, "moe.gate_up.unroll", 4, "initial guess before measurement"},
    {0, NULL, NULL, 0, 0, "moe.down.warps", 8, "initial guess before measurement"},
    {0, NULL, NULL, 0, 0, "moe.down.unroll", 4, "initial guess before measurement"},
    /* END TUNED ROWS */
};
const int opgraft__baked_table_len = (int)(sizeof opgraft__baked_table / sizeof *opgraft__baked_table);
