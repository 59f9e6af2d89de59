/* The ops of libopgraft: one line an op registers its descriptor with the core. */
#include "linear/linear.h"
#include "attention/attention.h"
#include "moe/moe.h"

const og_op *const opgraft__op_list[] = {
    &opgraft__moe_op,
    &opgraft__linear_op,
    &opgraft__attention_op,
    NULL,
};
