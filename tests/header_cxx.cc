// The public header compiles alone from C++ and links by C names.
#include "pagedkv.h"
int main()
{
    pkv_status s = PKV_OK;
    return static_cast<int>(s);
}
