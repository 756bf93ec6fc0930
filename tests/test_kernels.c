/* PLACEHOLDER suite: replaced by its owner. */
#include "testutil.h"
START_TEST(placeholder) { ck_assert_int_eq(pkv_status_str(PKV_OK) != NULL, 1); }
END_TEST
int main(void)
{
    Suite *s = suite_create("kernels");
    TCase *tc = tcase_create("placeholder");
    tcase_add_test(tc, placeholder);
    suite_add_tcase(s, tc);
    return pkvt_run(s);
}
