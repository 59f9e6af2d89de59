/* Link-time stand-in for glibc 2.28's libpthread.so.0 (never loaded, never installed): libopgraft's
 * pthread_once gets the version libpthread has there and every later glibc keeps (since 2.34 in
 * libc). The body never runs. */
int pthread_once(int *once, void (*init)(void)) { return 0; }
