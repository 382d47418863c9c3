/* keel_strerror and keel_version. */
#include <keel/keel.h>

#include <string.h>

const char *keel_strerror(int err) {
  switch (err) {
    case 0:
      return "success";
    case KEEL_EINVAL:
      return "invalid argument";
    case KEEL_ENOMEM:
      return "out of memory";
    case KEEL_EBUSY:
      return "busy (in use)";
    case KEEL_EEXIST:
      return "already exists";
    case KEEL_ENOENT:
      return "not found";
    case KEEL_EAGAIN:
      return "would block";
    case KEEL_EDEADLK:
      return "deadlock detected";
    case KEEL_ETIMEDOUT:
      return "timed out";
    case KEEL_ECANCELED:
      return "cancelled";
    case KEEL_ESHUTDOWN:
      return "shut down";
    case KEEL_ENOSPC:
      return "out of space";
    case KEEL_EPERM:
      return "not permitted";
    case KEEL_ECORRUPT:
      return "corrupt structure";
    case KEEL_EVERSION:
      return "unsupported format version";
    case KEEL_ELOCKED:
      return "locked by another process";
    default:
      return err < 0 ? strerror(-err) : "unknown error";
  }
}

const char *keel_version(void) {
  return KEEL_VERSION_STRING;
}
