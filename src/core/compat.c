/* Calls whose default glibc symbol versions are newer than the oldest glibc the wheel supports
 * (glibc 2.28, manylinux_2_28). With OG_GLIBC_2_28 (set by CMake for x86_64 glibc builds) they
 * bind to the versions glibc 2.28 has, which every later glibc keeps: stat and fstat through
 * __xstat/__fxstat (glibc 2.33 made stat and fstat functions of their own), exp through its
 * GLIBC_2.2.5 version (2.29 added one without the errno wrapper; the same results). Elsewhere they
 * are the plain calls. dlopen and pthread_once, which glibc 2.34 moved into libc under a new
 * version, are bound to libdl and libpthread at link time instead (cmake/glibc_2_28/). */
#include <math.h>
#include <sys/stat.h>

#include "internal.h"

#if defined(OG_GLIBC_2_28)
#if !defined(__x86_64__) || !defined(__GLIBC__)
#error "OG_GLIBC_2_28 is for x86_64 glibc builds"
#endif
extern int __xstat(int ver, const char *path, struct stat *sb);
extern int __fxstat(int ver, int fd, struct stat *sb);
__asm__(".symver __xstat,__xstat@GLIBC_2.2.5");
__asm__(".symver __fxstat,__fxstat@GLIBC_2.2.5");
__asm__(".symver exp,exp@GLIBC_2.2.5");
enum { OG_STAT_VER = 1 }; /* _STAT_VER_LINUX on x86_64: the kernel's struct stat */

int opgraft__stat(const char *path, struct stat *sb) { return __xstat(OG_STAT_VER, path, sb); }
int opgraft__fstat(int fd, struct stat *sb) { return __fxstat(OG_STAT_VER, fd, sb); }
double opgraft__exp(double x) { return exp(x); }
#else
int opgraft__stat(const char *path, struct stat *sb) { return stat(path, sb); }
int opgraft__fstat(int fd, struct stat *sb) { return fstat(fd, sb); }
double opgraft__exp(double x) { return exp(x); }
#endif
