/* Valgrind sees pool objects (src/pool/track.h): run under memcheck by
 * CTest, this program writes to a pool object after keel_pool_free, and the
 * test passes only if memcheck reports exactly that one error. Outside
 * Valgrind it only allocates and frees. */
#include <stdio.h>
#include <string.h>

#include <keel/pool.h>

#include "pool/pool_impl.h"
#include "pool/track.h"

int main(void) {
  keel_pool_t *p = keel_pool_create("dict", 128, 0, NULL);
  if (p == NULL) return 1;
  unsigned char *o = keel_pool_alloc(p);
  memset(o, 1, 128);
  keel_pool_free(p, o);
  /* The write stores the debug pattern's own byte, so debug builds' reuse
   * check stays quiet and only memcheck can notice it. */
  if (POOL_ON_VALGRIND()) o[5] = POOL_FREE_BYTE;
  unsigned char *q = keel_pool_alloc(p); /* the same object, allocated again */
  memset(q, 3, 128);                     /* no error: it is live */
  keel_pool_free(p, q);
  int rc = keel_pool_destroy(p);
  printf("%s, destroy %d\n", POOL_ON_VALGRIND() ? "under valgrind" : "plain run", rc);
  return rc != 0;
}
